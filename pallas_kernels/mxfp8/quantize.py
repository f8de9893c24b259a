"""Public MXFP8 quantization: `quantize_mxfp8`, `dequantize_mxfp8`, `rmsnorm_quantize_mxfp8`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp8 import reference


def quantize_mxfp8(x: jax.Array, *, block=(32, 32), rounding="nearest", key=None) -> tuple[jax.Array, jax.Array]:
    """Block-scaled FP8 quantization with power-of-two (E8M0) scales, one per `block` tile.

    Equivalent jnp (per tile T of `x`, `block = (br, bc)`)::

        amax = max(|T|)
        e = ceil(log2(amax / 448)) if amax > 0 else 0       # never clips: max|T| / 2**e <= 448
        data[T] = round(T / 2**e).astype(float8_e4m3fn)     # RNE, or stochastic with `key`
        scales[T] = 2**e as float8_e8m0fnu

    Scale rule: rounds the exponent up, unlike the OCP MX v1.0 rule `floor(log2(amax)) - 8`
    which saturates block maxima in (448, 512) x 2**e (up to 12.5% error on the block
    maximum) and can diverge in training (NVIDIA MXFP8 recipe, arXiv:2506.08027).
    Exponents are clamped to [-126, 127]: an all-zero tile gets scale 1 and zero data; a
    tile whose maximum is below 448 * 2**-126 gets scale 2**-126 (no float32 subnormal
    scale, so no NaN or Inf from flush-to-zero), and its elements round on E4M3's
    subnormal grid. Inf/NaN policy: a tile holding any Inf or NaN is poisoned: its scale
    is the E8M0 NaN byte (255) and all its data NaN, so every product reading it is NaN.

    With square tiles (32x32 MXFP8 tiles, 128x128 weight tiles) the transpose reuses the
    quantization: `quantize_mxfp8(x.T) == (data.T, scales.T)` bit for bit (nearest rounding).

    Args:
      x: `[R, C]` float (bf16/f32); the last tiles may be partial.
      block: `(rows, cols)` of one scale tile; (32, 32) for MXFP8, (1, 128) / (128, 128)
        for the 128-wide-K GEMM variant.
      rounding: "nearest" (ties to even) or "stochastic" (unbiased, ulp-aware on E4M3's
        normal and subnormal grid; needs `key`).
      key: PRNG key for stochastic rounding.

    Returns:
      `(data, scales)`: float8_e4m3fn `[R, C]` and float8_e8m0fnu `[ceil(R/br), ceil(C/bc)]`.

    Raises:
      ValueError: `x` not 2-D, a bad block, an unknown rounding, or stochastic without a key.
    """
    return reference.quantize(x, block=block, rounding=rounding, key=key)


def dequantize_mxfp8(data: jax.Array, scales: jax.Array, *, block=(32, 32), dtype=jnp.float32) -> jax.Array:
    """`data * scale` for every tile: the inverse of `quantize_mxfp8` up to rounding.

    Args:
      data: float8_e4m3fn `[R, C]`.
      scales: float8_e8m0fnu `[ceil(R/br), ceil(C/bc)]`.
      block: the `(rows, cols)` tile the scales were computed with.
      dtype: result dtype.

    Returns:
      `[R, C]` in `dtype` (exact in float32: products of E4M3 values and powers of two).

    Raises:
      ValueError: wrong dtypes or scales that do not match `data` and `block`.
    """
    return reference.dequantize(data, scales, block=block, dtype=dtype)


def rmsnorm_quantize_mxfp8(
    x: jax.Array, weight: jax.Array, *, eps: float = 1e-6, block=(32, 32), rounding="nearest", key=None
) -> tuple[jax.Array, jax.Array]:
    """RMSNorm fused with block quantization: `quantize_mxfp8(rmsnorm(x) * weight)`.

    Equivalent jnp::

        y = x * rsqrt(mean(x**2, axis=-1, keepdims=True) + eps) * weight    # float32
        return quantize_mxfp8(y, block=block, rounding=rounding, key=key)

    The normalized activation is never written in high precision: only the FP8 data and
    the scales leave the fusion (GEM: quantization fused into the preceding norm).
    Forward only (not differentiable); the FP8 dense layer quantizes its own input.

    Args:
      x: `[R, C]` float.
      weight: `[C]` float, the RMSNorm gain.
      eps: added to the mean square.
      block, rounding, key: as in `quantize_mxfp8`.

    Returns:
      `(data, scales)` as in `quantize_mxfp8`.

    Raises:
      ValueError: mismatched shapes, or the errors of `quantize_mxfp8`.
    """
    return reference.rmsnorm_quantize(x, weight, eps=eps, block=block, rounding=rounding, key=key)
