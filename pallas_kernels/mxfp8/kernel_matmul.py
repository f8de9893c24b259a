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
that multicast the shared operand.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_NUM_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tile sizes of the block-scaled FP8 GEMM.

    Attributes:
      tile_n: columns of the CTA tile (a multiple of the column-scale group, <= 256).
        Each of the two compute warpgroups owns 64 rows, so the CTA tile is 128 x tile_n
        and every warpgroup holds two float32 `64 x tile_n` accumulators in registers.
      max_concurrent_steps: depth of the TMA pipeline (K blocks in flight).
      grid_tile_width: width of the tile swizzle of the persistent grid (L2 reuse).
      cluster: None, "m" (2 CTAs on adjacent row tiles share one multicast B tile) or
        "n" (2 CTAs on adjacent column tiles share the A tile): halves that operand's
        L2 -> SMEM traffic.
    """

    tile_n: int = 128
    max_concurrent_steps: int = 6
    grid_tile_width: int = 8
    cluster: str | None = None

    def __post_init__(self):
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 32 in [32, 256], got {self.tile_n}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
        if self.cluster not in (None, "m", "n"):
            raise ValueError(f'cluster must be None, "m" or "n", got {self.cluster!r}')

    @property
    def m_multiple(self) -> int:
        """M must be a multiple of this."""
        return _CTA_M * (2 if self.cluster == "m" else 1)

    @property
    def n_multiple(self) -> int:
        """N must be a multiple of this."""
        return self.tile_n * (2 if self.cluster == "n" else 1)


def default_config(block_k: int) -> TuningConfig:
    """The default tiles for K blocks of `block_k` (32: more, smaller pipeline stages)."""
    return TuningConfig(tile_n=128, max_concurrent_steps=8 if block_k == 32 else 4, cluster="n")


_WG_M = 64  # rows per compute warpgroup: one wgmma row group
_CTA_M = _NUM_COMPUTE_WGS * _WG_M


def _num_sms() -> int:
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else 4


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
    if k != k2 or k % block_k or m % config.m_multiple or n % config.n_multiple:
        raise ValueError(f"unsupported shapes a={a.shape}, b={b.shape} for block_k={block_k}, {config}")
    if row_scales.shape != (k // block_k, m) or col_scales.shape != (k // block_k, n):
        raise ValueError(f"scale shapes {row_scales.shape}, {col_scales.shape} do not match a={a.shape}, b={b.shape}")
    k_iters = k // block_k
    cl_m = 2 if config.cluster == "m" else 1
    cl_n = 2 if config.cluster == "n" else 1
    m_iters, n_iters = m // (_CTA_M * cl_m), n // (tile_n * cl_n)
    steps = min(config.max_concurrent_steps, k_iters)
    fp8_transforms = (plgpu.TilingTransform((8, block_k)), plgpu.SwizzleTransform(block_k))  # one K row = block_k bytes
    out_swizzle = plgpu.find_swizzle(tile_n * jnp.dtype(out_dtype).itemsize * 8)
    out_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
    out_transforms = (plgpu.TilingTransform((8, out_elems)), plgpu.SwizzleTransform(out_swizzle))
    n_groups = tile_n // col_group

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (_CTA_M, block_k),
                    lambda kb: (0, kb),
                    transforms=fp8_transforms,
                    collective_axes=("cluster",) if config.cluster == "n" else (),
                ),
                plgpu.BlockSpec(
                    (tile_n, block_k),
                    lambda kb: (0, kb),
                    transforms=fp8_transforms,
                    collective_axes=("cluster",) if config.cluster == "m" else (),
                ),
                plgpu.BlockSpec((1, _CTA_M), lambda kb: (kb, 0)),
                plgpu.BlockSpec((1, tile_n), lambda kb: (kb, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=_NUM_COMPUTE_WGS,
            max_concurrent_steps=steps,
            compute_context=compute_context,
        )

    def kernel(a_gmem, b_gmem, rs_gmem, cs_gmem, out_gmem):
        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, rs_gmem, cs_gmem),
            out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, _WG_M, tile_n), out_dtype, transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")
            cta = lax.axis_index("cluster")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _tile_loop(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, config.grid_tile_width)
                if cl_m == 2:
                    mi = mi * 2 + cta
                if cl_n == 2:
                    ni = ni * 2 + cta
                m_sl = pl.ds(mi * _CTA_M, _CTA_M)
                n_sl = pl.ds(ni * tile_n, tile_n)
                wg_rows = pl.ds(wg * _WG_M, _WG_M)

                def compute_context(run_pipeline):
                    zero = plgpu.layout_cast(jnp.zeros((_WG_M, tile_n), jnp.float32), plgpu.Layout.WGMMA)
                    acc = run_pipeline(zero)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_smem[wg] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[m_sl, n_sl].at[wg_rows])

                def body(_, a_smem, b_smem, rs_smem, cs_smem, acc):
                    def mma(part_ref):
                        plgpu.wgmma(part_ref, a_smem.at[wg_rows], b_smem.T)
                        return part_ref[...]

                    # The FP8 MMA of this K block into a fresh float32 accumulator ...
                    part = pl.run_scoped(mma, plgpu.ACC((_WG_M, tile_n), jnp.float32))
                    # ... promoted with scale(row) * scale(column group): one FFMA per element.
                    rows = plgpu.load(rs_smem.at[0, wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                    scale = jnp.concatenate(
                        [lax.broadcast_in_dim(rows * cs_smem[0, g * col_group], (_WG_M, col_group), [0]) for g in range(n_groups)],
                        axis=1,
                    )
                    return acc + part * scale

                get_pipeline(body, compute_context)(
                    a_gmem.at[m_sl], b_gmem.at[n_sl], rs_gmem.at[:, m_sl], cs_gmem.at[:, n_sl], allocations=allocs
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    cluster_size = cl_m * cl_n
    num_ctas = min(_num_sms() // cluster_size, m_iters * n_iters) * cluster_size
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_ctas // cluster_size,),
        grid_names=("sm",),
        cluster=(cluster_size,),
        cluster_names=("cluster",),
        num_threads=_NUM_COMPUTE_WGS + 1,
        thread_name="wg",
    )(a, b, row_scales, col_scales)
