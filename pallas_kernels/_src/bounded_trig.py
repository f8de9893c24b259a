"""float32 sine and cosine of bounded angles from multiplies, adds and selects, for kernels.

`jnp.sin` / `jnp.cos` inside a Mosaic GPU kernel compile to CUDA's accurate
`sinf` / `cosf`: a fast path plus a Payne-Hanek reduction for huge arguments,
code that raises the registers a kernel computing many of them at once needs
(the block-local kernels' RoPE tables spilled to local memory because of it:
`benchmarks/long_history.md`). Angles known to be below `MAX_ANGLE` need
neither: `sin_cos` reduces them by pi/2 with a Cody-Waite split of pi/2 into
three float32 parts of at most 8 significant bits (each quadrant count times
part exact for counts below 2^16, with or without fused multiply-adds) and a
float32 remainder, evaluates Taylor polynomials on [-pi/4, pi/4] and chooses
sine or cosine and the sign by quadrant. Absolute error below 2e-7
over [-MAX_ANGLE, MAX_ANGLE] against float64 sine and cosine of the float32
angle (1.3e-7 measured; XLA's float32 `jnp.sin` 3.3e-8); rotary embeddings
round the result to bf16 or f16 anyway.

Equivalent jnp: `(jnp.sin(x), jnp.cos(x))` for float32 `x` with `|x| <= MAX_ANGLE`.
Sources: W. J. Cody and W. Waite, Software Manual for the Elementary Functions
(1980), for the reduction with a split constant.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MAX_ANGLE = 65536.0  # the largest |x| that `sin_cos` takes: its quadrant count stays below 2**16


def _half_pi_parts(parts: int = 3, bits: int = 8) -> tuple[float, ...]:
    """pi/2 as `parts` float32 values of at most `bits` significant bits each, then the float32 rest."""
    rest, out = math.pi / 2, []
    for _ in range(parts):
        unit = 2.0 ** (math.floor(math.log2(abs(rest))) - bits + 1)
        part = round(rest / unit) * unit
        out.append(part)
        rest -= part
    return (*out, float(np.float32(rest)))


HALF_PI_PARTS = _half_pi_parts()
# Taylor coefficients in r^2, highest first: sin r = r + r^3 * S(r^2), cos r = 1 + r^2 * C(r^2).
SIN_COEFFS = (1 / 362880, -1 / 5040, 1 / 120, -1 / 6)
COS_COEFFS = (1 / 40320, -1 / 720, 1 / 24, -1 / 2)


def _horner(z: jax.Array, coeffs: tuple[float, ...]) -> jax.Array:
    acc = z * coeffs[0] + coeffs[1]
    for c in coeffs[2:]:
        acc = acc * z + c
    return acc


def sin_cos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(sin x, cos x)`, each float32 of `x`'s shape, for float32 `x` with `|x| <= MAX_ANGLE` (not
    checked: larger angles give wrong values; callers bound them statically). Other float dtypes
    compute in their own precision, which the error bound above does not cover."""
    n = jnp.round(x * (2 / math.pi))
    r = x
    for part in HALF_PI_PARTS:
        r = r - n * part
    z = r * r
    s = r + r * z * _horner(z, SIN_COEFFS)
    c = 1.0 + z * _horner(z, COS_COEFFS)
    quadrant = lax.convert_element_type(n, jnp.int32)
    swap = (quadrant & 1) == 1
    sin = jnp.where(swap, c, s)
    cos = jnp.where(swap, s, c)
    return jnp.where((quadrant & 2) == 2, -sin, sin), jnp.where(((quadrant + 1) & 2) == 2, -cos, cos)
