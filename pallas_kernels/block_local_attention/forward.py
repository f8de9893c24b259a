"""Block-local attention forward kernel (Pallas Mosaic GPU, Hopper), RoPE fused.

Equivalent jnp, per 64-row block s of a sequence and head h (see `reference`)::

    qr, kr = rope(q[s, h]), rope(k[s, h])     # float32, rounded to q.dtype
    out[s, h] = softmax(qr @ kr.T * scale) @ v[s, h]

One CTA (one warpgroup) per (block, head): one QK^T and one PV wgmma, a plain
softmax over at most 64 keys (no online rescaling, no log-sum-exp residual:
the backward recomputes the block). RoPE is applied in registers between the
TMA load and the swizzled operand. Source: GEM engineering description (Meta,
2025), block-local attention with fused RoPE; TLX block attention
(facebookresearch/ads_model_kernel_library, `block_attention/`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import manual_axes, mgpu_common
from pallas_kernels.block_local_attention import _mgpu, schedule
from pallas_kernels.block_local_attention.config import BLOCK
from pallas_kernels.jagged_flash_attention import schedule as jfa_schedule

LOG2E = math.log2(math.e)


def forward(q, k, v, freqs, plan: schedule.Plan, *, scale: float, rope: bool):
    """Runs the forward kernel.

    Args:
      q, k, v: `[T, H, D]` bf16 or f16 (T a multiple of 8).
      freqs: float32 `[D/2]` RoPE frequencies (read only when `rope`).
      plan: the batch's work list (`schedule.build_plan`).
      scale: multiplies the scores.
      rope: apply RoPE to q and k.

    Returns:
      `[T, H, D]` in q.dtype; slack rows 0.
    """
    capacity, heads, head_dim = q.shape
    dtype = q.dtype
    slots = plan.table.shape[0]
    end = plan.end[0]
    tails = [jfa_schedule.tail_rows(x, end) for x in (q, k, v)]
    c2 = scale * LOG2E

    def kernel(table_ref, live_ref, end_ref, pos_ref, freq_ref, q_ref, k_ref, v_ref, qt_ref, kt_ref, vt_ref,
               out_ref, q_smem, k_smem, v_smem, pos_smem, freq_smem, bars):
        blk, head = lax.axis_index("blk"), lax.axis_index("head")
        start, rows, keys = _mgpu.read_block(table_ref, blk)
        end_row = end_ref[0]

        @pl.when((blk < live_ref[0]) & (keys > 0))
        def _attend():
            for src, tail, dst, i in ((q_ref, qt_ref, q_smem, 0), (k_ref, kt_ref, k_smem, 1), (v_ref, vt_ref, v_smem, 2)):
                _mgpu.copy_block_in(src, tail, start, head, end_row, dst[0], bars.at[i])
            if rope:
                plgpu.copy_gmem_to_smem(pos_ref.at[blk], pos_smem, bars.at[3])
                plgpu.copy_gmem_to_smem(freq_ref, freq_smem, bars.at[4])
                plgpu.barrier_wait(bars.at[3])
                plgpu.barrier_wait(bars.at[4])
                tables = _mgpu.rope_tables(pos_smem, freq_smem, head_dim // 2)
            else:
                tables = None
            for i, (union, rotated) in enumerate(((q_smem, True), (k_smem, True), (v_smem, False))):
                plgpu.barrier_wait(bars.at[i])
                _mgpu.swizzle_operand(union, rows, tables if rotated else None)
            plgpu.commit_smem()
            s = _mgpu.matmul(q_smem[1], k_smem[1].transpose((1, 0)), (BLOCK, BLOCK))
            s = _mgpu.mask_keys(s * c2, rows, axis=1)
            m = s.max(axis=1)
            p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [0]))
            inv_l = 1.0 / p.sum(axis=1)
            p_smem = q_smem[2]  # the QK^T wgmma has read q: P takes its bytes
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            out = _mgpu.matmul(p_smem, v_smem[1], (BLOCK, head_dim))
            out = (out * lax.broadcast_in_dim(inv_l, out.shape, [0])).astype(dtype)
            _mgpu.store_block(out, q_smem[0], out_ref, start, rows, head)

        @pl.when((blk < live_ref[0]) & (keys == 0))
        def _slack():
            _mgpu.store_block(_mgpu.zeros(head_dim).astype(dtype), q_smem[0], out_ref, start, rows, head)

        plgpu.wait_smem_to_gmem(0)

    launch = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype),
        scratch_types=(
            _mgpu.operand_smem(head_dim, dtype, mgpu_common.swizzled_smem((BLOCK, BLOCK), dtype)),
            _mgpu.operand_smem(head_dim, dtype),
            _mgpu.operand_smem(head_dim, dtype),
            plgpu.SMEM((BLOCK,), jnp.float32),
            plgpu.SMEM((head_dim // 2,), jnp.float32),
            plgpu.Barrier(num_barriers=5),
        ),
        grid=(slots, heads),
        grid_names=("blk", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
    )
    return manual_axes.call_kernel(
        launch, plan.table, plan.live, plan.end, plan.positions, freqs, q, k, v, *tails
    )
