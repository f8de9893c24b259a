"""Mosaic GPU (Hopper, sm_90a) block-scaled FP8 GEMM: `out = a @ b.T` with scales applied in float32.

Hopper has no block-scaled MMA instruction, so the kernel promotes on the CUDA cores
(the DeepSeek-V3 / DeepGEMM scheme, arXiv:2412.19437 section 3.3): for every K block of
`block_k` elements it runs the FP8 wgmma into a zeroed float32 accumulator, waits for it,
and folds it into the float32 result with the block's scale product::

    for kb in range(K // block_k):
        part = a8[:, kb] @ b8[:, kb].T                       # wgmma, float32 accumulator
        out += part * row_scale[kb][:, None] * col_scale[kb][None, :]

`block_k = 32` is the MXFP8 32x32 kernel (one FFMA per output element per 32 K, the
same order of work as the MMA itself); `block_k = 128` is the 1x128 / 128x128 promotion
variant (DeepGEMM's granularity, a quarter of the CUDA-core work).

Layout: a `[M, K]` and b `[N, K]` FP8 E4M3, both K-major (the only layout Hopper's FP8
wgmma reads). Row scales are float32 `[K // block_k, M]` (one per row of `a`, already
expanded from the block scales), column scales float32 `[K // block_k, N]` (one per
column, constant over each `col_group` columns). Two compute warpgroups each own 64
rows of a 128 x `tile_n` CTA tile and share the B tile; a third warpgroup issues the
TMA copies. The grid is persistent (one CTA per SM), optionally in clusters of two CTAs
that multicast the shared operand. A pipeline step may carry several K blocks, each MMA'd
into its own accumulator, so that promoting one block overlaps the MMA of the next (the
32-wide kernel is latency-bound per block otherwise; see benchmarks/mxfp8.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import manual_axes, persistent_gemm

_NUM_COMPUTE_WGS = persistent_gemm.NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tile sizes of the block-scaled FP8 GEMM.

    Attributes:
      tile_n: columns of the CTA tile (a multiple of the column-scale group, <= 256).
        Each of the two compute warpgroups owns 64 rows, so the CTA tile is 128 x tile_n.
      max_concurrent_steps: depth of the TMA pipeline (pipeline steps in flight).
      grid_tile_width: width of the tile swizzle of the persistent grid (L2 reuse).
      cluster: None, "m" (2 CTAs on adjacent row tiles share one multicast B tile) or
        "n" (2 CTAs on adjacent column tiles share the A tile): halves that operand's
        L2 -> SMEM traffic.
      k_blocks_per_step: K blocks per pipeline step, each MMA'd into its own float32
        accumulator; all are issued at once and block j is promoted while blocks > j
        still run on the tensor cores (`k_blocks_per_step + 1` accumulators of
        `64 x tile_n` per warpgroup must fit in the registers: 2 at tile_n=128).
    """

    tile_n: int = 128
    max_concurrent_steps: int = 6
    grid_tile_width: int = 8
    cluster: str | None = None
    k_blocks_per_step: int = 1

    def __post_init__(self):
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 32 in [32, 256], got {self.tile_n}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
        if self.k_blocks_per_step < 1:
            raise ValueError(f"k_blocks_per_step must be >= 1, got {self.k_blocks_per_step}")
        if self.cluster not in persistent_gemm.CLUSTERS:
            raise ValueError(f'cluster must be None, "m" or "n", got {self.cluster!r}')

    @property
    def m_multiple(self) -> int:
        """M must be a multiple of this."""
        return _CTA_M * persistent_gemm.cluster_shape(self.cluster)[0]

    def k_multiple(self, block_k: int) -> int:
        """K must be a multiple of this."""
        return block_k * self.k_blocks_per_step

    @property
    def n_multiple(self) -> int:
        """N must be a multiple of this."""
        return self.tile_n * persistent_gemm.cluster_shape(self.cluster)[1]


def default_config(block_k: int) -> TuningConfig:
    """The tiles measured best on an H200 (benchmarks/results/mxfp8_h200_tuned.json).

    32-wide K blocks: two blocks per step (the promotion of one overlaps the MMA of the
    other), 4 stages of two; 128-wide: one block per step, 4 stages. Both in clusters of
    two CTAs sharing (multicasting) the A tile.
    """
    if block_k == 32:
        return TuningConfig(tile_n=128, max_concurrent_steps=4, cluster="n", k_blocks_per_step=2)
    return TuningConfig(tile_n=128, max_concurrent_steps=4, cluster="n", k_blocks_per_step=1)


_WG_M = persistent_gemm.WG_M  # rows per compute warpgroup: one wgmma row group
_CTA_M = persistent_gemm.CTA_M


def scaled_matmul(
    a: jax.Array,
    b: jax.Array,
    row_scales: jax.Array,
    col_scales: jax.Array,
    *,
    block_k: int,
    col_group: int,
    out_dtype,
    config: TuningConfig,
) -> jax.Array:
    """`out[m, n] = sum_kb (a8[m, kb] . b8[n, kb]) * row_scales[kb, m] * col_scales[kb, n]`.

    Args:
      a: float8_e4m3fn `[M, K]`, M a multiple of `config.m_multiple`, K of `block_k`.
      b: float8_e4m3fn `[N, K]`, N a multiple of `config.n_multiple`.
      row_scales: float32 `[K // block_k, M]`.
      col_scales: float32 `[K // block_k, N]`; only the first column of each aligned group
        of `col_group` columns is read (the scale is constant over the group).
      block_k: 32 or 128, the K extent of one promotion (and of one pipeline step).
      col_group: 32 or 128; must divide `tile_n`.
      out_dtype: dtype of the result.
      config: tile sizes.

    Returns:
      `[M, N]` in `out_dtype`.

    Raises:
      ValueError: shapes that do not fit the tiles.
    """
    m, k = a.shape
    n, k2 = b.shape
    tile_n = config.tile_n
    if block_k not in (32, 128) or col_group not in (32, 128) or tile_n % col_group:
        raise ValueError(f"block_k={block_k} and col_group={col_group} must be 32 or 128 and divide tile_n={tile_n}")
    if k != k2 or k % config.k_multiple(block_k) or m % config.m_multiple or n % config.n_multiple:
        raise ValueError(f"unsupported shapes a={a.shape}, b={b.shape} for block_k={block_k}, {config}")
    if row_scales.shape != (k // block_k, m) or col_scales.shape != (k // block_k, n):
        raise ValueError(f"scale shapes {row_scales.shape}, {col_scales.shape} do not match a={a.shape}, b={b.shape}")
    per_step = config.k_blocks_per_step
    k_steps = k // (block_k * per_step)
    cl_m, cl_n = persistent_gemm.cluster_shape(config.cluster)
    m_iters, n_iters = m // (_CTA_M * cl_m), n // (tile_n * cl_n)
    steps = min(config.max_concurrent_steps, k_steps)
    fp8_transforms = (plgpu.TilingTransform((8, block_k)), plgpu.SwizzleTransform(block_k))  # one K row = block_k bytes
    out_swizzle = plgpu.find_swizzle(tile_n * jnp.dtype(out_dtype).itemsize * 8)
    out_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
    out_transforms = (plgpu.TilingTransform((8, out_elems)), plgpu.SwizzleTransform(out_swizzle))
    n_groups = tile_n // col_group

    def fp8_spec(rows, j, shared):
        return plgpu.BlockSpec(
            (rows, block_k),
            lambda s: (0, s * per_step + j),
            transforms=fp8_transforms,
            collective_axes=("cluster",) if shared else (),
        )

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                *(fp8_spec(_CTA_M, j, config.cluster == "n") for j in range(per_step)),
                *(fp8_spec(tile_n, j, config.cluster == "m") for j in range(per_step)),
                plgpu.BlockSpec((per_step, _CTA_M), lambda s: (s, 0)),
                plgpu.BlockSpec((per_step, tile_n), lambda s: (s, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=_NUM_COMPUTE_WGS,
            max_concurrent_steps=steps,
            compute_context=compute_context,
        )

    def kernel(a_gmem, b_gmem, rs_gmem, cs_gmem, out_gmem):
        ignore = lambda *_, **__: None
        gmem_refs = (*(a_gmem,) * per_step, *(b_gmem,) * per_step, rs_gmem, cs_gmem)

        @functools.partial(
            pl.run_scoped,
            allocs=get_pipeline(ignore, ignore).get_allocations(*gmem_refs),
            out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, _WG_M, tile_n), out_dtype, transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")
            cta = lax.axis_index("cluster")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _tile_loop(info):
                (lin,) = info.index
                _, m_sl, n_sl, wg_rows = persistent_gemm.tile(lin, m_iters, n_iters, tile_n, config.grid_tile_width, config.cluster, cta, wg)
                zero = lambda: plgpu.layout_cast(jnp.zeros((_WG_M, tile_n), jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731

                def block_scale(rs_smem, cs_smem, j):
                    """Per-thread compact scales of K block j of this step: rows x column-group scalars."""
                    rows = plgpu.load(rs_smem.at[j, wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                    return tuple(rows * cs_smem[j, g * col_group] for g in range(n_groups))

                def promote(acc, part, scale):
                    """`acc + part * scale(row) * scale(column group)`: one FFMA per element."""
                    full = jnp.concatenate([lax.broadcast_in_dim(v, (_WG_M, col_group), [0]) for v in scale], axis=1)
                    return acc + part * full

                def store(acc):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_smem[wg] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[m_sl, n_sl].at[wg_rows])

                def body(_, *refs):
                    a_refs, b_refs = refs[:per_step], refs[per_step : 2 * per_step]
                    rs_smem, cs_smem, acc = refs[2 * per_step :]

                    def mma(*parts):
                        # The FP8 MMAs of this step's K blocks, each into a fresh float32 accumulator,
                        # all in flight at once; each block is promoted as soon as its MMA is done,
                        # while the later ones still run on the tensor cores.
                        for part, a_smem, b_smem in zip(parts, a_refs, b_refs):
                            plgpu.wgmma(part, a_smem.at[wg_rows], b_smem.T)
                        out = acc
                        for j, part in enumerate(parts):
                            done = plgpu.wgmma_accumulator_load(part, wait_n=per_step - 1 - j)
                            out = promote(out, done, block_scale(rs_smem, cs_smem, j))
                        return out

                    return pl.run_scoped(mma, *[plgpu.ACC((_WG_M, tile_n), jnp.float32)] * per_step)

                def context(run_pipeline):
                    store(run_pipeline(zero()))

                get_pipeline(body, context)(
                    *(a_gmem.at[m_sl],) * per_step,
                    *(b_gmem.at[n_sl],) * per_step,
                    rs_gmem.at[:, m_sl],
                    cs_gmem.at[:, n_sl],
                    allocations=allocs,
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    cluster_size = cl_m * cl_n
    num_ctas = persistent_gemm.num_ctas(m_iters * n_iters, config.cluster)
    matmul = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_ctas // cluster_size,),
        grid_names=("sm",),
        cluster=(cluster_size,),
        cluster_names=("cluster",),
        num_threads=_NUM_COMPUTE_WGS + 1,
        thread_name="wg",
    )
    return manual_axes.call_kernel(matmul, a, b, row_scales, col_scales)
