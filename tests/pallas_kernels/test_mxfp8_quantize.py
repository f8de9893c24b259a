"""MXFP8 block quantization: error bound, scale rule, edge blocks, transposed reuse, stochastic rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8, rmsnorm_quantize_mxfp8
from pallas_kernels.mxfp8 import formats, reference

def _expand(scales, shape, block):
    return np.asarray(reference.expand_scales(scales, shape, block))


def _check_bound(x, data, scales, block):
    """Per element: |deq - x| <= max(|x| 2**-4, scale 2**-10) (half an E4M3 ulp, normal or subnormal)."""
    x = np.asarray(x, np.float64)
    s = _expand(scales, x.shape, block).astype(np.float64)
    deq = np.asarray(data.astype(jnp.float32), np.float64) * s
    bound = np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10)
    assert np.all(np.abs(deq - x) <= bound * (1 + 1e-6)), np.max(np.abs(deq - x) / bound)
    return deq


def _fresh(shape, seed, spread=3.0):
    """Normal values whose row magnitudes span `spread` orders of e (token-norm spread)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, shape) * jnp.exp(spread * jax.random.normal(k2, (shape[0], 1)))


@pytest.mark.parametrize(
    "block, shape",
    [((32, 32), (64, 256)), ((32, 32), (70, 100)), ((1, 128), (70, 100)), ((128, 128), (64, 256)), ((1, 32), (1, 5))],
)
def test_error_within_e4m3_bound_per_block(block, shape):
    x = _fresh(shape, seed=hash((block, shape)) % 1000)
    data, scales = quantize_mxfp8(x, block=block)
    assert data.dtype == jnp.float8_e4m3fn and data.shape == shape
    assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    _check_bound(x, data, scales, block)
    np.testing.assert_array_equal(np.asarray(dequantize_mxfp8(data, scales, block=block)), _check_bound(x, data, scales, block))


@pytest.mark.parametrize("block", [(32, 32), (1, 128)])
def test_scale_never_clips_and_is_tight(block):
    x = _fresh((96, 256), seed=7)
    data, scales = quantize_mxfp8(x, block=block)
    xb = np.abs(np.asarray(reference._to_blocks(x, block)))
    amax = xb.max(axis=(1, 3))
    s = np.asarray(formats.decode_e8m0(scales), np.float64)
    ratio = amax / s
    assert np.all(ratio <= 448.0) and np.all(ratio > 224.0), (ratio.min(), ratio.max())
    assert np.max(np.abs(np.asarray(data.astype(jnp.float32)))) <= 448.0


def test_ocp_floor_rule_would_clip_where_ours_does_not():
    # amax = 500 * 2**-3: OCP's 2**(floor(log2 amax) - 8) = 2**-3 leaves 500 > 448 (saturated); ours picks 2**-2.
    x = jnp.full((32, 32), 0.01).at[3, 4].set(500 * 2.0**-3)
    data, scales = quantize_mxfp8(x)
    assert float(formats.decode_e8m0(scales)[0, 0]) == 2.0**-2
    assert float(data[3, 4].astype(jnp.float32)) * 2.0**-2 == pytest.approx(500 * 2.0**-3, rel=2**-4)


def test_all_zero_blocks():
    x = jnp.zeros((64, 96), jnp.bfloat16).at[40:, 70:].set(3.0)
    data, scales = quantize_mxfp8(x)
    byte = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))
    assert byte[0, 0] == formats.E8M0_BIAS  # scale 1
    assert np.all(np.asarray(data[:32, :64].astype(jnp.float32)) == 0)
    assert np.all(np.isfinite(np.asarray(dequantize_mxfp8(data, scales))))


@pytest.mark.parametrize("amax", [1.2e-38, 3e-39, 1e-30, 2.0**-126 * 448])
def test_block_max_near_smallest_normal(amax):
    k = jax.random.key(11)
    x = jax.random.uniform(k, (32, 64), minval=-1.0, maxval=1.0) * amax
    data, scales = quantize_mxfp8(x)
    deq = np.asarray(dequantize_mxfp8(data, scales))
    assert np.all(np.isfinite(deq)) and np.all(np.isfinite(np.asarray(data.astype(jnp.float32))))
    s = np.asarray(formats.decode_e8m0(scales))
    assert np.all(s >= 2.0**-126)  # never a float32 subnormal scale
    _check_bound(x, data, scales, (32, 32))


def test_values_above_448_and_near_float32_max():
    x = _fresh((64, 64), seed=3, spread=0.0)
    x = x.at[0, 0].set(1e4).at[40, 40].set(-3.0e38).at[5, 50].set(449.0)
    data, scales = quantize_mxfp8(x)
    assert np.all(np.isfinite(np.asarray(data.astype(jnp.float32))))
    deq = _check_bound(x, data, scales, (32, 32))
    assert deq[40, 40] == pytest.approx(-3.0e38, rel=2**-4)


def test_inf_and_nan_poison_their_block_only():
    x = _fresh((64, 64), seed=5, spread=0.0).at[1, 2].set(jnp.inf).at[40, 33].set(jnp.nan)
    data, scales = quantize_mxfp8(x)
    byte = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))
    np.testing.assert_array_equal(byte == formats.E8M0_NAN, [[True, False], [False, True]])
    d = np.asarray(data.astype(jnp.float32))
    assert np.all(np.isnan(d[:32, :32])) and np.all(np.isnan(d[32:, 32:]))
    assert np.all(np.isfinite(d[:32, 32:])) and np.all(np.isfinite(d[32:, :32]))
    deq = np.asarray(dequantize_mxfp8(data, scales))
    assert np.all(np.isnan(deq[:32, :32])) and np.all(np.isfinite(deq[:32, 32:]))


@pytest.mark.parametrize("block, shape", [((32, 32), (96, 160)), ((32, 32), (70, 45)), ((128, 128), (70, 45))])
def test_transpose_reuses_square_block_quantization(block, shape):
    x = _fresh(shape, seed=sum(shape))
    data, scales = quantize_mxfp8(x, block=block)
    data_t, scales_t = quantize_mxfp8(x.T, block=block)
    np.testing.assert_array_equal(np.asarray(data.T).view(np.uint8), np.asarray(data_t).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales.T).view(np.uint8), np.asarray(scales_t).view(np.uint8))


def test_bf16_input_and_zero_rows():
    x = _fresh((40, 64), seed=9).astype(jnp.bfloat16)
    data, scales = quantize_mxfp8(x)
    _check_bound(x.astype(jnp.float32), data, scales, (32, 32))
    d0, s0 = quantize_mxfp8(jnp.zeros((0, 64)))
    assert d0.shape == (0, 64) and s0.shape == (0, 2)
    assert dequantize_mxfp8(d0, s0).shape == (0, 64)


def _grid_neighbours(v):
    """The E4M3 grid points just below and above float32 `v` (|v| <= 448)."""
    a = np.abs(v)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    ulp = 2.0 ** (np.maximum(e, -6) - 3)
    lo = np.floor(v / ulp) * ulp
    return lo, lo + ulp, ulp


def test_stochastic_rounding_is_unbiased_including_small_magnitudes():
    # One 32x32 block with max 448 (scale 1); values span normals, E4M3 subnormals (< 2**-6) and tiny ones.
    rng = np.random.default_rng(0)
    mags = np.concatenate([rng.uniform(1, 400, 300), rng.uniform(2.0**-6, 1, 300), rng.uniform(2.0**-10, 2.0**-6, 423)])
    v = (mags * rng.choice([-1, 1], mags.size)).astype(np.float32)
    v = np.concatenate([[448.0], v]).astype(np.float32).reshape(32, 32)
    x = jnp.asarray(v)
    n_draws = 4000
    keys = jax.random.split(jax.random.key(123), n_draws)
    draws = jax.vmap(lambda k: quantize_mxfp8(x, rounding="stochastic", key=k)[0].astype(jnp.float32))(keys)
    draws = np.asarray(draws, np.float64)
    lo, hi, ulp = _grid_neighbours(v.astype(np.float64))
    assert np.all((draws == lo) | (draws == hi))  # only the two neighbours
    mean = draws.mean(axis=0)
    sigma = ulp / 2 / np.sqrt(n_draws)  # std of the mean is at most ulp / (2 sqrt(n))
    assert np.all(np.abs(mean - v) <= 5 * sigma + 1e-12), np.max(np.abs(mean - v) / sigma)
    # Nearest rounding of the same values is biased for most of them; stochastic is not.
    # Stochastic: E|mean - v| / ulp <= sqrt(f (1 - f) / n) <= 0.5 / sqrt(4000) = 0.008; nearest is ~0.25 on average.
    assert np.mean(np.abs(mean - v) / ulp) < 0.02


def test_stochastic_rounding_same_key_same_result_and_bound():
    x = _fresh((64, 96), seed=21)
    key = jax.random.key(4)
    d1, s1 = quantize_mxfp8(x, rounding="stochastic", key=key)
    d2, s2 = quantize_mxfp8(x, rounding="stochastic", key=key)
    np.testing.assert_array_equal(np.asarray(d1).view(np.uint8), np.asarray(d2).view(np.uint8))
    deq = np.asarray(dequantize_mxfp8(d1, s1), np.float64)
    s = _expand(s1, x.shape, (32, 32))
    assert np.all(np.abs(deq - np.asarray(x)) <= np.maximum(np.abs(np.asarray(x)) * 2.0**-3, s * 2.0**-9) * (1 + 1e-6))


def test_rmsnorm_quantize_matches_composition():
    x = _fresh((48, 96), seed=13)
    w = jax.random.normal(jax.random.key(14), (96,))
    data, scales = rmsnorm_quantize_mxfp8(x, w, eps=1e-5)
    xf = np.asarray(x, np.float64)
    y = xf / np.sqrt(np.mean(xf**2, axis=-1, keepdims=True) + 1e-5) * np.asarray(w)
    _check_bound(y, data, scales, (32, 32))
    ref_d, ref_s = quantize_mxfp8(reference.rmsnorm(x, w, 1e-5))
    np.testing.assert_array_equal(np.asarray(data).view(np.uint8), np.asarray(ref_d).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), np.asarray(ref_s).view(np.uint8))


def test_bad_inputs_raise():
    x = jnp.ones((32, 32))
    with pytest.raises(ValueError, match="2-D"):
        quantize_mxfp8(jnp.ones((2, 32, 32)))
    with pytest.raises(ValueError, match="block"):
        quantize_mxfp8(x, block=(0, 32))
    with pytest.raises(ValueError, match="rounding"):
        quantize_mxfp8(x, rounding="up")
    with pytest.raises(ValueError, match="key"):
        quantize_mxfp8(x, rounding="stochastic")
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_quantize_mxfp8(x, jnp.ones(31))
    data, scales = quantize_mxfp8(x)
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp8(data, scales, block=(16, 16))
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        dequantize_mxfp8(data, jnp.ones((1, 1)))
