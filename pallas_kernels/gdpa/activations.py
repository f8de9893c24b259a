"""GDPA activations and their derivatives as float32 elementwise code for the kernels.

Written with the operations Mosaic GPU lowers (mul/add, tanh, exp, erf, max,
select); with the kernels' `approx_math`, tanh and exp run on the fast
hardware approximations (about 2^-11 error, below bf16 rounding; through
`1 + tanh` the far negative tail of SiLU keeps only that absolute error, not a
relative one). SiLU's sigmoid is taken as `(1 + tanh(x / 2)) / 2`: one `tanh.approx` on the
special-function units, where `1 / (1 + exp(-x))` costs an exponential and a
reciprocal, two (the units issue 16 results a clock per SM, so in the
elementwise-bound GDPA steps they set the pace).

`gelu_poly6` is the degree-6 Maclaurin polynomial of exact (erf) GELU used by
Meta's GDPA kernels (facebookresearch/ads_model_kernel_library,
gdpa/src/activation_utils.py):

    gelu_poly6(x) = x/2 + x^2 (c2 + x^2 (c4 + x^2 c6)),
    c2 = 1/sqrt(2 pi), c4 = -1/(6 sqrt(2 pi)), c6 = 1/(40 sqrt(2 pi)).

It is a different function from GELU outside a small interval: its error
against `gelu_erf` is about 1.1e-3 at |x| = 1, 2.5e-2 at |x| = 1.5 and 0.22 at
|x| = 2 (tested), and it grows like x^6 beyond. Use it only when the scaled
scores are bounded by `POLY6_INPUT_BOUND`. With QK-norm (RMS-normalized q and
k, gains g_q, g_k) each score is bounded by Cauchy-Schwarz:

    |scale * q.k| <= scale * ||q|| ||k|| = scale * D * max|g_q| * max|g_k|

(`qk_norm_score_bound`). With the default scale 1/sqrt(D) that is sqrt(D) ~ 11
for D = 128 and unit gains, far outside the interval, so `gelu_poly6` needs a
scale of about 1/D with gains near 1 (bound 1) or gains kept below
sqrt(1.5 / (scale * D)).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.gdpa.reference import Activation

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
GELU_TANH_CUBIC = 0.044715
POLY6_C2 = INV_SQRT_2PI
POLY6_C4 = -INV_SQRT_2PI / 6.0
POLY6_C6 = INV_SQRT_2PI / 40.0
POLY6_INPUT_BOUND = 1.5  # |x| where gelu_poly6 is still within 2.5e-2 of GELU


def qk_norm_score_bound(head_dim: int, scale: float, q_gain_max: float = 1.0, k_gain_max: float = 1.0) -> float:
    """Largest |scale * q.k| when q and k are RMS-normalized with gains up to the given maxima."""
    return scale * head_dim * q_gain_max * k_gain_max


def value(activation: Activation, x: jax.Array) -> jax.Array:
    """act(x) for float32 x."""
    if activation is Activation.GELU:
        return 0.5 * x * (1.0 + jnp.tanh(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)))
    if activation is Activation.GELU_ERF:
        return 0.5 * x * (1.0 + jax.lax.erf(x * INV_SQRT_2))
    if activation is Activation.GELU_POLY6:
        x2 = x * x
        return 0.5 * x + x2 * (POLY6_C2 + x2 * (POLY6_C4 + x2 * POLY6_C6))
    if activation is Activation.SILU:
        half_x = 0.5 * x
        return half_x + half_x * jnp.tanh(half_x)
    if activation is Activation.RELU:
        return jnp.maximum(x, 0.0)
    if activation is Activation.NONE:
        return x
    raise ValueError(f"unknown activation {activation!r}")


def value_and_vjp(activation: Activation, x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(act(x), g * act'(x)) for float32 x and g, sharing the transcendental."""
    if activation is Activation.GELU:
        t = jnp.tanh(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x))
        half_x = 0.5 * x
        du = SQRT_2_OVER_PI * (1.0 + (3.0 * GELU_TANH_CUBIC) * x * x)
        return half_x * (1.0 + t), g * (0.5 * (1.0 + t) + half_x * (1.0 - t * t) * du)
    if activation is Activation.GELU_ERF:
        cdf = 0.5 * (1.0 + jax.lax.erf(x * INV_SQRT_2))
        return x * cdf, g * (cdf + x * INV_SQRT_2PI * jnp.exp(-0.5 * x * x))
    if activation is Activation.GELU_POLY6:
        x2 = x * x
        val = 0.5 * x + x2 * (POLY6_C2 + x2 * (POLY6_C4 + x2 * POLY6_C6))
        return val, g * (0.5 + x * (2.0 * POLY6_C2 + x2 * (4.0 * POLY6_C4 + x2 * (6.0 * POLY6_C6))))
    if activation is Activation.SILU:
        sig = 0.5 + 0.5 * jnp.tanh(0.5 * x)
        return x * sig, g * (sig * (1.0 + x * (1.0 - sig)))
    if activation is Activation.RELU:
        positive = x > 0.0
        return jnp.where(positive, x, 0.0), jnp.where(positive, g, 0.0)
    if activation is Activation.NONE:
        return x, g
    raise ValueError(f"unknown activation {activation!r}")
