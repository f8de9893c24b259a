"""pallas_kernels._src.bounded_trig: sine and cosine of bounded float32 angles against float64."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._src import bounded_trig


def _angles() -> np.ndarray:
    rng = np.random.default_rng(0)
    quadrant_edges = np.arange(-4 * 41_722, 4 * 41_722) * (math.pi / 4)  # every multiple of pi/4 within +-MAX_ANGLE
    edges = np.concatenate([quadrant_edges, np.nextafter(quadrant_edges, np.inf), np.nextafter(quadrant_edges, -np.inf)])
    rope = np.outer(np.arange(4097), 10000.0 ** (-np.arange(64) / 64)).ravel()  # RoPE's angles at D=128, 4096 rows
    x = np.concatenate([rng.uniform(-bounded_trig.MAX_ANGLE, bounded_trig.MAX_ANGLE, 500_000), edges, rope,
                        [0.0, -0.0, 1e-30, bounded_trig.MAX_ANGLE, -bounded_trig.MAX_ANGLE]])
    return x[np.abs(x) <= bounded_trig.MAX_ANGLE].astype(np.float32)


def test_sin_cos_within_2e7_of_float64():
    x = _angles()
    sin, cos = (np.asarray(a) for a in bounded_trig.sin_cos(jnp.asarray(x)))
    exact = x.astype(np.float64)
    assert np.max(np.abs(sin - np.sin(exact))) < 2e-7
    assert np.max(np.abs(cos - np.cos(exact))) < 2e-7
    assert sin.dtype == cos.dtype == np.float32


@pytest.mark.parametrize("x, want_sin, want_cos", [(0.0, 0.0, 1.0), (math.pi / 2, 1.0, 0.0), (math.pi, 0.0, -1.0),
                                                   (-math.pi / 2, -1.0, 0.0), (3 * math.pi / 2, -1.0, 0.0)])
def test_quadrants_take_the_right_function_and_sign(x, want_sin, want_cos):
    sin, cos = bounded_trig.sin_cos(jnp.float32(x))
    np.testing.assert_allclose([float(sin), float(cos)], [want_sin, want_cos], atol=3e-7)


def test_half_pi_parts_sum_to_half_pi_and_multiply_exactly():
    parts = bounded_trig.HALF_PI_PARTS
    assert math.isclose(sum(parts), math.pi / 2, rel_tol=0, abs_tol=1e-16)
    counts = np.arange(2**16, dtype=np.float64)
    for part in parts[:-1]:
        assert np.float32(part) == part
        mantissa, _ = math.frexp(part)
        assert (mantissa * 2**8).is_integer(), f"{part} has more than 8 significant bits"
        products = counts * part
        np.testing.assert_array_equal(products.astype(np.float32).astype(np.float64), products)  # exact in float32
    # The largest quadrant count MAX_ANGLE gives stays below 2**16.
    assert round(bounded_trig.MAX_ANGLE * 2 / math.pi) < 2**16


def test_the_reduction_needs_no_fused_multiply_add():
    """Step by step in float32 (each product and difference rounded, as a GPU may compute it without
    contracting to FMA), the reduced angle stays within 2e-7 of x - n pi/2 over the whole range."""
    x = _angles()
    n = np.round(x * np.float32(2 / math.pi)).astype(np.float32)
    r = x.copy()
    for part in bounded_trig.HALF_PI_PARTS:
        r = (r - n * np.float32(part)).astype(np.float32)
    exact = x.astype(np.float64) - n.astype(np.float64) * (math.pi / 2)
    assert np.max(np.abs(r - exact)) < 2e-7
