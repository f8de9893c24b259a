"""Block-local attention backward kernel (Pallas Mosaic GPU, Hopper): dQ, dK, dV with RoPE's backward fused.

Equivalent jnp, per 64-row block s and head h, with `qr, kr` the RoPE'd
operands and `rope_t` the transposed rotation (rotation by minus the angle)::

    p = softmax(qr @ kr.T * scale)
    dp = dout[s, h] @ v[s, h].T
    ds = p * (dp - sum(p * dp, axis=-1, keepdims=True))   # = p * (dp - rowsum(out * dout))
    dq[s, h] = rope_t(ds @ kr * scale)
    dk[s, h] = rope_t(ds.T @ qr * scale)
    dv[s, h] = p.T @ dout[s, h]

One CTA per (block, head) recomputes the block's softmax (no residual beyond
q, k, v), so dQ and dK/dV come from one kernel without atomics. The
transposed products use the transposed frame (S^T = K Q^T with the row
statistics read back as column vectors), as jax's `attention_mgpu` backward
does. Each gradient leaves through the plain view of an operand that is no
longer read (dQ through k's, dV through v's, dK through q's), so a CTA holds
72 KiB of shared memory at D=128.
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


def backward(q, k, v, dout, freqs, plan: schedule.Plan, *, scale: float, rope: bool):
    """Runs the backward kernel; returns `(dq, dk, dv)`, each `[T, H, D]` in q.dtype, slack rows 0.

    Arguments as in `forward.forward`, plus `dout [T, H, D]` (q.dtype), the output cotangent.
    """
    capacity, heads, head_dim = q.shape
    dtype = q.dtype
    slots = plan.table.shape[0]
    end = plan.end[0]
    tails = [jfa_schedule.tail_rows(x, end) for x in (q, k, v, dout)]
    c2 = scale * LOG2E
    shape = (BLOCK, BLOCK)

    def kernel(table_ref, live_ref, end_ref, pos_ref, freq_ref, q_ref, k_ref, v_ref, do_ref,
               qt_ref, kt_ref, vt_ref, dot_ref, dq_ref, dk_ref, dv_ref,
               q_smem, k_smem, v_smem, do_smem, ds_smem, lse_smem, delta_smem, pos_smem, freq_smem, bars):
        blk, head = lax.axis_index("blk"), lax.axis_index("head")
        start, rows, keys = _mgpu.read_block(table_ref, blk)
        end_row = end_ref[0]

        @pl.when((blk < live_ref[0]) & (keys > 0))
        def _attend():
            operands = ((q_ref, qt_ref, q_smem), (k_ref, kt_ref, k_smem), (v_ref, vt_ref, v_smem), (do_ref, dot_ref, do_smem))
            for i, (src, tail, dst) in enumerate(operands):
                _mgpu.copy_block_in(src, tail, start, head, end_row, dst[0], bars.at[i])
            if rope:
                plgpu.copy_gmem_to_smem(pos_ref.at[blk], pos_smem, bars.at[4])
                plgpu.copy_gmem_to_smem(freq_ref, freq_smem, bars.at[5])
                plgpu.barrier_wait(bars.at[4])
                plgpu.barrier_wait(bars.at[5])
                tables = _mgpu.rope_tables(pos_smem, freq_smem, head_dim // 2)
            else:
                tables = None
            for i, (union, rotated) in enumerate(((q_smem, True), (k_smem, True), (v_smem, False), (do_smem, False))):
                plgpu.barrier_wait(bars.at[i])
                _mgpu.swizzle_operand(union, rows, tables if rotated else None)
            plgpu.commit_smem()
            qs, ks, vs, dos = q_smem[1], k_smem[1], v_smem[1], do_smem[1]

            # Query frame: softmax statistics, delta, dS and dQ.
            s = _mgpu.mask_keys(_mgpu.matmul(qs, ks.transpose((1, 0)), shape) * c2, rows, axis=1)
            m = s.max(axis=1)
            p = jnp.exp2(s - lax.broadcast_in_dim(m, shape, [0]))
            l = p.sum(axis=1)
            p = p * lax.broadcast_in_dim(1.0 / l, shape, [0])
            lse = m + jnp.log2(l)
            dp = _mgpu.matmul(dos, vs.transpose((1, 0)), shape)
            delta = (p * dp).sum(axis=1)
            ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))
            ds_smem[...] = ds.astype(dtype)
            lse_smem[...] = lse
            delta_smem[...] = delta
            plgpu.commit_smem()
            dq = _mgpu.matmul(ds_smem, ks, (BLOCK, head_dim)) * scale
            if rope:
                dq = _mgpu.rotate(dq, tables, inverse=True)
            dq = dq.astype(dtype)

            # Key frame (rows are keys, columns queries): dV and dK.
            st = _mgpu.mask_keys(_mgpu.matmul(ks, qs.transpose((1, 0)), shape) * c2, rows, axis=0)
            _mgpu.store_block(dq, k_smem[0], dq_ref, start, rows, head)  # k is read for the last time
            lse_col = plgpu.load(lse_smem, layout=_mgpu.LAYOUT.reduce(0))
            delta_col = plgpu.load(delta_smem, layout=_mgpu.LAYOUT.reduce(0))
            pt = jnp.exp2(st - lax.broadcast_in_dim(lse_col, shape, [1]))
            dpt = _mgpu.matmul(vs, dos.transpose((1, 0)), shape)
            dst = pt * (dpt - lax.broadcast_in_dim(delta_col, shape, [1]))
            ds_smem[...] = pt.astype(dtype)  # dS (query frame) is no longer read: reuse for P^T
            plgpu.commit_smem()
            dv = _mgpu.matmul(ds_smem, dos, (BLOCK, head_dim))
            _mgpu.store_block(dv.astype(dtype), v_smem[0], dv_ref, start, rows, head)  # v and dO are done
            ds_smem[...] = dst.astype(dtype)
            plgpu.commit_smem()
            dk = _mgpu.matmul(ds_smem, qs, (BLOCK, head_dim)) * scale
            if rope:
                dk = _mgpu.rotate(dk, tables, inverse=True)
            _mgpu.store_block(dk.astype(dtype), q_smem[0], dk_ref, start, rows, head)

        @pl.when((blk < live_ref[0]) & (keys == 0))
        def _slack():
            zero = _mgpu.zeros(head_dim).astype(dtype)
            for buf, dst in ((q_smem[0], dq_ref), (k_smem[0], dk_ref), (v_smem[0], dv_ref)):
                _mgpu.store_block(zero, buf, dst, start, rows, head)

        plgpu.wait_smem_to_gmem(0)

    grad = jax.ShapeDtypeStruct((capacity, heads, head_dim), dtype)
    launch = plgpu.kernel(
        kernel,
        out_type=(grad, grad, grad),
        scratch_types=(
            *(_mgpu.operand_smem(head_dim, dtype) for _ in range(4)),
            mgpu_common.swizzled_smem((BLOCK, BLOCK), dtype),
            plgpu.SMEM((BLOCK,), jnp.float32),
            plgpu.SMEM((BLOCK,), jnp.float32),
            plgpu.SMEM((BLOCK,), jnp.float32),
            plgpu.SMEM((head_dim // 2,), jnp.float32),
            plgpu.Barrier(num_barriers=6),
        ),
        grid=(slots, heads),
        grid_names=("blk", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
    )
    return manual_axes.call_kernel(
        launch, plan.table, plan.live, plan.end, plan.positions, freqs, q, k, v, dout, *tails
    )
