"""Pure-jnp RMSNorm: the semantic spec of `pallas_kernels.rms_norm` and its "xla" path.

Flax's `nnx.RMSNorm` op for op (x and the scale cast to the output dtype, statistics in float32,
`x * (rsqrt(mean(x**2) + eps) * scale)`, then the cast), so its values and autodiff gradients are
flax's bit for bit
(tests/pallas_kernels/test_rms_norm.py compares them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype=None) -> jax.Array:
    """RMSNorm (Zhang & Sennrich, 2019) over the last axis, as flax's `nnx.RMSNorm(dtype=dtype)`: `x` and `scale`
    cast to `dtype` (None: their promoted dtype, flax's `promote_dtype`), then
    `x * (rsqrt(mean(x**2, -1) + eps) * scale)` in float32, returned in `dtype`.

    As in flax, the statistic and the normalisation each widen `x` to float32 on their own, so for a bf16 `x` its
    gradient is the bf16 sum of the two paths' bf16 cotangents."""
    dtype = jnp.result_type(x, scale) if dtype is None else dtype
    x, scale = x.astype(dtype), scale.astype(dtype)
    var = jnp.mean(lax.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x.astype(jnp.float32) * (lax.rsqrt(var + eps) * scale.astype(jnp.float32))).astype(dtype)
