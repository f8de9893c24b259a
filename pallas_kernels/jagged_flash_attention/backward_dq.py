"""JFA backward, dQ kernel (Pallas Mosaic GPU, Hopper).

Equivalent jnp, per sequence b with rows s and head h (x the scaled scores of
the forward, lse its log-sum-exp, delta = rowsum(dout * out))::

    p  = exp(x - lse)                               # causal entries are 0
    dq[s, h] = scale * (p * (dout[s, h] @ v[s, h].T - delta)) @ k[s, h]

Each work item is one head of one 128-row query tile (the forward's work
list); two compute warpgroups own 64 query rows each and walk the sequence's
keys in blocks of 64 that a third warpgroup streams through a two-slot TMA
ring (FlashAttention-2 backward split into a dQ and a dK/dV pass, as in
FlashAttention-3's deterministic mode). Only the first key block (rows of the
previous sequence inside the aligned window) and the last one or two blocks
(sequence end, causal diagonal) are masked, in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import manual_axes, mgpu_common
from pallas_kernels.jagged_flash_attention import _mgpu, schedule
from pallas_kernels.jagged_flash_attention.config import (
    BWD_BLOCK,
    COMPUTE_REGISTERS,
    MEMORY_REGISTERS,
    ROW_ALIGN,
    NUM_COMPUTE_WGS,
    NUM_STAGES,
    TILE_ROWS,
    WG_ROWS,
)


def dq_steps(item: _mgpu.Item, causal: bool, window=None):
    """`(first, n)`: the 64-row key blocks a query tile visits."""
    if window is not None:
        return _mgpu.window_steps(item, BWD_BLOCK, causal, window, rows="queries")
    blocks = (item.hi + BWD_BLOCK - 1) // BWD_BLOCK
    if causal:
        blocks = jnp.minimum(blocks, (item.tile + 1) * (TILE_ROWS // BWD_BLOCK))
    return jnp.int32(0), blocks * item.keys


def backward_dq(q, k, v, dout, lse, delta, plan: schedule.Plan, *, causal: bool, scale: float, num_ctas: int,
                window=None):
    """Runs the dQ kernel.

    Args:
      q, k, v, dout: `[T, H, D]` bf16 or f16.
      lse: `[H, NT * 128]` f32, the forward's base-2 log-sum-exp in tile space.
      delta: `[H, NT * 128]` f32, `rowsum(dout * out)` in tile space.
      plan: the batch's work list.
      causal, scale, num_ctas, window: as for the forward.

    Returns:
      dq `[T, H, D]` in q.dtype; slack rows are 0.
    """
    capacity, heads, head_dim = q.shape
    dtype = q.dtype
    end = plan.meta[schedule.META_END]
    tails = [schedule.tail_rows(x, end) for x in (q, k, v, dout)]
    interpret = mgpu_common.interpreting()
    c2 = scale * _mgpu.LOG2E

    def kernel(table_ref, meta_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               qt_ref, kt_ref, vt_ref, dot_ref, dq_ref, scratch):
        q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, staging, stage, bars = scratch
        q_bar, do_bar, lse_bar, delta_bar, item_free, k_bar, v_bar, k_free, v_free, item_go = bars
        cta, wg, rounds, end_row = _mgpu.walk_start(meta_ref, heads, num_ctas)

        @pl.when(wg == NUM_COMPUTE_WGS)
        def _memory_wg():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def load_rows(item, w):
                row = item.row0 + w * WG_ROWS
                col = item.canon * TILE_ROWS + w * WG_ROWS
                _mgpu.copy_rows_in(q_ref, qt_ref, row, WG_ROWS, item.head, end_row, q_smem.at[w], q_bar.at[w])
                _mgpu.copy_rows_in(do_ref, dot_ref, row, WG_ROWS, item.head, end_row, do_smem.at[w], do_bar.at[w])
                _mgpu.copy_vector_in(lse_ref, item.head, col, WG_ROWS, lse_smem.at[w], lse_bar.at[w])
                _mgpu.copy_vector_in(delta_ref, item.head, col, WG_ROWS, delta_smem.at[w], delta_bar.at[w])

            def stream(item, gstep, n):
                kv = [(k_ref, kt_ref, k_smem, k_bar), (v_ref, vt_ref, v_smem, v_bar)]
                first = dq_steps(item, causal, window)[0]
                base = pl.multiple_of(item.base + first * BWD_BLOCK, ROW_ALIGN)
                _mgpu.stream_blocks(n, gstep, base, BWD_BLOCK, item.head, end_row, kv, (k_free, v_free))

            steps = _mgpu.issue_items(
                table_ref, heads, num_ctas, cta, rounds, lambda item: dq_steps(item, causal, window)[1],
                load_rows, stream, item_free, item_go,
            )
            _mgpu.drain_rings(steps, k_free, v_free)

        @pl.when(wg < NUM_COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            ds_stage = None if stage is None else stage.at[wg]

            def item_body(r, gstep):
                item = _mgpu.Item.read(table_ref, _mgpu.zigzag_item(r, num_ctas, cta), heads)
                first, n = dq_steps(item, causal, window)
                lo_w, hi_w = item.wg_rows(wg)
                plgpu.barrier_wait(item_go)
                q_pos0 = item.tile * TILE_ROWS + wg * WG_ROWS

                @pl.when(hi_w > lo_w)
                def _work():
                    @pl.when(n > 0)
                    def _():
                        for b in (q_bar, do_bar, lse_bar, delta_bar):
                            plgpu.barrier_wait(b.at[wg])

                    lse_i = _mgpu.load_row_vector(lse_smem.at[wg])
                    delta_i = _mgpu.load_row_vector(delta_smem.at[wg])

                    def step(i, dq, masked: bool):
                        slot = lax.rem(gstep + i, NUM_STAGES)
                        shape = (WG_ROWS, BWD_BLOCK)
                        plgpu.barrier_wait(k_bar.at[slot])
                        plgpu.barrier_wait(v_bar.at[slot])
                        s, dp = _mgpu.matmul_pair(
                            q_smem.at[wg], k_smem.at[slot].transpose((1, 0)),
                            do_smem.at[wg], v_smem.at[slot].transpose((1, 0)), shape,
                        )
                        plgpu.barrier_arrive(v_free.at[slot])
                        p = jnp.exp2(s * c2 - lax.broadcast_in_dim(lse_i, shape, [0]))
                        ds = p * (dp - lax.broadcast_in_dim(delta_i, shape, [0]))
                        if masked:
                            mask = _mgpu.visible(
                                q_pos0 + _mgpu.iota(shape, 0), (first + i) * BWD_BLOCK + _mgpu.iota(shape, 1), item,
                                causal, window,
                            )
                            ds = jnp.where(mask, ds, 0.0)
                        dq = _mgpu.matmul_acc(dq, ds.astype(dtype), k_smem.at[slot], ds_stage)
                        plgpu.barrier_arrive(k_free.at[slot])
                        return dq

                    dq = _mgpu.zeros_tile(WG_ROWS, head_dim)
                    head_masked = n if window is not None else (item.lo > 0).astype(jnp.int32)
                    plain_lo, plain_hi = _mgpu.step_segments(n, head_masked, 2 if causal else 1)
                    dq = _mgpu.loop(0, plain_lo, functools.partial(step, masked=True), dq)
                    dq = _mgpu.loop(plain_lo, plain_hi, functools.partial(step, masked=False), dq)
                    dq = _mgpu.loop(plain_hi, n, functools.partial(step, masked=True), dq)
                    plgpu.barrier_arrive(item_free)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free again
                    mgpu_common.store_rows(
                        (dq * scale).astype(dtype), staging, wg, dq_ref, item.row0 + wg * WG_ROWS, item.head, lo_w, hi_w
                    )

                @pl.when(hi_w <= lo_w)
                def _idle():
                    _mgpu.skip_steps(gstep, n, (k_bar, v_bar), (k_free, v_free))
                    plgpu.barrier_arrive(item_free)

                return gstep + n

            lax.fori_loop(0, rounds, item_body, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

    def entry(*refs):
        per_wg_rows = mgpu_common.swizzled_smem((NUM_COMPUTE_WGS, WG_ROWS, head_dim), dtype)
        per_wg_vector = plgpu.SMEM((NUM_COMPUTE_WGS, WG_ROWS), jnp.float32)
        ring = mgpu_common.swizzled_smem((NUM_STAGES, BWD_BLOCK, head_dim), dtype)
        item_barrier = plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS)
        ring_barrier = plgpu.Barrier(num_barriers=NUM_STAGES)
        free_barrier = plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=NUM_STAGES)
        scratch = (
            per_wg_rows,
            per_wg_rows,
            per_wg_vector,
            per_wg_vector,
            ring,
            ring,
            mgpu_common.staging_smem(NUM_COMPUTE_WGS, head_dim, dtype),
            mgpu_common.swizzled_smem((NUM_COMPUTE_WGS, WG_ROWS, BWD_BLOCK), dtype) if interpret else None,
            (
                item_barrier,
                item_barrier,
                item_barrier,
                item_barrier,
                plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
                ring_barrier,
                ring_barrier,
                free_barrier,
                free_barrier,
                plgpu.Barrier(num_arrivals=1),
            ),
        )
        pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, collective_axes="wg")

    launch = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    return manual_axes.call_kernel(launch, plan.q_table, plan.meta, q, k, v, dout, lse, delta, *tails)
