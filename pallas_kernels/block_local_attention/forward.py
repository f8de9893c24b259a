"""Block-local attention forward kernel (Pallas Mosaic GPU, Hopper), RoPE fused, persistent.

Equivalent jnp, per 64-row block s of a sequence and head h (see `reference`)::

    qr, kr = rope(q[s, h]), rope(k[s, h])     # float32, rounded to q.dtype
    out[s, h] = softmax(qr @ kr.T * scale) @ v[s, h]

A work item is one 64-row block with all its heads; each head (a step) is one
QK^T and one PV wgmma and a plain softmax over at most 64 keys (no online
rescaling, no log-sum-exp residual: the backward recomputes the block). RoPE
is applied in registers between the TMA load and the swizzled operand, with
cos/sin tables computed once per block and kept in registers for its heads. A
fixed grid of CTAs, two per SM, walks the blocks' steps with a two-slot TMA
ring each (`_mgpu.walk`): the next step's q, k, v load while the current one
computes, and one CTA's serial phases (the operands' rewrite, the softmax, the
output's staging) run under the other CTA's loads and wgmmas on the same SM.
Two slots, not three, so that two CTAs fit an SM's shared memory at D=128
(108 KiB each; `config`): a step first waits until the previous step's
output stores have read the slot its successor loads into.
Sources: GEM engineering description (Meta, 2025), block-local attention with
fused RoPE; TLX block attention (facebookresearch/ads_model_kernel_library,
`block_attention/`); persistent kernels with a TMA ring, as in
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
from pallas_kernels.block_local_attention.config import BLOCK, FORWARD_SLOTS
from pallas_kernels.jagged_flash_attention import schedule as jfa_schedule

LOG2E = math.log2(math.e)


def forward(q, k, v, freqs, plan: schedule.Plan, *, scale: float, rope: bool, num_ctas: int, bounded_angles: bool = False):
    """Runs the forward kernel.

    Args:
      q, k, v: `[T, H, D]` bf16 or f16 (T a multiple of 8).
      freqs: float32 `[D/2]` RoPE frequencies (read only when `rope`).
      plan: the batch's work list (`schedule.build_plan`).
      scale: multiplies the scores.
      rope: apply RoPE to q and k.
      num_ctas: persistent CTAs (`FORWARD_CTAS_PER_SM` x the GPU's SM count).
      bounded_angles: every RoPE angle (position x frequency) is at most
        `bounded_trig.MAX_ANGLE` (the caller knows it statically): the cos/sin tables
        take `bounded_trig.sin_cos` (`_mgpu.Rope`).

    Returns:
      `[T, H, D]` in q.dtype; slack rows 0.
    """
    capacity, heads, head_dim = q.shape
    dtype = q.dtype
    end = plan.end[0]
    tails = [jfa_schedule.tail_rows(x, end) for x in (q, k, v)]
    c2 = scale * LOG2E

    def kernel(table_ref, live_ref, end_ref, pos_ref, freq_ref, q_ref, k_ref, v_ref, qt_ref, kt_ref, vt_ref,
               out_ref, q_ring, k_ring, v_ring, p_smem, pos_ring, freq_smem, q_bars, k_bars, v_bars, pos_bars,
               freq_bar):
        end_row = end_ref[0]
        operands = ((q_ref, qt_ref, q_ring, q_bars), (k_ref, kt_ref, k_ring, k_bars), (v_ref, vt_ref, v_ring, v_bars))
        rotary = _mgpu.fused_rope(rope, freq_ref, freq_smem, freq_bar, pos_ref, pos_ring, pos_bars, bounded=bounded_angles)

        def load(step, slot):
            _mgpu.load_operands(operands, step, slot, end_row)

        def attend(step, slot, tables):
            rows = step.rows
            qs, ks, vs = _mgpu.swizzle_loaded(operands, (True, True, False), slot, rows, tables)
            plgpu.commit_smem()
            s = mgpu_common.matmul(qs, ks.transpose((1, 0)), (BLOCK, BLOCK))
            s = _mgpu.mask_keys(s * c2, rows, axis=1)
            m = s.max(axis=1)
            p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [0]))
            inv_l = 1.0 / p.sum(axis=1)
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            out = mgpu_common.matmul(p_smem, vs, (BLOCK, head_dim))
            out = (out * lax.broadcast_in_dim(inv_l, out.shape, [0])).astype(dtype)
            _mgpu.store_block(out, q_ring[0].at[slot.index], out_ref, step)  # the QK^T wgmma has read q's slot

        def slack(step, slot):
            _mgpu.store_block(_mgpu.zeros(head_dim).astype(dtype), q_ring[0].at[slot.index], out_ref, step)

        _mgpu.walk(table_ref, live_ref, heads, num_ctas, FORWARD_SLOTS, load=load, attend=attend, slack=slack,
                   rope=rotary)

    scratch = (
        *(_mgpu.operand_ring(FORWARD_SLOTS, head_dim, dtype) for _ in range(3)),
        mgpu_common.swizzled_smem((BLOCK, BLOCK), dtype),
        plgpu.SMEM((FORWARD_SLOTS, BLOCK), jnp.float32),
        plgpu.SMEM((head_dim // 2,), jnp.float32),
        *(_mgpu.ring_barriers(FORWARD_SLOTS) for _ in range(4)),
        plgpu.Barrier(),
    )
    out_type = jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype)
    return _mgpu.launch(kernel, scratch, out_type, num_ctas, plan.table, plan.live, plan.end, plan.positions, freqs,
                        q, k, v, *tails)
