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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import mgpu_common
from pallas_kernels.jagged_flash_attention import _mgpu, schedule, walk
from pallas_kernels.jagged_flash_attention.config import (
    BWD_BLOCK,
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

        def load_rows(item, w, end_row):
            row = item.row0 + w * WG_ROWS
            col = item.canon * TILE_ROWS + w * WG_ROWS
            _mgpu.copy_rows_in(q_ref, qt_ref, row, WG_ROWS, item.head, end_row, q_smem.at[w], q_bar.at[w])
            _mgpu.copy_rows_in(do_ref, dot_ref, row, WG_ROWS, item.head, end_row, do_smem.at[w], do_bar.at[w])
            _mgpu.copy_vector_in(lse_ref, item.head, col, WG_ROWS, lse_smem.at[w], lse_bar.at[w])
            _mgpu.copy_vector_in(delta_ref, item.head, col, WG_ROWS, delta_smem.at[w], delta_bar.at[w])

        def compute(share: walk.Share):
            item, wg = share.item, share.wg
            ds_stage = None if stage is None else stage.at[wg]
            lse_i = _mgpu.load_row_vector(lse_smem.at[wg])
            delta_i = _mgpu.load_row_vector(delta_smem.at[wg])

            def step(i, dq, masked: bool):
                slot = lax.rem(share.gstep + i, NUM_STAGES)
                shape = (WG_ROWS, BWD_BLOCK)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                s, dp = mgpu_common.matmul_pair(
                    q_smem.at[wg], k_smem.at[slot].transpose((1, 0)),
                    do_smem.at[wg], v_smem.at[slot].transpose((1, 0)), shape,
                )
                plgpu.barrier_arrive(v_free.at[slot])
                p = jnp.exp2(s * c2 - lax.broadcast_in_dim(lse_i, shape, [0]))
                ds = p * (dp - lax.broadcast_in_dim(delta_i, shape, [0]))
                if masked:
                    mask = _mgpu.visible(
                        share.pos0 + _mgpu.iota(shape, 0), (share.first_block + i) * BWD_BLOCK + _mgpu.iota(shape, 1), item,
                        causal, window,
                    )
                    ds = jnp.where(mask, ds, 0.0)
                dq = _mgpu.matmul_acc(dq, ds.astype(dtype), k_smem.at[slot], ds_stage)
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            dq = _mgpu.zeros_tile(WG_ROWS, head_dim)
            head_masked = share.n if window is not None else (item.lo > 0).astype(jnp.int32)
            return share.run_steps(step, dq, head_masked, 2 if causal else 1)

        def finish(share: walk.Share, dq):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free again
            share.store((dq * scale).astype(dtype), staging, dq_ref)

        walk.run_pass(
            walk.Pass(
                steps=lambda item: dq_steps(item, causal, window),
                load_rows=load_rows,
                stream=walk.block_stream(
                    lambda item: dq_steps(item, causal, window), BWD_BLOCK,
                    [(k_ref, kt_ref, k_smem, k_bar), (v_ref, vt_ref, v_smem, v_bar)], (k_free, v_free),
                ),
                item_ready=(q_bar, do_bar, lse_bar, delta_bar),
                ring_ready=(k_bar, v_bar),
                ring_free=(k_free, v_free),
                item_free=item_free,
                item_go=item_go,
                compute=compute,
                finish=finish,
            ),
            table_ref, meta_ref, heads, num_ctas,
        )

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
    out_type = jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype)
    return walk.launch(kernel, scratch, out_type, num_ctas, plan.q_table, plan.meta, q, k, v, dout, lse, delta, *tails)
