"""Contractions with a float32 result whose operands, forward and backward, keep their own dtype.

`jnp.einsum(..., preferred_element_type=jnp.float32)` on bfloat16 operands is a bf16
GEMM with float32 accumulation and output; but its autodiff transposes multiply the
float32 output gradient with the bf16 operands, which promotes them: two float32
(TF32 on Hopper) GEMMs in the backward pass. The functions here use the same
forward and, in the backward pass, cast the output gradient to the operands' dtype
first, so every GEMM of forward and backward runs on the operands' dtype with float32
accumulation, as mixed-precision training prescribes (Micikevicius et al., "Mixed
Precision Training", 2018). For float32 operands they equal the plain contraction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float32_result(contract: Callable, a: jax.Array, b: jax.Array) -> jax.Array:
    return contract(a, b, jnp.float32)


def _forward(contract, a, b):
    return contract(a, b, jnp.float32), (a, b)


def _backward(contract, residuals, g):
    a, b = residuals
    dtype = jnp.result_type(a, b)
    _, vjp = jax.vjp(lambda a, b: contract(a, b, dtype), a, b)
    return vjp(g.astype(dtype))


_float32_result.defvjp(_forward, _backward)


def _einsum(subscripts: str, a, b, dtype):
    return jnp.einsum(subscripts, a, b, preferred_element_type=dtype)


def _dot_general(dimension_numbers, precision, out_sharding, a, b, dtype):
    return jax.lax.dot_general(a, b, dimension_numbers, precision, preferred_element_type=dtype, out_sharding=out_sharding)


def einsum_float32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)`, backward in the operands' dtype.

    Args:
      subscripts: a two-operand einsum specification.
      a, b: floating operands (bf16, f16 or f32).

    Returns:
      float32, the shape `jnp.einsum` gives. The gradients of `a` and `b` are in
      their own dtypes, computed from the output gradient cast to
      `jnp.result_type(a, b)`.
    """
    return _float32_result(functools.partial(_einsum, subscripts), a, b)


def dot_general_float32(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """`jax.lax.dot_general` with a float32 result, backward in the operands' dtype.

    Same signature as `jax.lax.dot_general` (so it serves as `flax.nnx.Linear`'s
    `dot_general`); `preferred_element_type` must be None or float32.

    Raises:
      ValueError: another `preferred_element_type`.
    """
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) != jnp.float32:
        raise ValueError(f"dot_general_float32: preferred_element_type must be float32, got {preferred_element_type}")
    return _float32_result(functools.partial(_dot_general, dimension_numbers, precision, out_sharding), lhs, rhs)
