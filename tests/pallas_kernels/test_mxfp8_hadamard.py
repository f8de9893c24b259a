"""Random Hadamard rotation: orthogonal, exact inverse, keeps X W, deterministic per key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp8 import random_hadamard


def _rotation_matrix(c, block, key):
    return np.asarray(random_hadamard(jnp.eye(c), key=key, block=block), np.float64)


@pytest.mark.parametrize("block", [32, 128])
def test_orthogonal_with_exact_inverse(block):
    key = jax.random.key(block)
    r = _rotation_matrix(256, block, key)
    np.testing.assert_allclose(r @ r.T, np.eye(256), atol=1e-6)  # float32 entries +-2^-2.5 (rounded, u = 6e-8) in 32-128 term sums
    r_inv = np.asarray(random_hadamard(jnp.eye(256), key=key, block=block, inverse=True), np.float64)
    np.testing.assert_allclose(r_inv, r.T, atol=1e-7)  # the same float32 entries, one rounding each: u x 0.18 = 1e-8
    x = jax.random.normal(jax.random.key(1), (3, 5, 256))
    back = random_hadamard(random_hadamard(x, key=key, block=block), key=key, block=block, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=1e-5, atol=1e-6)  # two float32 rotations: 2 gamma_128 = 1.5e-5


def test_block_diagonal_with_sign_flips():
    r = _rotation_matrix(64, 32, jax.random.key(3))
    assert np.all(r[:32, 32:] == 0) and np.all(r[32:, :32] == 0)
    np.testing.assert_allclose(np.abs(r[:32, :32]), np.full((32, 32), 32**-0.5), rtol=1e-6)  # one float32 rounding: u = 6e-8


def test_rotating_x_rows_and_w_columns_keeps_xw():
    key = jax.random.key(7)
    kx, kw = jax.random.split(jax.random.key(8))
    x = jax.random.normal(kx, (48, 128))
    w = jax.random.normal(kw, (128, 40))
    xr = random_hadamard(x, key=key, block=32)  # X R
    wr = random_hadamard(w.T, key=key, block=32).T  # R^T W = (W^T R)^T
    # float32: two 32-term rotations and a 128-term dot on each side, gamma_128 = 7.6e-6 of the sum of |terms|
    # (~sqrt(128) x the O(10) entries): 1e-4.
    np.testing.assert_allclose(np.asarray(xr @ wr), np.asarray(x @ w), rtol=1e-4, atol=1e-4)


def test_same_key_same_rotation_and_spreads_outliers():
    key = jax.random.key(11)
    x = jnp.zeros((2, 64)).at[0, 5].set(100.0)
    y1, y2 = random_hadamard(x, key=key), random_hadamard(x, key=key)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    dense = jax.random.normal(jax.random.key(13), (2, 64))
    assert not np.array_equal(np.asarray(random_hadamard(dense, key=key)), np.asarray(random_hadamard(dense, key=jax.random.key(12))))
    np.testing.assert_allclose(np.abs(np.asarray(y1[0, :32])), 100.0 / np.sqrt(32), rtol=1e-6)  # spread over the block; one rounding
    # A constant row does not collapse into one outlier thanks to the sign flips.
    c = random_hadamard(jnp.ones((1, 128)), key=key, block=128)
    assert float(jnp.max(jnp.abs(c))) < 0.5 * np.sqrt(128)  # not a numerical bound: sqrt(128) is the collapsed outlier


def test_dtype_preserved_and_bad_inputs():
    x = jnp.ones((4, 64), jnp.bfloat16)
    assert random_hadamard(x, key=jax.random.key(0)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="power of two"):
        random_hadamard(x, key=jax.random.key(0), block=24)
    with pytest.raises(ValueError, match="multiple"):
        random_hadamard(jnp.ones((4, 48)), key=jax.random.key(0), block=32)
