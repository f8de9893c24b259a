"""JFA backward, dK/dV kernel (Pallas Mosaic GPU, Hopper).

Equivalent jnp, per sequence b with rows s and head h (x the scaled scores of
the forward, lse its log-sum-exp, delta = rowsum(dout * out))::

    p  = exp(x - lse)                               # causal entries are 0
    dv[s, h] = p.T @ dout[s, h]
    dk[s, h] = scale * (p * (dout[s, h] @ v[s, h].T - delta)).T @ q[s, h]

Each work item is one head of one 128-row key tile of one sequence; two
compute warpgroups own 64 key rows each and walk the sequence's queries in
blocks of 64 (with their lse and delta) that a third warpgroup streams through
a two-slot TMA ring. Under causal masking a key tile j starts at query block
2j. Only the first query block(s) (rows of the previous sequence inside the
aligned window, the causal diagonal) and the last one are masked, in
registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
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

_BLOCKS_PER_TILE = TILE_ROWS // BWD_BLOCK


def dkv_steps(item: _mgpu.Item, causal: bool, window=None):
    """First query block a key tile visits, and how many blocks it visits."""
    if window is not None:
        return _mgpu.window_steps(item, BWD_BLOCK, causal, window, rows="keys")
    blocks = (item.hi + BWD_BLOCK - 1) // BWD_BLOCK
    first = item.tile * _BLOCKS_PER_TILE if causal else jnp.int32(0)
    return first, jnp.maximum(blocks - first, 0) * item.keys


def backward_dkv(q, k, v, dout, lse, delta, plan: schedule.Plan, *, causal: bool, scale: float, num_ctas: int,
                 window=None):
    """Runs the dK/dV kernel.

    Args:
      q, k, v, dout: `[T, H, D]` bf16 or f16.
      lse: `[H, NT * 128]` f32, the forward's base-2 log-sum-exp in tile space.
      delta: `[H, NT * 128]` f32, `rowsum(dout * out)` in tile space.
      plan: the batch's work list (`kv_table` order).
      causal, scale, num_ctas, window: as for the forward.

    Returns:
      `(dk, dv)`, each `[T, H, D]` in q.dtype; slack rows are 0.
    """
    capacity, heads, head_dim = q.shape
    dtype = q.dtype
    end = plan.meta[schedule.META_END]
    tails = [schedule.tail_rows(x, end) for x in (q, k, v, dout)]
    interpret = mgpu_common.interpreting()
    c2 = scale * _mgpu.LOG2E

    def kernel(table_ref, meta_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               qt_ref, kt_ref, vt_ref, dot_ref, dk_ref, dv_ref, scratch):
        k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, dk_staging, dv_staging, stage, bars = scratch
        k_bar, v_bar, item_free, q_bar, do_bar, lse_bar, delta_bar, ring_free, item_go = bars

        def load_rows(item, w, end_row):
            row = item.row0 + w * WG_ROWS
            _mgpu.copy_rows_in(k_ref, kt_ref, row, WG_ROWS, item.head, end_row, k_smem.at[w], k_bar.at[w])
            _mgpu.copy_rows_in(v_ref, vt_ref, row, WG_ROWS, item.head, end_row, v_smem.at[w], v_bar.at[w])

        def stream(item, gstep, n, end_row):
            # Not `walk.block_stream`: four operands share one slot release (`ring_free`), and lse
            # and delta are float32 vectors read at tile-space columns (`copy_vector_in`).
            first, _ = dkv_steps(item, causal, window)

            def step(i, carry):
                g = gstep + i
                slot = lax.rem(g, NUM_STAGES)
                block = first + i
                row = item.base + block * BWD_BLOCK
                col = item.first * TILE_ROWS + block * BWD_BLOCK

                @pl.when(g >= NUM_STAGES)
                def _():
                    plgpu.barrier_wait(ring_free.at[slot])

                _mgpu.copy_rows_in(q_ref, qt_ref, row, BWD_BLOCK, item.head, end_row, q_smem.at[slot], q_bar.at[slot])
                _mgpu.copy_vector_in(lse_ref, item.head, col, BWD_BLOCK, lse_smem.at[slot], lse_bar.at[slot])
                _mgpu.copy_rows_in(do_ref, dot_ref, row, BWD_BLOCK, item.head, end_row, do_smem.at[slot], do_bar.at[slot])
                _mgpu.copy_vector_in(delta_ref, item.head, col, BWD_BLOCK, delta_smem.at[slot], delta_bar.at[slot])
                return carry

            lax.fori_loop(0, n, step, None)

        def compute(share: walk.Share):
            item, wg = share.item, share.wg
            a_stage = None if stage is None else stage.at[wg]

            def step(i, carry, masked: bool):
                dk, dv = carry
                slot = lax.rem(share.gstep + i, NUM_STAGES)
                shape = (WG_ROWS, BWD_BLOCK)  # key rows x query columns
                plgpu.barrier_wait(q_bar.at[slot])
                s_t = mgpu_common.matmul(k_smem.at[wg], q_smem.at[slot].transpose((1, 0)), shape)
                plgpu.barrier_wait(lse_bar.at[slot])
                lse = _mgpu.load_col_vector(lse_smem.at[slot])
                p_t = jnp.exp2(s_t * c2 - lax.broadcast_in_dim(lse, shape, [1]))
                if masked:
                    mask = _mgpu.visible(
                        (share.first_block + i) * BWD_BLOCK + _mgpu.iota(shape, 1), share.pos0 + _mgpu.iota(shape, 0),
                        item, causal, window, inside="queries",
                    )
                    p_t = jnp.where(mask, p_t, 0.0)
                plgpu.barrier_wait(do_bar.at[slot])
                dv = _mgpu.matmul_acc(dv, p_t.astype(dtype), do_smem.at[slot], a_stage)
                dp_t = mgpu_common.matmul(v_smem.at[wg], do_smem.at[slot].transpose((1, 0)), shape)
                plgpu.barrier_wait(delta_bar.at[slot])
                delta = _mgpu.load_col_vector(delta_smem.at[slot])
                ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, shape, [1]))
                if masked:
                    ds_t = jnp.where(mask, ds_t, 0.0)
                dk = _mgpu.matmul_acc(dk, ds_t.astype(dtype), q_smem.at[slot], a_stage)
                plgpu.barrier_arrive(ring_free.at[slot])
                return dk, dv

            carry = (_mgpu.zeros_tile(WG_ROWS, head_dim), _mgpu.zeros_tile(WG_ROWS, head_dim))
            head = share.n if window is not None else (2 if causal else (item.lo > 0).astype(jnp.int32))
            return share.run_steps(step, carry, head, 1)

        def finish(share: walk.Share, carry):
            dk, dv = carry
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free again
            share.store((dk * scale).astype(dtype), dk_staging, dk_ref)
            share.store(dv.astype(dtype), dv_staging, dv_ref)

        walk.run_pass(
            walk.Pass(
                steps=lambda item: dkv_steps(item, causal, window),
                load_rows=load_rows,
                stream=stream,
                item_ready=(k_bar, v_bar),
                ring_ready=(q_bar, lse_bar, do_bar, delta_bar),
                ring_free=(ring_free,),
                item_free=item_free,
                item_go=item_go,
                compute=compute,
                finish=finish,
            ),
            table_ref, meta_ref, heads, num_ctas,
        )

    per_wg_rows = mgpu_common.swizzled_smem((NUM_COMPUTE_WGS, WG_ROWS, head_dim), dtype)
    ring_rows = mgpu_common.swizzled_smem((NUM_STAGES, BWD_BLOCK, head_dim), dtype)
    ring_vector = plgpu.SMEM((NUM_STAGES, BWD_BLOCK), jnp.float32)
    item_barrier = plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS)
    ring_barrier = plgpu.Barrier(num_barriers=NUM_STAGES)
    scratch = (
        per_wg_rows,
        per_wg_rows,
        ring_rows,
        ring_rows,
        ring_vector,
        ring_vector,
        mgpu_common.staging_smem(NUM_COMPUTE_WGS, head_dim, dtype),
        mgpu_common.staging_smem(NUM_COMPUTE_WGS, head_dim, dtype),
        mgpu_common.swizzled_smem((NUM_COMPUTE_WGS, WG_ROWS, BWD_BLOCK), dtype) if interpret else None,
        (
            item_barrier,
            item_barrier,
            plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
            ring_barrier,
            ring_barrier,
            ring_barrier,
            ring_barrier,
            plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=NUM_STAGES),
            plgpu.Barrier(num_arrivals=1),
        ),
    )
    out_type = jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype)
    operands = (plan.kv_table, plan.meta, q, k, v, dout, lse, delta, *tails)
    return walk.launch(kernel, scratch, (out_type, out_type), num_ctas, *operands)
