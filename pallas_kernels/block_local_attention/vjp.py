"""Block-local attention on Hopper: the Mosaic GPU forward and backward kernels wired with `jax.custom_vjp`.

The backward recomputes each block's softmax from q and k, so the only
residuals are the inputs; RoPE's backward (rotation by minus the angle) is
applied to dQ and dK inside the backward kernel. Both kernels are persistent
(`_mgpu.walk`): by default each runs its CTAs per SM (`config`) times the
GPU's SM count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._src import bounded_trig, manual_axes, mgpu_common
from pallas_kernels.block_local_attention import reference, schedule
from pallas_kernels.block_local_attention.backward import backward
from pallas_kernels.block_local_attention.config import (
    BACKWARD_CTAS_PER_SM,
    FORWARD_CTAS_PER_SM,
    INTERPRET_CTAS,
    KERNEL_BLOCK_SIZES,
    SUPPORTED_HEAD_DIMS,
)
from pallas_kernels.block_local_attention.forward import forward
from pallas_kernels.jagged_flash_attention.config import ROW_ALIGN


def angles_bounded(rope_base: float | None, head_dim: int, max_seq_len: int | None, positions_given: bool) -> bool:
    """Whether every RoPE angle (position x frequency) is at most `bounded_trig.MAX_ANGLE`, known statically:
    default positions (each row's index in its sequence, below `max_seq_len`) times the largest of
    `reference.rope_frequencies` (1 for a base >= 1, the last one below it). False without RoPE
    (`rope_base` None), with given positions or without a bound."""
    if rope_base is None or positions_given or max_seq_len is None:
        return False
    with jax.ensure_compile_time_eval():  # a constant of the static arguments, also while a caller is traced
        largest_frequency = float(jnp.max(reference.rope_frequencies(head_dim, rope_base)))
    return (max_seq_len - 1) * largest_frequency <= bounded_trig.MAX_ANGLE


def block_local_attention(q, k, v, offsets, *, block_size: int, positions=None, rope_base: float | None = None,
                          scale: float | None = None, bounded_angles: bool = False,
                          num_ctas: int | None = None) -> jax.Array:
    """Block-local softmax attention with fused RoPE on the Mosaic GPU kernels (Hopper, sm_90a).

    Same contract as `pallas_kernels.block_local_attention` (which see), plus
    `num_ctas`: the persistent CTAs of each kernel; default the kernel's CTAs
    per SM (`config.FORWARD_CTAS_PER_SM`, `config.BACKWARD_CTAS_PER_SM`) times
    the GPU's SM count (`INTERPRET_CTAS` under the CPU interpreter); and
    `bounded_angles` (static): the caller knows every RoPE angle is at most
    `bounded_trig.MAX_ANGLE` (`angles_bounded`), so the kernels compute their
    cos/sin tables with `bounded_trig.sin_cos`, else with CUDA's `sinf` / `cosf`.

    Raises:
      NotImplementedError: dtype, head dimension or block size the kernels do not support.
      ValueError: `num_ctas` below 1.
    """
    capacity, _, head_dim = q.shape
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"the block-local kernels take bf16 or f16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"the block-local kernels take head dim D in {SUPPORTED_HEAD_DIMS}; got {head_dim}")
    if block_size not in KERNEL_BLOCK_SIZES:
        raise NotImplementedError(f"the block-local kernels take block_size in {KERNEL_BLOCK_SIZES}; got {block_size}")
    if capacity == 0:
        return jnp.zeros_like(q)
    scale = head_dim**-0.5 if scale is None else float(scale)
    if num_ctas is None and not mgpu_common.interpreting():
        sms = mgpu_common.sm_count()
        grids = (FORWARD_CTAS_PER_SM * sms, BACKWARD_CTAS_PER_SM[head_dim] * sms)
    else:
        num_ctas = INTERPRET_CTAS if num_ctas is None else num_ctas
        if num_ctas < 1:
            raise ValueError(f"num_ctas must be at least 1; got {num_ctas}")
        grids = (int(num_ctas), int(num_ctas))
    padded = -(-capacity // ROW_ALIGN) * ROW_ALIGN
    if padded != capacity:
        q, k, v = (jnp.pad(x, ((0, padded - capacity), (0, 0), (0, 0))) for x in (q, k, v))
        if positions is not None:
            positions = jnp.pad(positions, (0, padded - capacity))
    rope = rope_base is not None
    freqs = reference.rope_frequencies(head_dim, rope_base if rope else 1.0)
    bounded = rope and bool(bounded_angles)
    plan = schedule.build_plan(offsets.astype(jnp.int32), padded, positions if rope else None)
    q, k, v = manual_axes.match_axes(q, k, v)
    return _attention(q, k, v, freqs, plan, scale, (rope, bounded), grids)[:capacity]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, freqs, plan, scale, rope, grids):
    """`rope`: (apply RoPE, its angles bounded); `grids`: the forward's and the backward's CTA counts."""
    return forward(q, k, v, freqs, plan, scale=scale, rope=rope[0], bounded_angles=rope[1], num_ctas=grids[0])


def _attention_fwd(q, k, v, freqs, plan, scale, rope, grids):
    out = forward(q, k, v, freqs, plan, scale=scale, rope=rope[0], bounded_angles=rope[1], num_ctas=grids[0])
    return out, (q, k, v, freqs, plan)


def _attention_bwd(scale, rope, grids, residuals, dout):
    q, k, v, freqs, plan = residuals
    dq, dk, dv = backward(q, k, v, dout, freqs, plan, scale=scale, rope=rope[0], bounded_angles=rope[1], num_ctas=grids[1])
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
