"""Random Hadamard rotation (RHT) of the last axis, block-diagonal with random sign flips.

`R = diag(s) . blockdiag(H_b, ..., H_b) / sqrt(b)` with `s` in {-1, +1}^C drawn from `key`
and `H_b` the Sylvester Walsh-Hadamard matrix of order `b` (a power of two). `R` is
orthogonal, so `X W = (X R)(R^T W)`: rotate the rows of X and the columns of W (along the
contraction axis) and the product is unchanged, while outliers are spread over `b`
elements before quantization. The sign flips keep a constant vector from turning into a
single outlier (QuaRot issues #26/#79).

Sources: QuaRot (Ashkboos et al., arXiv:2404.00456); NVIDIA NVFP4 training recipe
(arXiv:2509.25149) for per-tile random Hadamard transforms in low-precision training.

On the GPU this is one small batched matmul `[rows * C/b, b] @ [b, b]` that XLA/cuBLAS runs
at memory speed (b <= 128 makes it bandwidth-bound: 2*b FLOP per 4-6 bytes moved).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def hadamard_matrix(b: int) -> np.ndarray:
    """Unnormalized Sylvester Hadamard matrix of order `b` (entries +-1, `H H^T = b I`).

    Raises:
      ValueError: `b` is not a power of two >= 1.
    """
    if b < 1 or b & (b - 1):
        raise ValueError(f"Hadamard block must be a power of two, got {b}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h


def random_signs(key: jax.Array, n: int) -> jax.Array:
    """The +-1 float32 sign vector of length `n` that `key` selects."""
    return jax.random.rademacher(key, (n,), jnp.float32)


def random_hadamard(x: jax.Array, *, key: jax.Array, block: int = 32, inverse: bool = False) -> jax.Array:
    """Rotates the last axis of `x` by `R = diag(s) H_b / sqrt(b)` (or by `R^T` if `inverse`).

    Equivalent jnp::

        s = jax.random.rademacher(key, (C,))
        R = s[:, None] * scipy.linalg.block_diag(*[H_b] * (C // b)) / sqrt(b)
        out = x @ R            # inverse: x @ R.T, so random_hadamard(random_hadamard(x), inverse=True) == x

    Args:
      x: `[..., C]` floating, `C` a multiple of `block`.
      key: PRNG key; the same key gives the same rotation.
      block: Hadamard order `b`, a power of two (32 or 128 match the MXFP8 blocks).
      inverse: apply `R^T = R^{-1}` instead.

    Returns:
      Same shape and dtype as `x` (computed in float32).

    Raises:
      ValueError: `block` not a power of two, or `C` not a multiple of it.
    """
    h = hadamard_matrix(block)
    c = x.shape[-1]
    if c % block:
        raise ValueError(f"last axis ({c}) must be a multiple of the Hadamard block ({block})")
    signs = random_signs(key, c)
    xf = x.astype(jnp.float32)
    hb = jnp.asarray(h * (1.0 / np.sqrt(block)), jnp.float32)
    if not inverse:
        xf = xf * signs
    xb = xf.reshape(*x.shape[:-1], c // block, block)
    yb = jnp.einsum("...gi,ij->...gj", xb, hb, precision=jax.lax.Precision.HIGHEST)
    y = yb.reshape(x.shape)
    if inverse:
        y = y * signs
    return y.astype(x.dtype)
