"""The jnp definition of `gelu_grad_matmul`: the backward of `gelu(h)` (tanh approximation) through the GEMM into it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gdpa import activations
from pallas_kernels.gdpa.reference import Activation


def gelu_tanh_grad(x: jax.Array) -> jax.Array:
    """d/dx of `jax.nn.gelu(x, approximate=True)` (Hendrycks & Gimpel 2016, tanh form), in float32.

    With `t = tanh(sqrt(2/pi) (x + 0.044715 x^3))`::

        0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)

    the formula the GDPA kernels differentiate their GELU with (`pallas_kernels/gdpa/activations.py`),
    and the kernel's epilogue: one definition for all three. `x` of any floating dtype.
    """
    _, grad = activations.value_and_vjp(Activation.GELU, x.astype(jnp.float32), jnp.float32(1.0))
    return grad


def gelu_grad_matmul(dy: jax.Array, w: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(dh, dbias)` of `y = gelu(h) @ w` given `dy`: the reference the kernel is tested against.

        g = dy @ w.T                                          # float32 accumulation
        dh = (g * gelu_tanh_grad(h)).astype(dy.dtype)
        dbias = dh.astype(float32).sum(axis=0)               # the column sums of the rounded dh

    Args: dy `[M, K]`, w `[N, K]`, h `[M, N]`, floating. Returns dh `[M, N]` in dy's dtype and dbias
    `[N]` float32.
    """
    g = jnp.dot(dy, w.T, preferred_element_type=jnp.float32)
    dh = (g * gelu_tanh_grad(h)).astype(dy.dtype)
    return dh, dh.astype(jnp.float32).sum(axis=0)
