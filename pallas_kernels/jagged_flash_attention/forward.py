"""JFA forward kernel (Pallas Mosaic GPU, Hopper): jagged softmax attention + log-sum-exp.

Equivalent jnp, per sequence b with rows s = offsets[b]:offsets[b+1] and head h::

    x = (q[s, h] @ k[s, h].T) * scale        # float32, causal: -inf above the diagonal
    out[s, h] = softmax(x) @ v[s, h]
    lse[s, h] = logsumexp(x, axis=-1) / ln 2  # kept per tile, for the backward

Each work item is one head of one 128-row query tile of one sequence; two
compute warpgroups own 64 query rows each and walk the sequence's keys in
blocks of 128 with an online softmax (FlashAttention-2, Dao 2023) while a third
warpgroup streams K/V blocks through a two-slot TMA ring (FlashAttention-3
warp specialisation, Shah et al. 2024). The kernel is persistent: CTA c takes
items c, 2C-1-c, 2C+c, ... of the work list sorted by work (`schedule`).

Boundary handling (GEM's JFA zero-fills rows past a sequence with per-sequence
TMA descriptors and subtracts the extra exp(0 - m) terms; Pallas builds TMA
descriptors on the host over the whole packed buffer, so a block that runs past
a sequence end holds the next sequence's rows, not zeros, and the subtraction
loses all precision for scores near -16 and below): each sequence is read
through an 8-aligned window (`schedule`), and only the first key block (when
the window starts before the sequence) and the last one are masked, in
registers, with -inf before the row max. Blocks that cross the end of the real
data are read from a zero-padded tail copy so slack rows never reach P @ V.
Outputs are written only for the item's own rows (`mgpu_common.store_rows`).
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
    FWD_BLOCK_KV,
    NUM_COMPUTE_WGS,
    NUM_STAGES,
    TILE_ROWS,
    WG_ROWS,
)


def forward_steps(item: _mgpu.Item, causal: bool, window=None):
    """`(first, n)`: the key blocks an item visits: all of its sequence, up to its
    diagonal, or those a sliding window reaches."""
    if window is not None:
        return _mgpu.window_steps(item, FWD_BLOCK_KV, causal, window, rows="queries")
    blocks = (item.hi + FWD_BLOCK_KV - 1) // FWD_BLOCK_KV
    if causal:
        blocks = jnp.minimum(blocks, item.tile + 1)
    return jnp.int32(0), blocks * item.keys


def forward(q, k, v, plan: schedule.Plan, *, causal: bool, scale: float, num_ctas: int, save_lse: bool,
            window=None):
    """Runs the forward kernel.

    Args:
      q, k, v: `[T, H, D]` bf16 or f16, D in {64, 128}.
      plan: the batch's work list (`schedule.build_plan`).
      causal, scale, window: as in `jagged_flash_attention`.
      num_ctas: persistent CTAs to launch (the GPU's SM count).
      save_lse: also return the log-sum-exp.

    Returns:
      `(out [T, H, D] q.dtype, lse [H, NT * 128] float32 or None)`; lse is in
      base 2 and in canonical tile order (`schedule.to_tile_space`); entries of
      rows outside a tile are unspecified.
    """
    capacity, heads, head_dim = q.shape
    dtype = q.dtype
    slots = plan.q_table.shape[0]
    end = plan.meta[schedule.META_END]
    tails = [schedule.tail_rows(x, end) for x in (q, k, v)]
    interpret = mgpu_common.interpreting()
    c2 = scale * _mgpu.LOG2E

    def kernel(table_ref, meta_ref, q_ref, k_ref, v_ref, qt_ref, kt_ref, vt_ref, out_ref, lse_ref, scratch):
        q_smem, k_smem, v_smem, lse_smem, staging, stage, bars = scratch
        q_bar, q_free, k_bar, v_bar, k_free, v_free, item_go = bars

        def load_rows(item, w, end_row):
            row = item.row0 + w * WG_ROWS
            _mgpu.copy_rows_in(q_ref, qt_ref, row, WG_ROWS, item.head, end_row, q_smem.at[w], q_bar.at[w])

        def compute(share: walk.Share):
            item, wg = share.item, share.wg
            p_stage = None if stage is None else stage.at[wg]

            def step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(share.gstep + i, NUM_STAGES)
                plgpu.barrier_wait(k_bar.at[slot])
                s = mgpu_common.matmul(q_smem.at[wg], k_smem.at[slot].transpose((1, 0)), (WG_ROWS, FWD_BLOCK_KV))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    shape = (WG_ROWS, FWD_BLOCK_KV)
                    mask = _mgpu.visible(
                        share.pos0 + _mgpu.iota(shape, 0), (share.first_block + i) * FWD_BLOCK_KV + _mgpu.iota(shape, 1),
                        item, causal, window,
                    )
                    s = jnp.where(mask, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1) * c2)
                # Under a sliding window a row may see no key of its first blocks:
                # its max stays -inf, and exp2(-inf - -inf) must not give NaN.
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if window is not None else m_new
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(s * c2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                plgpu.barrier_wait(v_bar.at[slot])
                acc = _mgpu.matmul_acc(acc, p.astype(dtype), v_smem.at[slot], p_stage)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = (
                _mgpu.zeros_tile(WG_ROWS, head_dim),
                _mgpu.row_vector(-jnp.inf, WG_ROWS),
                _mgpu.row_vector(0.0, WG_ROWS),
            )
            # A sliding window masks every step (both band edges can cross any block).
            head_masked = share.n if window is not None else (item.lo > 0).astype(jnp.int32)
            return share.run_steps(step, carry, head_masked, 1)

        def finish(share: walk.Share, carry):
            acc, m_i, l_i = carry
            item, wg = share.item, share.wg
            has_keys = l_i > 0
            inv_l = jnp.where(has_keys, 1.0 / jnp.where(has_keys, l_i, 1.0), 0.0)
            out = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free again
            share.store(out, staging, out_ref)
            if save_lse:
                lse_smem.at[wg][...] = jnp.where(
                    has_keys, m_i + jnp.log(jnp.where(has_keys, l_i, 1.0)) * (1.0 / _mgpu.LN2), -jnp.inf
                )
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    lse_smem.at[wg], lse_ref.at[item.head, pl.ds(item.canon * TILE_ROWS + wg * WG_ROWS, WG_ROWS)]
                )

        walk.run_pass(
            walk.Pass(
                steps=lambda item: forward_steps(item, causal, window),
                load_rows=load_rows,
                stream=walk.block_stream(
                    lambda item: forward_steps(item, causal, window), FWD_BLOCK_KV,
                    [(k_ref, kt_ref, k_smem, k_bar), (v_ref, vt_ref, v_smem, v_bar)], (k_free, v_free),
                ),
                item_ready=(q_bar,),
                ring_ready=(k_bar, v_bar),
                ring_free=(k_free, v_free),
                item_free=q_free,
                item_go=item_go,
                compute=compute,
                finish=finish,
            ),
            table_ref, meta_ref, heads, num_ctas,
        )

    scratch = (
        mgpu_common.swizzled_smem((NUM_COMPUTE_WGS, WG_ROWS, head_dim), dtype),
        mgpu_common.swizzled_smem((NUM_STAGES, FWD_BLOCK_KV, head_dim), dtype),
        mgpu_common.swizzled_smem((NUM_STAGES, FWD_BLOCK_KV, head_dim), dtype),
        plgpu.SMEM((NUM_COMPUTE_WGS, WG_ROWS), jnp.float32),
        mgpu_common.staging_smem(NUM_COMPUTE_WGS, head_dim, dtype),
        mgpu_common.swizzled_smem((NUM_COMPUTE_WGS, WG_ROWS, FWD_BLOCK_KV), dtype) if interpret else None,
        (
            plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
            plgpu.Barrier(num_barriers=NUM_STAGES),
            plgpu.Barrier(num_barriers=NUM_STAGES),
            plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=NUM_STAGES),
            plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=NUM_STAGES),
            plgpu.Barrier(num_arrivals=1),
        ),
    )
    out_type = (
        jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype),
        jax.ShapeDtypeStruct((heads, slots * TILE_ROWS), jnp.float32),
    )
    out, lse = walk.launch(kernel, scratch, out_type, num_ctas, plan.q_table, plan.meta, q, k, v, *tails)
    return out, (lse if save_lse else None)
