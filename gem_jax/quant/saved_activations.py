"""FP8 saved activations: a function whose input is kept for the backward as E4M3 with block scales.

`fp8_residual(fn, x, *args)` returns `fn(x, *args)` exactly (the forward never sees the
quantization). For the backward it saves `x` quantized to FP8 E4M3 with one power-of-two
(E8M0) scale per 1x128 block (`pallas_kernels.mxfp8.quantize_mxfp8`) in place of every
activation `fn` would otherwise keep, and the backward dequantizes `x~` and
differentiates `fn` at `x~` (rematerializing `fn`'s forward from the 8-bit copy; XLA drops
the recomputed outputs nobody reads). The cotangents are therefore the exact cotangents of
`fn` at `x~`:

    dense  y = x W:        dW = x~^T dy (FP8 input), dx = dy W^T (exact: no x in it)
    MLP    y = gelu(h) W:  dW = gelu(h~)^T dy, dh = (dy W^T) * gelu'(h~)

Error bound: E4M3 keeps 3 mantissa bits, so each element of `x~` is within a relative
2^-4 of `x` (round to nearest; the scale rule never clips, see
`pallas_kernels.mxfp8.formats`), about 2.7% in relative Frobenius norm on Gaussian,
heavy-tailed and outlier-channel activations; a weight gradient `x~^T dy` carries the same
2.7% (measured in tests/gem_jax/test_quant_saved_activations.py).

Why 1x128 blocks (one scale per token and 128 features) rather than MXFP8's 32x32: the
backward dequantizes, never feeds an FP8 GEMM, so the transpose-reuse of square tiles buys
nothing here, while per-token scales keep every token's relative error at 2.7% when token
norms differ by orders of magnitude (32 tokens sharing a 32x32 scale flush the small ones
to zero: with token norms lognormal(sigma=3) the 99th-percentile token error is 100% with
32x32 and 2.8% with 1x128). The row-wise block is also the cheaper XLA quantization (137 us
against 233 us for 8192x8192 bf16 on an H200, benchmarks/mxfp8.md); the scales cost 1/128
byte per element.

Non-finite values are never turned into numbers: a block holding Inf or NaN dequantizes to
NaN (the quantizer's poisoning rule), so the gradients that read it are NaN, as the exact
gradients are non-finite there.

Sources: GEM engineering description (Meta, 2025) for FP8 saved activations;
COAT (Xi et al., arXiv:2410.19313) and DeepSeek-V3 (arXiv:2412.19437) section 3.3 for FP8
activations with 1x128 per-token-group scales kept for the backward.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.quant.dense import Fp8Linear
from pallas_kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8

BLOCK = (1, 128)  # one E8M0 scale per token and 128 features (see the module docstring)


def fp8_residual(fn: Callable[..., jax.Array], x: jax.Array, *args: Any) -> jax.Array:
    """`fn(x, *args)`, with `x` saved for the backward as FP8 E4M3 (1x128 block scales).

    Equivalent jnp (forward and backward)::

        y = fn(x, *args)                                        # exactly, bit for bit
        x_hat = dequantize_mxfp8(*quantize_mxfp8(x.reshape(T, -1), block=(1, 128)),
                                 block=(1, 128)).reshape(x.shape)
        dx, dargs = jax.vjp(fn, x_hat, *args)[1](dy)            # fn differentiated at x_hat

    Everything `fn` would save for its backward is rebuilt from the 8-bit copy of `x`
    (its elementwise work is recomputed; matmul outputs nobody reads are dropped by
    XLA). `args` (weights, modules: any pytree, e.g. an `nnx.Linear`) are kept as they
    are; their cotangents and `x`'s are those of `fn` at `x_hat`.

    Args:
      fn: a pure function of `(x, *args)` returning one array; its identity is part of
        the trace cache key, so pass a module-level function rather than a fresh lambda.
      x: float `[T, ...]` (bf16/f16/f32), T >= 0 rows; the trailing axes are flattened
        into the quantized features (blocks of 128 along them, the last block partial).
      *args: further inputs of `fn`, differentiable or not (integer arrays get float0
        cotangents).

    Returns:
      `fn(x, *args)`.

    Raises:
      ValueError: `x` is not a floating array of rank >= 2.
    """
    if x.ndim < 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"fp8_residual: x must be a floating array [T, ...] of rank >= 2; got {x.dtype} {x.shape}")
    return _fp8_residual(fn, x.shape, jnp.dtype(x.dtype), x, args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_residual(fn, shape, dtype, x, args):
    del shape, dtype
    return fn(x, *args)


def _fwd(fn, shape, dtype, x, args):
    del dtype
    data, scales = quantize_mxfp8(x.reshape(shape[0], math.prod(shape[1:])), block=BLOCK)
    return fn(x, *args), (data, scales, args)


def _bwd(fn, shape, dtype, residuals, dy):
    # The barrier ties the 8-bit copy to the incoming cotangent: XLA can neither schedule the
    # dequantization and recomputation before the backward reaches this function (holding
    # the full-precision x_hat from early on) nor fuse them with the forward's quantization.
    data, scales, args, dy = jax.lax.optimization_barrier(residuals + (dy,))
    x_hat = dequantize_mxfp8(data, scales, block=BLOCK, dtype=dtype).reshape(shape)
    _, vjp = jax.vjp(lambda x, args: fn(x, *args), x_hat, args)
    return vjp(dy)


_fp8_residual.defvjp(_fwd, _bwd)


def _call(x: jax.Array, layer: nnx.Module) -> jax.Array:
    return layer(x)


def dense_fp8_input(layer: nnx.Linear | Fp8Linear, x: jax.Array) -> jax.Array:
    """`layer(x)` whose weight gradient reads an FP8 copy of `x`; `dx` stays exact.

    An `Fp8Linear` already keeps its input in FP8 for its weight gradient and is
    called as it is.

    Args:
      layer: a dense layer (`gem_jax.nn.layers.dense`).
      x: `[T, in]` float.

    Returns:
      `layer(x)`, `[T, out]`.
    """
    if isinstance(layer, Fp8Linear):
        return layer(x)
    return fp8_residual(_call, x, layer)


def _gelu_then(h: jax.Array, layer: nnx.Module) -> jax.Array:
    return layer(jax.nn.gelu(h))


def gelu_dense_fp8_input(layer: nnx.Module, h: jax.Array) -> jax.Array:
    """`layer(jax.nn.gelu(h))` keeping only an FP8 copy of `h` for the backward.

    The backward recomputes `gelu(h~)` (for the layer's weight gradient) and
    `gelu'(h~)`; the bf16 `h`, `gelu(h)` and GELU intermediates are not kept.

    Args:
      layer: the dense layer after the GELU (`nnx.Linear` or `Fp8Linear`).
      h: `[T, hidden]` float, the pre-activation.

    Returns:
      `layer(jax.nn.gelu(h))`, `[T, out]`.
    """
    return fp8_residual(_gelu_then, h, layer)
