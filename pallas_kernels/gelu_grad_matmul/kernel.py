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

Opt-in epilogue overlap (`TuningConfig.ctas_per_sm=2`, `two_cta_config()`; unmeasured): in the
kernel above both compute warpgroups run their epilogues at once with no wgmma under them
(on an H100, M=166656, N=4096, K=1024: 3.27 ms against cuBLAS's 1.73 ms GEMM). The variant
runs one warpgroup per CTA, owning whole 128 x tile_n tiles, two CTAs per SM, so the SM
interleaves one CTA's epilogue with the other's wgmmas: the effect of CUTLASS's Hopper
pingpong schedule (two consumer warpgroups taking tiles in turn), obtained from occupancy
as this repository's block-local attention forward does (`_two_cta_gelu_grad_matmul`).
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
SM_SMEM_BYTES = 228 * 1024  # an H100 / H200 SM's shared memory, shared by its resident CTAs
CTA_RESERVED_SMEM = 1024  # shared memory the hardware reserves for each resident CTA (CUDA guide, sm_90)
# Dynamic shared memory of a CTA when two must be resident on one SM: 112 KiB + 1 KiB.
TWO_CTA_SMEM_BYTES = SM_SMEM_BYTES // 2 - CTA_RESERVED_SMEM
# What Mosaic GPU adds to `TuningConfig.smem_bytes` (its 2 KiB reduction scratch, the barriers, alignment):
# 2088 and 2608 bytes for the two-CTA configs of the tests; the lowering test checks the sum against
# TWO_CTA_SMEM_BYTES.
SMEM_OVERHEAD_BYTES = 4096
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
      ctas_per_sm: 1 (the warp-specialised kernel above: one CTA of two compute warpgroups and
        a TMA warpgroup per SM) or 2 (opt-in, unmeasured: `_two_cta_kernel`, one warpgroup per
        CTA computing the whole 128 x tile_n tile, a persistent grid of 2 x the SM count, and
        shared memory under half an SM's, so that two CTAs are resident on each SM and one's
        epilogue runs under the other's wgmmas). Needs `cluster=None` and `delay_release=0`
        (the variant releases its ring slots itself) and `smem_bytes <= TWO_CTA_SMEM_BYTES`,
        e.g. tile_n=128 with 2 stages and the shared h buffer, or tile_n=64 with 3.
    """

    tile_n: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    cluster: str | None = None
    delay_release: int = 0
    separate_h_buffer: bool = True
    approx_math: bool = False
    ctas_per_sm: int = 1

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
        if isinstance(self.ctas_per_sm, bool) or self.ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm must be 1 or 2, got {self.ctas_per_sm!r}")
        if self.ctas_per_sm == 2:
            if self.cluster is not None:
                raise ValueError(f"ctas_per_sm=2 runs without clusters (cluster=None), got cluster={self.cluster!r}")
            if self.delay_release:
                raise ValueError(f"ctas_per_sm=2 releases its ring slots itself: delay_release must be 0, got {self.delay_release!r}")
            if self.smem_bytes + SMEM_OVERHEAD_BYTES > TWO_CTA_SMEM_BYTES:
                raise ValueError(
                    f"{self} needs {self.smem_bytes} + {SMEM_OVERHEAD_BYTES} bytes of shared memory, over the "
                    f"{TWO_CTA_SMEM_BYTES} that let two CTAs share a Hopper SM (fewer max_concurrent_steps, "
                    "separate_h_buffer=False or a smaller tile_n)"
                )
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
        ones_blocks = 3 if self.ctas_per_sm == 1 else 1  # one per warpgroup
        return self.max_concurrent_steps * step + staging * (2 if self.separate_h_buffer else 1) + ones_blocks * SUM_N * 64 * 2 + 2 * self.tile_n * 4


def default_config() -> TuningConfig:
    """128 x 128 CTA tiles, 4 pipeline stages, own h buffers (192 KiB of SMEM); untuned (no GPU measurement yet)."""
    return TuningConfig()


def two_cta_config() -> TuningConfig:
    """Opt-in epilogue overlap: two one-warpgroup CTAs per SM, 128 x 128 tiles, 2 ring slots each, h in the dh
    staging buffer (98 KiB of SMEM + Mosaic GPU's 2 KiB; 255 registers and 24 B of spills per ptxas for sm_90a).
    Unmeasured on a GPU."""
    return TuningConfig(max_concurrent_steps=2, separate_h_buffer=False, ctas_per_sm=2)


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
    if config.ctas_per_sm == 2:
        return _two_cta_gelu_grad_matmul(dy, w, h, config)
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


def _two_cta_gelu_grad_matmul(dy: jax.Array, w: jax.Array, h: jax.Array, config: TuningConfig) -> tuple[jax.Array, jax.Array]:
    """`gelu_grad_matmul` for `config.ctas_per_sm == 2`: two one-warpgroup CTAs per SM.

    Why. In the warp-specialised kernel both compute warpgroups finish their K loops together
    and run the epilogue (h load wait, float32 GELU derivative, dh store, column-sum wgmma) at
    the same time, with no wgmma under it: on an H100 at M=166656, N=4096, K=1024 the kernel
    takes 1.89x a bare cuBLAS GEMM. CUTLASS's Hopper "pingpong" schedule
    (`KernelTmaWarpSpecializedPingpong`, cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized_pingpong.hpp)
    hides the epilogue by giving each of two consumer warpgroups whole tiles, ordered so one
    runs its MMAs while the other runs its epilogue. This variant gets the same overlap from
    the hardware instead of from ordering barriers (the two-CTA occupancy approach of this
    repository's block-local attention forward, `block_local_attention/forward.py`): a CTA is
    one warpgroup that owns whole 128 x tile_n tiles, the persistent grid has 2 x the SM count
    CTAs, and a CTA's shared memory is under half an SM's (`TWO_CTA_SMEM_BYTES`), so two CTAs
    share each SM and the warp schedulers interleave one CTA's epilogue with the other's wgmmas.
    No `setmaxnreg` (`emit_pipeline_warp_specialized` raises a lone compute warpgroup to 256
    registers, and ptxas then sizes every thread for one CTA per SM): ptxas allocates what the
    code needs, and 2 CTAs x 128 threads may use up to 255 registers a thread.

    How. One warpgroup issues its own TMA loads through a `max_concurrent_steps`-slot ring of
    `[128, 64]` dy and `[tile_n, 64]` w blocks that runs across tiles: step s of the CTA's
    sequence (tile s // k_steps, K block s % k_steps) lands in slot s % S, and slot s % S is
    refilled with step s + S once step s's wgmma has finished (`wgmma_wait(1)` after step s + 1
    is issued; after the tile's last step, its final wait). So the next tile's first K blocks
    load while this tile's epilogue runs. The accumulator is `[128, tile_n]` float32 (one
    wgmma of two 64-row instructions a K block; tile_n registers a thread); the epilogue takes
    it in two 64-row halves, each as the warp-specialised kernel's warpgroup epilogue (h from
    SMEM, dh in float32, bf16 store by TMA, column sums by a `dh_half.T @ ones` wgmma), so the
    outputs, partials `[M // 64, N]` included, are those of the default kernel.

    Unmeasured: whether two CTAs are resident (the GPU run must check ptxas's registers and the
    achieved occupancy), and whether two slots a CTA hide the loads' latency (the ring holds
    one K block ahead of the wgmma; the SM as a whole, two).
    """
    m, k = dy.shape
    n = w.shape[0]
    tile_n, slots = config.tile_n, config.max_concurrent_steps
    m_iters, n_iters = m // CTA_M, n // tile_n
    num_tiles, k_steps = m_iters * n_iters, k // BLOCK_K
    ctas = persistent_gemm.num_ctas(num_tiles, None, ctas_per_sm=2)

    def kernel(dy_gmem, w_gmem, h_gmem, ones_gmem, dh_gmem, part_gmem, a_ring, b_ring, ring_barriers, out_smem,
               ones_smem, sums_smem, h_barriers, ones_barrier, *h_smem):
        h_ref = h_smem[0] if config.separate_h_buffer else out_smem
        cta = lax.axis_index("sm")
        tiles = lax.div(num_tiles - cta + (ctas - 1), jnp.int32(ctas))  # this CTA's: cta, cta + ctas, ...
        total = tiles * k_steps  # its K steps, over all its tiles

        def tile_of(t):
            return persistent_gemm.tile_index(cta + t * ctas, m_iters, n_iters, config.grid_tile_width, None, cta)

        def load(s):
            """TMA loads of step s (tile s // k_steps, K block s % k_steps) into slot s % S, if the CTA has a step s."""

            @pl.when(s < total)
            def _():
                mi, ni = tile_of(lax.div(s, k_steps))
                ks, slot = pl.ds(lax.rem(s, k_steps) * BLOCK_K, BLOCK_K), lax.rem(s, slots)
                plgpu.copy_gmem_to_smem(dy_gmem.at[pl.ds(mi * CTA_M, CTA_M), ks], a_ring.at[slot], ring_barriers.at[slot])
                plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(ni * tile_n, tile_n), ks], b_ring.at[slot], ring_barriers.at[slot])

        plgpu.copy_gmem_to_smem(ones_gmem, ones_smem, ones_barrier)
        for s in range(slots):  # the ring's first steps; a CTA has at least one tile
            load(jnp.int32(s))
        plgpu.barrier_wait(ones_barrier)

        def tile_body(t, carry):
            mi, ni = tile_of(t)
            m_sl, n_sl = pl.ds(mi * CTA_M, CTA_M), pl.ds(ni * tile_n, tile_n)
            first = t * k_steps
            if not config.separate_h_buffer:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dh and sums left the buffer
            # h's tile lands while the K loop runs.
            for half in range(2):
                plgpu.copy_gmem_to_smem(h_gmem.at[m_sl, n_sl].at[pl.ds(half * WG_M, WG_M)], h_ref.at[half], h_barriers.at[half])

            def k_loop(acc_ref):
                def step(kk, c):
                    s = first + kk
                    slot = lax.rem(s, slots)
                    plgpu.barrier_wait(ring_barriers.at[slot])
                    plgpu.wgmma(acc_ref, a_ring.at[slot], b_ring.at[slot].T)
                    plgpu.wgmma_wait(1)  # step s - 1's wgmma finished: its slot takes step s - 1 + S
                    pl.when(kk > 0)(lambda: load(s - 1 + slots))
                    return c

                lax.fori_loop(0, k_steps, step, None)
                return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)

            g = pl.run_scoped(k_loop, plgpu.ACC((CTA_M, tile_n), jnp.float32))
            load(first + k_steps - 1 + slots)  # the last step's slot: the next tile's loads land under this epilogue
            if config.separate_h_buffer:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dh and sums left SMEM
            for half in range(2):
                rows = pl.ds(half * WG_M, WG_M)
                plgpu.barrier_wait(h_barriers.at[half])
                hv = plgpu.load(h_ref.at[half], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                _, dh = activations.value_and_vjp(Activation.GELU, hv, g[half * WG_M:(half + 1) * WG_M])
                out_ref = out_smem.at[half]
                out_ref[...] = dh.astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_ref, dh_gmem.at[m_sl, n_sl].at[rows])
                # Column sums of the rounded half tile on the tensor cores: dh_half.T @ ones, [tile_n, 8].
                copies = mgpu_common.matmul(out_ref.T, ones_smem.T, (tile_n, SUM_N))
                sums_smem[half] = jnp.sum(copies, axis=1) * (1.0 / SUM_N)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(sums_smem.at[half], part_gmem.at[mi * 2 + half, n_sl])
            return carry

        lax.fori_loop(0, tiles, tile_body, None)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    staging = plgpu.SMEM((2, WG_M, tile_n), jnp.bfloat16, transforms=_TRANSFORMS)
    scratch = (
        plgpu.SMEM((slots, CTA_M, BLOCK_K), jnp.bfloat16, transforms=_TRANSFORMS),
        plgpu.SMEM((slots, tile_n, BLOCK_K), jnp.bfloat16, transforms=_TRANSFORMS),
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # dy's and w's copies
        staging,
        plgpu.SMEM((SUM_N, 64), jnp.bfloat16, transforms=_TRANSFORMS),
        plgpu.SMEM((2, tile_n), jnp.float32),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(),
    ) + ((staging,) if config.separate_h_buffer else ())
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((m // WG_M, n), jnp.float32)),
        scratch_types=scratch,
        grid=(ctas,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math),
    )
    return manual_axes.call_kernel(call, *manual_axes.match_axes(dy, w, h, jnp.ones((SUM_N, 64), jnp.bfloat16)))
