"""Mosaic GPU (Hopper, sm_90a) bf16 GEMM with a GELU-backward epilogue and bias-gradient partials.

    g  = dy @ w.T                                       # wgmma, float32 accumulator
    dh = (g * gelu_tanh_grad(h)).astype(bfloat16)        # in the epilogue, from registers
    partials[2 * mi + wg, n] = sum over the 64 rows of warpgroup wg's tile of dh[:, n]

The fusion is cuBLASLt's `CUBLASLT_EPILOGUE_DGELU_BGRAD` (the GEMM's epilogue applies the
GELU derivative of the saved pre-activation and reduces the bias gradient), written on
this project's persistent, warp-specialised GEMM (`pallas_kernels/_src/persistent_gemm.py`,
shared with the block-scaled FP8 GEMM `pallas_kernels/mxfp8/kernel_matmul.py`).

Layout: dy `[M, K]` and w `[N, K]` bf16, both K-major (w is flax's down-projection kernel,
`[hidden, out]`: wgmma reads it as the transposed B operand); h `[M, N]` bf16. A CTA tile
is 128 x `tile_n`; two compute warpgroups own 64 rows each and share the w tile, a third
warpgroup issues the TMA copies of 64-wide K blocks (64 bf16 = one 128-byte swizzle row)
through a `max_concurrent_steps`-deep pipeline. Before its K loop a compute warpgroup
starts the TMA load of its `[64, tile_n]` h tile, which lands while the wgmmas run; after
the loop it computes dh in float32 in the accumulator's registers, rounds it to bf16 and
stores it through SMEM with TMA.

The bias gradient sums the *rounded* dh over rows. The column sums of the warpgroup's
`[64, tile_n]` dh tile, already in SMEM for its TMA store, come from one more small wgmma:
`dh_tile.T @ ones[64, 8]` (dh's SMEM tile read as a transposed A operand), `[tile_n, 8]`
float32 with every column the column sums; a sum over that accumulator's 8 columns (within
a warp: no shared-memory reduction) divided by 8 leaves one value per column of dh (exact
in float32 up to the last bit, as the 8 copies are equal). It costs 1/128 of the tile's K
loop's tensor-core work (8 columns against K = 1024; more in time, an N = 8 wgmma being less efficient) and a 512-byte TMA store of float32
partials `[M // 64, N]`, which the caller sums over rows (XLA).

The epilogue runs with no wgmma under it (on an H100, M=166656, N=4096, K=1024: 3.26 ms
against cuBLAS's 1.74 ms bare GEMM). Hiding it by occupancy instead, one warpgroup per CTA
owning whole 128 x tile_n tiles and two CTAs per SM (the effect of CUTLASS's Hopper pingpong
schedule), measured slower on the same H100 and shape: 3.74 ms at tile_n 128 with two ring
slots, 4.00 ms at tile_n 64 with three
(`benchmarks/results/gelu_grad_matmul_two_ctas_h100_6da778c_20261207.json`), and was not kept.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import manual_axes, mgpu_common, persistent_gemm
from pallas_kernels.gdpa import activations
from pallas_kernels.gdpa.reference import Activation

BLOCK_K = 64  # K elements of a pipeline step: 64 bf16 = one 128-byte swizzle row
WG_M = persistent_gemm.WG_M
CTA_M = persistent_gemm.CTA_M
SUM_N = 8  # columns of the ones operand of the column-sum wgmma (the smallest wgmma N)
SMEM_BYTES = 227 * 1024  # an H100 / H200 CTA's shared memory
_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16, 128-byte swizzle


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tile sizes and pipeline of the fused GEMM.

    Attributes:
      tile_n: columns of the CTA tile, a multiple of 64 in [64, 256]. The CTA tile is
        128 x tile_n (two warpgroups of 64 rows); each warpgroup's float32 accumulator
        takes tile_n / 2 registers a thread.
      max_concurrent_steps: depth of the TMA pipeline (K blocks of 64 in flight), >= 2.
      grid_tile_width: width of the persistent grid's tile swizzle (L2 reuse).
      cluster: None, "m" (2 CTAs on adjacent row tiles share one multicast w tile) or
        "n" (2 CTAs on adjacent column tiles share the dy tile).
      delay_release: 0 (each K step waits for its wgmma before releasing its SMEM slot) or
        1 (one wgmma left in flight; the slot is released a step later). Unverified on a GPU:
        the pipeline does not release the last step's slot, and whether the TMA warpgroup's
        prologue for the next tile can refill it while that wgmma still reads it was not
        settled (the interpreter runs wgmmas synchronously); jax's own Hopper matmul example
        uses the same pattern. Keep 0 until a GPU check passes.
      separate_h_buffer: load h into an SMEM buffer of its own (True: needs 2 x 64 x tile_n
        bf16 more SMEM; the load starts without waiting for the previous tile's dh store)
        or into the dh staging buffer (False: the warpgroup waits for the previous tile's
        dh store to leave SMEM before it starts the next load).
      approx_math: tanh on the hardware approximation (`tanh.approx.f32`, about 2^-11
        relative error) instead of the accurate sequence.
    """

    tile_n: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    cluster: str | None = None
    delay_release: int = 0
    separate_h_buffer: bool = True
    approx_math: bool = False

    def __post_init__(self):
        if not isinstance(self.tile_n, int) or self.tile_n % 64 or not 64 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 64 in [64, 256], got {self.tile_n!r}")
        if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be an int >= 2, got {self.max_concurrent_steps!r}")
        if not isinstance(self.grid_tile_width, int) or self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be an int >= 1, got {self.grid_tile_width!r}")
        if self.cluster not in persistent_gemm.CLUSTERS:
            raise ValueError(f'cluster must be None, "m" or "n", got {self.cluster!r}')
        if self.delay_release not in (0, 1):
            raise ValueError(f"delay_release must be 0 or 1, got {self.delay_release!r}")
        if not isinstance(self.separate_h_buffer, bool) or not isinstance(self.approx_math, bool):
            raise ValueError(f"separate_h_buffer and approx_math must be bools, got {self.separate_h_buffer!r}, {self.approx_math!r}")
        if self.smem_bytes > SMEM_BYTES:
            raise ValueError(f"{self} needs {self.smem_bytes} bytes of shared memory, over the {SMEM_BYTES} of a Hopper CTA")

    @property
    def m_multiple(self) -> int:
        """M must be a multiple of this."""
        return CTA_M * persistent_gemm.cluster_shape(self.cluster)[0]

    @property
    def n_multiple(self) -> int:
        """N must be a multiple of this."""
        return self.tile_n * persistent_gemm.cluster_shape(self.cluster)[1]

    k_multiple = BLOCK_K  # K must be a multiple of this

    @property
    def smem_bytes(self) -> int:
        """Shared memory the kernel allocates (pipeline, staging, ones, partials), barriers aside."""
        step = (CTA_M + self.tile_n) * BLOCK_K * 2
        staging = 2 * WG_M * self.tile_n * 2
        return self.max_concurrent_steps * step + staging * (2 if self.separate_h_buffer else 1) + 3 * SUM_N * 64 * 2 + 2 * self.tile_n * 4


def default_config() -> TuningConfig:
    """128 x 128 CTA tiles, 4 pipeline stages, own h buffers (192 KiB of SMEM).

    At the step's shape on an H100 (M=166656, N=4096, K=1024) the tile_n 256, cluster and
    five-shared-stage variants ran within 1.3% of it (`benchmarks/gelu_grad_matmul_bench.py`,
    `benchmarks/results/gelu_grad_matmul_h100_f9b15f9.json`); `approx_math` 11% faster, with twice
    the bf16 roundings off by one ulp.
    """
    return TuningConfig()


def gelu_grad_matmul(dy: jax.Array, w: jax.Array, h: jax.Array, *, config: TuningConfig) -> tuple[jax.Array, jax.Array]:
    """`(dh, partials)`: `dh = (dy @ w.T * gelu_tanh_grad(h)).astype(bfloat16)` and its column sums per 64 rows.

    Args:
      dy: bfloat16 `[M, K]`, M a positive multiple of `config.m_multiple`, K of 64.
      w: bfloat16 `[N, K]`, N a multiple of `config.n_multiple`.
      h: bfloat16 `[M, N]`, the GELU's input.
      config: tiles and pipeline.

    Returns:
      dh, bfloat16 `[M, N]`; partials, float32 `[M // 64, N]`: row r is the sum of dh's rows
      `[64 r, 64 r + 64)` (its float32 values); `partials.sum(0)` is the bias gradient.

    Raises:
      ValueError: dtypes other than bfloat16, or shapes that do not fit the tiles.
    """
    m, k = dy.shape
    n, k2 = w.shape
    if any(x.dtype != jnp.bfloat16 for x in (dy, w, h)):
        raise ValueError(f"the kernel takes bfloat16 dy, w, h, got {dy.dtype}, {w.dtype}, {h.dtype}")
    if k != k2 or h.shape != (m, n) or not m or m % config.m_multiple or n % config.n_multiple or k % BLOCK_K:
        raise ValueError(f"unsupported shapes dy={dy.shape}, w={w.shape}, h={h.shape} for {config}")
    tile_n = config.tile_n
    cl_m, cl_n = persistent_gemm.cluster_shape(config.cluster)
    m_iters, n_iters = m // (CTA_M * cl_m), n // (tile_n * cl_n)
    k_steps = k // BLOCK_K
    steps = min(config.max_concurrent_steps, k_steps)

    def spec(rows, shared):
        return plgpu.BlockSpec(
            (rows, BLOCK_K),
            lambda s: (0, s),
            transforms=_TRANSFORMS,
            collective_axes=("cluster",) if shared else (),
            delay_release=config.delay_release,
        )

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[spec(CTA_M, config.cluster == "n"), spec(tile_n, config.cluster == "m")],
            wg_axis="wg",
            num_compute_wgs=persistent_gemm.NUM_COMPUTE_WGS,
            max_concurrent_steps=steps,
            compute_context=compute_context,
        )

    def kernel(dy_gmem, w_gmem, h_gmem, ones_gmem, dh_gmem, part_gmem):
        ignore = lambda *_, **__: None
        staging = plgpu.SMEM((2, WG_M, tile_n), jnp.bfloat16, transforms=_TRANSFORMS)

        scratch = dict(
            allocs=get_pipeline(ignore, ignore).get_allocations(dy_gmem, w_gmem),
            out_smem=staging,
            ones_smem=plgpu.SMEM((3, SUM_N, 64), jnp.bfloat16, transforms=_TRANSFORMS),
            sums_smem=plgpu.SMEM((2, tile_n), jnp.float32),
            h_barrier=plgpu.Barrier(num_barriers=2),
            ones_barrier=plgpu.Barrier(num_barriers=3),
        )
        if config.separate_h_buffer:
            scratch["h_smem"] = staging

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(allocs, out_smem, ones_smem, sums_smem, h_barrier, ones_barrier, h_smem=None):
            wg = lax.axis_index("wg")
            cta = lax.axis_index("cluster")
            # The B operand of the column-sum wgmma (one [8, 64] block per warpgroup, the TMA one's unused).
            plgpu.copy_gmem_to_smem(ones_gmem, ones_smem.at[wg], ones_barrier.at[wg])
            plgpu.barrier_wait(ones_barrier.at[wg])

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _tile_loop(info):
                (lin,) = info.index
                mi, m_sl, n_sl, wg_rows = persistent_gemm.tile(lin, m_iters, n_iters, tile_n, config.grid_tile_width, config.cluster, cta, wg)
                out_ref = out_smem.at[wg]
                h_ref = (h_smem if config.separate_h_buffer else out_smem).at[wg]

                def body(_, dy_smem, w_smem, acc_ref):
                    plgpu.wgmma(acc_ref, dy_smem.at[wg_rows], w_smem.T)
                    plgpu.wgmma_wait(config.delay_release)
                    return acc_ref

                def context(run_pipeline):
                    if not config.separate_h_buffer:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dh left the buffer
                    # h's tile lands while the K loop runs.
                    plgpu.copy_gmem_to_smem(h_gmem.at[m_sl, n_sl].at[wg_rows], h_ref, h_barrier.at[wg])

                    def k_loop(acc_ref):
                        run_pipeline(acc_ref)
                        return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)

                    g = pl.run_scoped(k_loop, plgpu.ACC((WG_M, tile_n), jnp.float32))
                    plgpu.barrier_wait(h_barrier.at[wg])
                    hv = plgpu.load(h_ref, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                    _, dh = activations.value_and_vjp(Activation.GELU, hv, g)
                    if config.separate_h_buffer:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dh and sums left SMEM
                    out_ref[...] = dh.astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_ref, dh_gmem.at[m_sl, n_sl].at[wg_rows])
                    # Column sums of the rounded tile on the tensor cores: dh_tile.T @ ones, [tile_n, 8].
                    copies = mgpu_common.matmul(out_ref.T, ones_smem.at[wg].T, (tile_n, SUM_N))
                    sums_smem[wg] = jnp.sum(copies, axis=1) * (1.0 / SUM_N)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(sums_smem.at[wg], part_gmem.at[mi * persistent_gemm.NUM_COMPUTE_WGS + wg, n_sl])

                get_pipeline(body, context)(dy_gmem.at[m_sl], w_gmem.at[n_sl], allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    cluster_size = cl_m * cl_n
    ctas = persistent_gemm.num_ctas(m_iters * n_iters, config.cluster)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((m // WG_M, n), jnp.float32)),
        grid=(ctas // cluster_size,),
        grid_names=("sm",),
        cluster=(cluster_size,),
        cluster_names=("cluster",),
        num_threads=persistent_gemm.NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math),
    )
    # Under shard_map all operands (the ones block too) vary over the same manual axes, as the kernel's results will.
    return manual_axes.call_kernel(call, *manual_axes.match_axes(dy, w, h, jnp.ones((SUM_N, 64), jnp.bfloat16)))

