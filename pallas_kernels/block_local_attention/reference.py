"""Pure-jnp block-local attention with RoPE: the semantic spec and the "xla" path.

Each sequence is padded to whole blocks inside (B x N/bs blocks of bs x bs
scores, never a T x T matrix); RoPE, scores and softmax run in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.jagged_layout import from_padded, positions_in_sequence, to_padded


def rope_frequencies(head_dim: int, base: float) -> jax.Array:
    """float32 `[D/2]`: `base ** (-i / (D/2))`, the rotate-half RoPE frequencies."""
    half = head_dim // 2
    return base ** (-jnp.arange(half, dtype=jnp.float32) / half)


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding, rotate-half form (Su et al., "RoFormer", 2021).

    `x [T, H, D]` (D even), `positions [T]`; computed in float32, returned in x.dtype:
    with `(x1, x2)` the two halves of the last axis and `a = positions * base ** (-i / (D/2))`,
    the result is `(x1 cos a - x2 sin a, x2 cos a + x1 sin a)`.
    """
    angles = positions.astype(jnp.float32)[:, None] * rope_frequencies(x.shape[-1], base)[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def block_local_attention(
    q, k, v, offsets, *, block_size: int, max_seq_len: int, positions=None, rope_base: float | None = None,
    scale: float | None = None,
):
    """Reference for `pallas_kernels.block_local_attention` (same arguments)."""
    capacity, _, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    if rope_base is not None:
        positions = positions_in_sequence(offsets, capacity) if positions is None else positions
        q, k = rope(q, positions, rope_base), rope(k, positions, rope_base)
    n = max(-(-max_seq_len // block_size), 1) * block_size
    lengths = offsets[1:] - offsets[:-1]
    qp, kp, vp = (to_padded(x, offsets, n).astype(jnp.float32) for x in (q, k, v))
    batch, _, heads, _ = qp.shape
    blocks = lambda x: x.reshape(batch, n // block_size, block_size, heads, head_dim)
    s = jnp.einsum("bnqhd,bnkhd->bnhqk", blocks(qp), blocks(kp)) * scale
    pos = jnp.arange(n).reshape(n // block_size, block_size)
    key_inside = pos[None, :, None, None, :] < lengths[:, None, None, None, None]
    s = jnp.where(key_inside, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bnhqk,bnkhd->bnqhd", p, blocks(vp)).reshape(batch, n, heads, head_dim)
    return from_padded(out, offsets, capacity).astype(q.dtype)
