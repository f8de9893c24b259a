"""Pure-jnp QK-norm + RoPE of a fused QKV projection: the semantic spec and the "xla" path.

Flax's `nnx.RMSNorm` with float32 output, then `rope`, op for op, so its values and its
autodiff gradients are those of that composition bit for bit
(tests/gem_jax/model/test_gem.py compares them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.rms_norm.reference import rms_norm


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
    """Rotary position embedding, rotate-half form (Su et al., "RoFormer", 2021).

    `x [..., D]` (D even) with `(x1, x2)` its two halves, `cos`/`sin` float32 broadcastable
    to `[..., D/2]`: `(x1 cos - x2 sin, x2 cos + x1 sin)`, computed in float32 and returned
    in `dtype` (default `x.dtype`).
    """
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype or x.dtype)


def qk_norm_rope(
    qkv: jax.Array, q_scale: jax.Array, k_scale: jax.Array, cos: jax.Array, sin: jax.Array, eps: float, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference for `pallas_kernels.qk_norm_rope` on checked inputs: `qkv [T, 3, H, D]`,
    `cos`/`sin` `[T, 1, D/2]`; returns `(q, k)` `[T, H, D]` in `dtype` and `v = qkv[:, 2]`."""
    q = rope(rms_norm(qkv[:, 0], q_scale, eps, jnp.float32), cos, sin, dtype)
    k = rope(rms_norm(qkv[:, 1], k_scale, eps, jnp.float32), cos, sin, dtype)
    return q, k, qkv[:, 2]
