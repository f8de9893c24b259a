"""JFA on Hopper: the Mosaic GPU forward, dQ and dK/dV kernels wired with `jax.custom_vjp`.

The forward saves the base-2 log-sum-exp per query row (in tile space, see
`schedule.to_tile_space`) as the residual the backward needs, so the
backward never recomputes the softmax normaliser. The output and the
log-sum-exp carry the `jax.ad_checkpoint.checkpoint_name` `SAVED_NAME`: a caller's
`jax.checkpoint` policy can keep them (`save_only_these_names(SAVED_NAME)`) and
recompute only q, k and v in the backward, not the attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels._src import manual_axes, mgpu_common
from pallas_kernels.jagged_flash_attention import schedule
from pallas_kernels.jagged_flash_attention.backward_dkv import backward_dkv
from pallas_kernels.jagged_flash_attention.backward_dq import backward_dq
from pallas_kernels.jagged_flash_attention.config import ROW_ALIGN, SAVED_NAME, SUPPORTED_HEAD_DIMS
from pallas_kernels.jagged_flash_attention.forward import forward

_INTERPRET_CTAS = 1  # persistent CTAs simulated by the CPU interpreter


def jagged_flash_attention(q, k, v, offsets, *, max_seq_len: int, causal: bool = False, scale: float | None = None,
                           window: tuple[int, int] | None = None, num_ctas: int | None = None) -> jax.Array:
    """Jagged softmax attention with the Pallas Mosaic GPU kernels (Hopper, sm_90a).

    Same contract as `pallas_kernels.jagged_flash_attention` (which see); the
    kernels compute every sequence exactly whatever its length, and
    `max_seq_len` only documents the caller's bound.

    Equivalent jnp, for each sequence b with rows s = offsets[b]:offsets[b+1]::

        x = jnp.einsum("qhd,khd->hqk", q[s], k[s]) * scale     # float32
        out[s] = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(x, -1), v[s])

    with keys after the query masked when `causal`; slack rows are 0.

    Slack rows may hold anything (NaN included): they never reach a product.
    Boundary blocks do read the neighbouring sequences' real rows (masked to
    probability 0), so a non-finite value in one sequence's real rows can turn
    a neighbour's output into NaN (0 * inf), which the jnp reference would not.

    Args:
      q, k, v: `[T, H, D]` bf16 or f16, D in {64, 128}.
      offsets: int32 `[B+1]`, non-decreasing, `offsets[0] = 0`, `offsets[B] <= T`.
      max_seq_len: static bound on every sequence length (unused by the kernels).
      causal: mask keys after the query position within each sequence.
      scale: multiplies the scores; default `1/sqrt(D)`.
      window: `(left, right)`: query q sees keys q - left ..= q + right (key
        blocks wholly outside are skipped); None: the whole sequence.
      num_ctas: persistent CTAs per kernel; default the GPU's SM count.

    Returns:
      `[T, H, D]` in q.dtype.

    Raises:
      NotImplementedError: dtype or head dimension the kernels do not support.
      ValueError: malformed offsets.
    """
    del max_seq_len
    capacity, _, head_dim = q.shape
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"the JFA kernels take bf16 or f16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"the JFA kernels take head dim D in {SUPPORTED_HEAD_DIMS}; got {head_dim}")
    if offsets.ndim != 1 or offsets.shape[0] < 1 or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(f"offsets must be int32 [B+1] with B >= 0; got {offsets.dtype} {offsets.shape}")
    if capacity == 0:
        return jnp.zeros_like(q)
    scale = head_dim**-0.5 if scale is None else float(scale)
    if num_ctas is None:
        num_ctas = _INTERPRET_CTAS if mgpu_common.interpreting() else mgpu_common.sm_count()
    # Mosaic GPU's tiled TMA views need a row count that is a multiple of ROW_ALIGN;
    # extra rows are slack.
    padded = -(-capacity // ROW_ALIGN) * ROW_ALIGN
    if padded != capacity:
        q, k, v = (jnp.pad(x, ((0, padded - capacity), (0, 0), (0, 0))) for x in (q, k, v))
    offsets = offsets.astype(jnp.int32)
    q, k, v, offsets = manual_axes.match_axes(q, k, v, offsets)
    out = _attention(q, k, v, offsets, causal, scale, num_ctas, None if window is None else tuple(window))
    return out[:capacity]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, offsets, causal, scale, num_ctas, window):
    plan = schedule.build_plan(offsets, q.shape[0], causal=causal)
    out, _ = forward(q, k, v, plan, causal=causal, scale=scale, num_ctas=num_ctas, save_lse=False, window=window)
    return out


def _attention_fwd(q, k, v, offsets, causal, scale, num_ctas, window):
    plan = schedule.build_plan(offsets, q.shape[0], causal=causal)
    out, lse = forward(q, k, v, plan, causal=causal, scale=scale, num_ctas=num_ctas, save_lse=True, window=window)
    out, lse = checkpoint_name(out, SAVED_NAME), checkpoint_name(lse, SAVED_NAME)
    return out, (q, k, v, out, lse, plan)


def _attention_bwd(causal, scale, num_ctas, window, residuals, dout):
    q, k, v, out, lse, plan = residuals
    delta = schedule.to_tile_space(jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1), plan)
    kwargs = dict(causal=causal, scale=scale, num_ctas=num_ctas, window=window)
    dq = backward_dq(q, k, v, dout, lse, delta, plan, **kwargs)
    dk, dv = backward_dkv(q, k, v, dout, lse, delta, plan, **kwargs)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)
