"""FP8 E4M3 data and E8M0 power-of-two scales: the encodings and the block-scale rule.

E4M3 (`float8_e4m3fn`): largest finite 448, smallest normal 2**-6, 3 mantissa bits, no Inf.
E8M0 (`float8_e8m0fnu`, OCP MX v1.0): an unsigned biased exponent, value `2**(byte - 127)`,
byte 255 is NaN; there is no zero and no Inf.

Scale rule (never clips). For a block with largest magnitude `amax > 0`::

    scale = 2 ** ceil(log2(amax / 448))        # so amax / scale <= 448 exactly

The OCP MX v1.0 rule is `2 ** (floor(log2(amax)) - 8)`, which leaves `amax / scale` in
[256, 512) and saturates block maxima above 448 (up to 12.5% error on the largest
element). NVIDIA's MXFP8 recipe (arXiv:2506.08027) reports that rule can diverge and
rounds up instead, as we do; so do Transformer Engine and `jax.nn.scaled_matmul`.
The exponent is clamped to [-126, 127]: an all-zero block gets scale 1 (byte 127), a block
whose maximum is below `448 * 2**-126` gets `2**-126` (the smallest *normal* float32, so
no kernel ever multiplies by a float32 subnormal that flush-to-zero would turn into 0).
A block holding Inf or NaN gets the NaN scale byte 255 (see `quantize` in reference.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6
E4M3_MANTISSA_BITS = 3
E8M0_BIAS = 127
E8M0_NAN = 255
MIN_SCALE_EXP = -126  # smallest normal float32
MAX_SCALE_EXP = 127


def scale_exponent(amax: jax.Array) -> jax.Array:
    """The block-scale exponent `e` (int32) for block maxima `amax` (float32, >= 0, finite).

    Exact integer arithmetic on the float32 bits: with `amax = f * 2**E`, `f` in [0.5, 1),
    and `448 = 0.875 * 2**9`, `ceil(log2(amax / 448)) = E - 9 + (f > 0.875)`.
    Zero gives 0 (scale 1); the result is clamped to [-126, 127].
    """
    f, e = jnp.frexp(amax.astype(jnp.float32))
    exp = e - 9 + (f > 0.875).astype(jnp.int32)
    exp = jnp.where(amax > 0, exp, 0)
    return jnp.clip(exp, MIN_SCALE_EXP, MAX_SCALE_EXP).astype(jnp.int32)


def exp2_f32(exp: jax.Array) -> jax.Array:
    """`2.0 ** exp` as float32 for integer `exp` in [-126, 127], built from the bits (exact)."""
    return lax.bitcast_convert_type((exp.astype(jnp.int32) + E8M0_BIAS) << 23, jnp.float32)


def encode_e8m0(exp: jax.Array, nan: jax.Array | None = None) -> jax.Array:
    """E8M0 scales (`float8_e8m0fnu`) from int exponents; where `nan` is True, the NaN byte."""
    byte = (exp + E8M0_BIAS).astype(jnp.uint8)
    if nan is not None:
        byte = jnp.where(nan, jnp.uint8(E8M0_NAN), byte)
    return lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)


def decode_e8m0(scales: jax.Array) -> jax.Array:
    """float32 values of E8M0 scales: `2**(byte - 127)`; byte 255 -> NaN, byte 0 -> 2**-127."""
    if scales.dtype != jnp.float8_e8m0fnu:
        raise ValueError(f"scales must be float8_e8m0fnu, got {scales.dtype}")
    byte = lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    bits = jnp.where(byte == 0, 1 << 22, byte << 23)
    value = lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(byte == E8M0_NAN, jnp.float32(jnp.nan), value)
