"""Block-local attention backward kernel (Pallas Mosaic GPU, Hopper): dQ, dK, dV with RoPE's backward fused, persistent.

Equivalent jnp, per 64-row block s and head h, with `qr, kr` the RoPE'd
operands and `rope_t` the transposed rotation (rotation by minus the angle)::

    p = softmax(qr @ kr.T * scale)
    dp = dout[s, h] @ v[s, h].T
    ds = p * (dp - sum(p * dp, axis=-1, keepdims=True))   # = p * (dp - rowsum(out * dout))
    dq[s, h] = rope_t(ds @ kr * scale)
    dk[s, h] = rope_t(ds.T @ qr * scale)
    dv[s, h] = p.T @ dout[s, h]

A work item is one 64-row block with all its heads; each head (a step)
recomputes the block's softmax (no residual beyond q, k, v), so dQ and dK/dV
come from one kernel without atomics. The step's two independent products, S
and dP, are issued together (`mgpu_common.matmul_pair`). RoPE's cos/sin tables
are computed once per block by each warpgroup that computes a head of it and
kept in its registers for its heads of the block (they rotate q and k on the
way in and dQ and dK on the way out). The transposed products use the
transposed frame (S^T = K Q^T with the row statistics read back as column
vectors), as jax's `attention_mgpu` backward does. Each gradient leaves
through the plain view of an operand slot that is no longer read (dQ through
k's, dV through v's, dK through q's). A fixed grid of CTAs walks the blocks'
steps with a three-slot TMA ring (`_mgpu.walk`): the next step's q, k, v, dO
load while the current one computes, and its gradient stores drain while the
next computes. Two steps are in flight per SM: at D=64 as two one-warpgroup
CTAs (110 KiB each); at D=128, where even a two-slot ring (142 KiB) leaves no
room for a second CTA, as two consumer warpgroups of one CTA (214 KiB, 256
threads) taking the CTA's steps alternately through its one ring, each with
its own dS, lse and delta scratch (`config.BACKWARD_WARPGROUPS`).
Sources: GEM engineering description (Meta, 2025), block-local attention with
RoPE's backward fused; persistent kernels with a TMA ring, as in
FlashAttention-3 (Shah et al., 2024).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import mgpu_common
from pallas_kernels.block_local_attention import _mgpu, schedule
from pallas_kernels.block_local_attention.config import BACKWARD_SLOTS, BACKWARD_WARPGROUPS, BLOCK
from pallas_kernels.jagged_flash_attention import schedule as jfa_schedule

LOG2E = math.log2(math.e)


def backward(q, k, v, dout, freqs, plan: schedule.Plan, *, scale: float, rope: bool, num_ctas: int,
             bounded_angles: bool = False):
    """Runs the backward kernel; returns `(dq, dk, dv)`, each `[T, H, D]` in q.dtype, slack rows 0.

    Arguments as in `forward.forward`, plus `dout [T, H, D]` (q.dtype), the output cotangent;
    `num_ctas` here is `BACKWARD_CTAS_PER_SM[D]` x the GPU's SM count.
    """
    capacity, heads, head_dim = q.shape
    dtype = q.dtype
    end = plan.end[0]
    tails = [jfa_schedule.tail_rows(x, end) for x in (q, k, v, dout)]
    c2 = scale * LOG2E
    shape = (BLOCK, BLOCK)
    warpgroups = BACKWARD_WARPGROUPS[head_dim]
    per_warpgroup = lambda shape: shape if warpgroups == 1 else (warpgroups, *shape)  # a step's own scratch

    def kernel(table_ref, live_ref, end_ref, pos_ref, freq_ref, q_ref, k_ref, v_ref, do_ref,
               qt_ref, kt_ref, vt_ref, dot_ref, dq_ref, dk_ref, dv_ref,
               q_ring, k_ring, v_ring, do_ring, ds_all, lse_all, delta_all, pos_ring, freq_smem,
               q_bars, k_bars, v_bars, do_bars, pos_bars, freq_bar, *handoff):
        end_row = end_ref[0]
        wg = _mgpu.warpgroup(warpgroups)
        ds_smem, lse_smem, delta_smem = (ref if warpgroups == 1 else ref.at[wg] for ref in (ds_all, lse_all, delta_all))
        operands = ((q_ref, qt_ref, q_ring, q_bars), (k_ref, kt_ref, k_ring, k_bars), (v_ref, vt_ref, v_ring, v_bars),
                    (do_ref, dot_ref, do_ring, do_bars))
        rotary = _mgpu.fused_rope(rope, freq_ref, freq_smem, freq_bar, pos_ref, pos_ring, pos_bars, warpgroups,
                                  bounded=bounded_angles)

        def load(step, slot):
            _mgpu.load_operands(operands, step, slot, end_row)

        def attend(step, slot, tables):
            rows = step.rows
            qs, ks, vs, dos = _mgpu.swizzle_loaded(operands, (True, True, False, False), slot, rows, tables)
            plgpu.commit_smem()

            # Query frame: softmax statistics, delta, dS and dQ.
            s, dp = mgpu_common.matmul_pair(qs, ks.transpose((1, 0)), dos, vs.transpose((1, 0)), shape)
            s = _mgpu.mask_keys(s * c2, rows, axis=1)
            m = s.max(axis=1)
            p = jnp.exp2(s - lax.broadcast_in_dim(m, shape, [0]))
            l = p.sum(axis=1)
            p = p * lax.broadcast_in_dim(1.0 / l, shape, [0])
            lse = m + jnp.log2(l)
            delta = (p * dp).sum(axis=1)
            ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))
            ds_smem[...] = ds.astype(dtype)
            lse_smem[...] = lse
            delta_smem[...] = delta
            plgpu.commit_smem()
            dq = mgpu_common.matmul(ds_smem, ks, (BLOCK, head_dim)) * scale
            if rope:
                dq = _mgpu.rotate(dq, tables, inverse=True)
            dq = dq.astype(dtype)

            # Key frame (rows are keys, columns queries): dV and dK.
            st = _mgpu.mask_keys(mgpu_common.matmul(ks, qs.transpose((1, 0)), shape) * c2, rows, axis=0)
            _mgpu.store_block(dq, k_ring[0].at[slot.index], dq_ref, step)  # k is read for the last time
            lse_col = plgpu.load(lse_smem, layout=_mgpu.LAYOUT.reduce(0))
            pt = jnp.exp2(st - lax.broadcast_in_dim(lse_col, shape, [1]))
            ds_smem[...] = pt.astype(dtype)  # dS (query frame) is no longer read: reuse for P^T
            plgpu.commit_smem()
            dv = mgpu_common.matmul(ds_smem, dos, (BLOCK, head_dim))
            dpt = mgpu_common.matmul(vs, dos.transpose((1, 0)), shape)
            _mgpu.store_block(dv.astype(dtype), v_ring[0].at[slot.index], dv_ref, step)  # v and dO are done
            delta_col = plgpu.load(delta_smem, layout=_mgpu.LAYOUT.reduce(0))  # loaded late: fewer live registers
            dst = pt * (dpt - lax.broadcast_in_dim(delta_col, shape, [1]))
            ds_smem[...] = dst.astype(dtype)
            plgpu.commit_smem()
            dk = mgpu_common.matmul(ds_smem, qs, (BLOCK, head_dim)) * scale
            if rope:
                dk = _mgpu.rotate(dk, tables, inverse=True)
            _mgpu.store_block(dk.astype(dtype), q_ring[0].at[slot.index], dk_ref, step)

        def slack(step, slot):
            zero = _mgpu.zeros(head_dim).astype(dtype)
            for ring, dst in ((q_ring, dq_ref), (k_ring, dk_ref), (v_ring, dv_ref)):
                _mgpu.store_block(zero, ring[0].at[slot.index], dst, step)

        _mgpu.walk(table_ref, live_ref, heads, num_ctas, BACKWARD_SLOTS, load=load, attend=attend, slack=slack,
                   rope=rotary, warpgroups=warpgroups, handoff=handoff[0] if handoff else None)

    scratch = (
        *(_mgpu.operand_ring(BACKWARD_SLOTS, head_dim, dtype) for _ in range(4)),
        mgpu_common.swizzled_smem(per_warpgroup((BLOCK, BLOCK)), dtype),  # dS, then P^T and dS^T
        plgpu.SMEM(per_warpgroup((BLOCK,)), jnp.float32),  # lse
        plgpu.SMEM(per_warpgroup((BLOCK,)), jnp.float32),  # delta
        plgpu.SMEM((BACKWARD_SLOTS, BLOCK), jnp.float32),
        plgpu.SMEM((head_dim // 2,), jnp.float32),
        *(_mgpu.ring_barriers(BACKWARD_SLOTS, warpgroups) for _ in range(5)),
        plgpu.Barrier(),
        *([_mgpu.ring_barriers(BACKWARD_SLOTS, warpgroups)] if warpgroups > 1 else []),  # slack steps' handoff
    )
    grad = jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype)
    return _mgpu.launch(kernel, scratch, (grad, grad, grad), num_ctas, plan.table, plan.live, plan.end,
                        plan.positions, freqs, q, k, v, dout, *tails, warpgroups=warpgroups)
