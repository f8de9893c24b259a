"""Pure-jnp jagged softmax attention: the semantic spec of JFA and its "xla" path.

Each sequence is padded to the static `max_seq_len` inside (B x N x N work, never
a T x T matrix over the packed batch). The matmuls take their operands in the
inputs' dtype and accumulate in float32; scores and softmax run in float32, and the
probabilities are cast to V's dtype for the second matmul, as the kernels do (no
float32 GEMM for bfloat16 inputs).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.jagged_layout import from_padded, to_padded
from pallas_kernels.mixed_precision import einsum_float32


def attention_padded(q, k, v, lengths, *, causal: bool, scale: float, window=None):
    """Masked softmax attention on padded `[B, N, H, D]` inputs.

    `window = (left, right)` keeps keys `q - left ..= q + right` (None: all).
    Returns `(out [B, N, H, D] float32, lse [B, H, N] float32)`. Query rows with no
    visible key (padding rows, or a zero-length sequence) give 0 output and
    lse = -inf.
    """
    n = q.shape[1]
    s = einsum_float32("bqhd,bkhd->bhqk", q, k) * scale
    pos = jnp.arange(n)
    mask = (pos[None, :] < lengths[:, None])[:, None, None, :]  # keys inside the sequence
    mask = mask & (pos[None, :] < lengths[:, None])[:, None, :, None]  # real query rows
    if causal:
        mask = mask & (pos[None, :] <= pos[:, None])[None, None]
    if window is not None:
        band = (pos[None, :] >= pos[:, None] - window[0]) & (pos[None, :] <= pos[:, None] + window[1])
        mask = mask & band[None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)  # N = 0 (max_seq_len 0): no key, -inf as a masked row
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = einsum_float32("bhqk,bkhd->bqhd", p.astype(v.dtype), v)
    lse = jnp.where(denom[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)), -jnp.inf)
    return out, lse


def jagged_flash_attention_with_lse(q, k, v, offsets, *, max_seq_len: int, causal: bool, scale: float, window=None):
    """Jagged attention returning `(out [T, H, D] q.dtype, lse [T, H] float32)`.

    Slack rows (at or past `offsets[B]`) get out = 0 and lse = -inf.
    """
    capacity = q.shape[0]
    lengths = offsets[1:] - offsets[:-1]
    qp, kp, vp = (to_padded(x, offsets, max_seq_len) for x in (q, k, v))
    out, lse = attention_padded(qp, kp, vp, lengths, causal=causal, scale=scale, window=window)
    out = from_padded(out, offsets, capacity).astype(q.dtype)
    lse = from_padded(jnp.swapaxes(lse, 1, 2), offsets, capacity, fill_value=-jnp.inf)
    return out, lse


def jagged_flash_attention(q, k, v, offsets, *, max_seq_len: int, causal: bool = False, scale: float | None = None,
                           window=None):
    """Reference for `pallas_kernels.jagged_flash_attention` (same arguments)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return jagged_flash_attention_with_lse(
        q, k, v, offsets, max_seq_len=max_seq_len, causal=causal, scale=scale, window=window
    )[0]
