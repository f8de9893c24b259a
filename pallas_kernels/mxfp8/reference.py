"""Pure-jnp MXFP8 block quantization and block-scaled matmul: the semantic spec and the "xla" path.

A 2-D tensor `x [R, C]` is cut into `block = (br, bc)` tiles (the last row/column tiles may be
partial). Each tile gets one E8M0 power-of-two scale (rule in formats.py) and its elements
are stored as FP8 E4M3 `x / scale`, rounded to nearest-even or stochastically. With square
32x32 tiles the transpose of `(data, scales)` is exactly the quantization of `x.T`, so a
backward pass reuses the forward quantization (Hopper still needs the transposed bytes
physically, since its FP8 MMA reads only K-major operands).

Sources: OCP Microscaling Formats (MX) v1.0 (2023) for E8M0/E4M3 and block scaling;
NVIDIA, "Recipes for Pre-training LLMs with MXFP8" (arXiv:2506.08027) for the round-up
scale rule; GEM engineering description (Meta, 2025) for 32x32 square blocks.
"""

from __future__ import annotations

import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mxfp8 import formats


class Rounding(enum.StrEnum):
    NEAREST = "nearest"  # round to nearest, ties to even
    STOCHASTIC = "stochastic"  # unbiased: E[q(v)] = v for |v| <= 448


def check_block(block, name: str = "block") -> tuple[int, int]:
    """Validates a `(rows, cols)` block shape of positive ints.

    Raises:
      ValueError: not a pair of positive ints.
    """
    if not (isinstance(block, (tuple, list)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{name} must be a pair of positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def check_rounding(rounding, key) -> Rounding:
    """Parses `rounding`; stochastic rounding needs a PRNG key.

    Raises:
      ValueError: unknown rounding name, or stochastic rounding without a key.
    """
    try:
        rounding = Rounding(rounding)
    except ValueError:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {[r.value for r in Rounding]}") from None
    if rounding is Rounding.STOCHASTIC and key is None:
        raise ValueError('rounding="stochastic" needs a PRNG key (key=jax.random.key(...))')
    return rounding


def _to_blocks(x: jax.Array, block: tuple[int, int]) -> jax.Array:
    """`[R, C]` -> zero-padded `[R/br, br, C/bc, bc]` float32."""
    (r, c), (br, bc) = x.shape, block
    rp, cp = math.ceil(r / br) * br, math.ceil(c / bc) * bc
    xf = jnp.pad(x.astype(jnp.float32), ((0, rp - r), (0, cp - c)))
    return xf.reshape(rp // br, br, cp // bc, bc)


def _from_blocks(xb: jax.Array, shape: tuple[int, int]) -> jax.Array:
    nr, br, nc, bc = xb.shape
    return xb.reshape(nr * br, nc * bc)[: shape[0], : shape[1]]


def round_stochastic_e4m3(v: jax.Array, key: jax.Array) -> jax.Array:
    """Unbiased stochastic rounding of float32 `v` (|v| <= 448) onto the E4M3 grid, as float8_e4m3fn.

    The grid spacing is `ulp = 2**(max(floor(log2|v|), -6) - 3)` (normal and subnormal
    E4M3), and `q = floor(v / ulp + u) * ulp` with `u ~ U[0, 1)`, so `E[q] = v` exactly;
    the final cast is exact. (Adding noise to fp32 mantissa bits instead is biased in
    the E4M3 subnormal range.)
    """
    _, e = jnp.frexp(jnp.abs(v))
    ulp_exp = jnp.maximum(e - 1, formats.E4M3_MIN_NORMAL_EXP) - formats.E4M3_MANTISSA_BITS
    u = jax.random.uniform(key, v.shape, jnp.float32)
    q = jnp.floor(v * formats.exp2_f32(-ulp_exp) + u) * formats.exp2_f32(ulp_exp)
    return jnp.clip(q, -formats.E4M3_MAX, formats.E4M3_MAX).astype(jnp.float8_e4m3fn)


def quantize_blocks(xb: jax.Array, rounding: Rounding, key) -> tuple[jax.Array, jax.Array]:
    """Quantizes float32 blocks `[nr, br, nc, bc]`; returns (E4M3 data, E8M0 scales `[nr, nc]`)."""
    # One reduction per tile: NaN counts as Inf (reduce_max does not propagate NaN on every
    # backend), so a tile holding NaN or Inf has an infinite amax; it gets the NaN byte below.
    amax = jnp.max(jnp.where(jnp.isnan(xb), jnp.inf, jnp.abs(xb)), axis=(1, 3))
    nonfinite = ~jnp.isfinite(amax)
    exp = formats.scale_exponent(jnp.where(nonfinite, 0.0, amax))
    v = xb * formats.exp2_f32(-exp)[:, None, :, None]  # exact: power-of-two scaling, |v| <= 448
    if rounding is Rounding.STOCHASTIC:
        data = round_stochastic_e4m3(v, key)
    else:
        data = jnp.clip(v, -formats.E4M3_MAX, formats.E4M3_MAX).astype(jnp.float8_e4m3fn)
    data = jnp.where(nonfinite[:, None, :, None], jnp.float8_e4m3fn(jnp.nan), data)
    return data, formats.encode_e8m0(exp, nan=nonfinite)


def quantize(x: jax.Array, *, block=(32, 32), rounding="nearest", key=None, hadamard_signs=None) -> tuple[jax.Array, jax.Array]:
    """Block-scaled FP8 quantization of `x [R, C]` (rotated first by `rotate(..., bf16_operands=True)` when
    `hadamard_signs` is given); see `pallas_kernels.mxfp8.quantize_mxfp8`."""
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [R, C], got shape {x.shape}")
    block = check_block(block)
    rounding = check_rounding(rounding, key)
    if hadamard_signs is not None:
        x = rotate(x, hadamard_signs, block=block[1], bf16_operands=True)
    data, scales = quantize_blocks(_to_blocks(x, block), rounding, key)
    return _from_blocks(data, x.shape), scales


def expand_scales(scales: jax.Array, shape: tuple[int, int], block: tuple[int, int]) -> jax.Array:
    """float32 `[R, C]`: each element's scale, from E8M0 `scales [ceil(R/br), ceil(C/bc)]`.

    Raises:
      ValueError: `scales` has the wrong shape or dtype for `shape` and `block`.
    """
    (r, c), (br, bc) = shape, check_block(block)
    want = (math.ceil(r / br), math.ceil(c / bc))
    if scales.shape != want:
        raise ValueError(f"scales of shape {scales.shape} do not match data {shape} with block {block}: want {want}")
    s = formats.decode_e8m0(scales)
    return jnp.repeat(jnp.repeat(s, br, axis=0), bc, axis=1)[:r, :c]


def dequantize(data: jax.Array, scales: jax.Array, *, block=(32, 32), dtype=jnp.float32) -> jax.Array:
    """`data * scale` per block, in `dtype`; see `pallas_kernels.mxfp8.dequantize_mxfp8`."""
    if data.ndim != 2 or data.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"data must be 2-D float8_e4m3fn, got {data.dtype} {data.shape}")
    return (data.astype(jnp.float32) * expand_scales(scales, data.shape, block)).astype(dtype)


def inv_rms(x: jax.Array, eps: float) -> jax.Array:
    """float32 `rsqrt(mean(x**2, -1) + eps)` over the last axis, kept as a size-1 axis."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """float32 `x * rsqrt(mean(x**2, -1) + eps) * weight` over the last axis."""
    return x.astype(jnp.float32) * inv_rms(x, eps) * weight.astype(jnp.float32)


def gelu(x: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """float32 `jax.nn.gelu(x + bias)` (tanh approximation; no bias: `gelu(x)`)."""
    xf = x.astype(jnp.float32)
    return jax.nn.gelu(xf if bias is None else xf + bias.astype(jnp.float32))


def rmsnorm_quantize(x, weight, *, eps=1e-6, block=(32, 32), rounding="nearest", key=None, hadamard_signs=None):
    """RMSNorm of the rows of `x [R, C]` then `quantize`; see `rmsnorm_quantize_mxfp8`."""
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [R, C] and weight [C]; got {x.shape} and {weight.shape}")
    return quantize(rmsnorm(x, weight, eps), block=block, rounding=rounding, key=key, hadamard_signs=hadamard_signs)


def matmul(a, a_scales, b, b_scales, *, a_block, b_block, b_contracting_dim=1, out_dtype=jnp.bfloat16) -> jax.Array:
    """`dequantize(a) @ dequantize(b).T` (b `[N, K]`) or `@ dequantize(b)` (b `[K, N]`, `b_contracting_dim=0`).

    float32 at HIGHEST precision, cast to `out_dtype`; `b_block` is the tile of `b` in its own
    layout. One `dot_general` contracting dim 1 of `a` with `b_contracting_dim` of `b`: no operand
    is transposed.
    """
    af = dequantize(a, a_scales, block=a_block)
    bf = dequantize(b, b_scales, block=b_block)
    dims = (((1,), (b_contracting_dim,)), ((), ()))
    out = jax.lax.dot_general(af, bf, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


# --- random Hadamard rotation ---------------------------------------------------------------
# Random Hadamard rotation (RHT) of the last axis, block-diagonal with random sign flips.
#
# `R = diag(s) . blockdiag(H_b, ..., H_b) / sqrt(b)` with `s` in {-1, +1}^C drawn from `key`
# and `H_b` the Sylvester Walsh-Hadamard matrix of order `b` (a power of two). `R` is
# orthogonal, so `X W = (X R)(R^T W)`: rotate the rows of X and the columns of W (along the
# contraction axis) and the product is unchanged, while outliers are spread over `b`
# elements before quantization. The sign flips keep a constant vector from turning into a
# single outlier (QuaRot issues #26/#79).
#
# Sources: QuaRot (Ashkboos et al., arXiv:2404.00456); NVIDIA NVFP4 training recipe
# (arXiv:2509.25149), which applies per-tile random Hadamard transforms to the weight-gradient
# GEMM's inputs in low-precision training.
#
# On the GPU this is one small batched matmul `[rows * C/b, b] @ [b, b]` that XLA/cuBLAS runs
# at memory speed (b <= 128 makes it bandwidth-bound: 2*b FLOP per 4-6 bytes moved).


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


def check_hadamard_signs(signs, c: int, block: int, what: str) -> None:
    """Checks `signs` for rotating `c` columns in Hadamard blocks of `block`.

    Raises:
      ValueError: (naming `what`) `signs` not `[c]`, `block` not a power of two, or `c` not a
        multiple of it.
    """
    if jnp.shape(signs) != (c,):
        raise ValueError(f"{what}: hadamard_signs must be [{c}] (one sign per column), got {jnp.shape(signs)}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"{what}: the Hadamard block must be a power of two, got {block}")
    if c % block:
        raise ValueError(f"{what}: the Hadamard rotation needs {c} columns in whole power-of-two blocks; {c} is not a multiple of {block}")


def rotate(x: jax.Array, signs: jax.Array, *, block: int, axis: int = -1, inverse: bool = False, bf16_operands: bool = False) -> jax.Array:
    """float32 `x` rotated along `axis` by `R = diag(signs) blockdiag(H_b) / sqrt(b)` (`R^T` if `inverse`).

    Along the last axis of a 2-D `x` this is `x @ R` (`x @ R^T`); along axis 0 it is `R^T @ x`
    (`R @ x`). By default float32 at HIGHEST precision. With `bf16_operands` the (sign-flipped)
    input is rounded to bf16 and multiplied by the +-1 `H_b` in bf16 (exact products, float32
    accumulation), then scaled by `1/sqrt(b)` in float32: one tensor-core pass, as the one-pass
    quantize kernel rotates its tile and as the FP8 layer's dgrad rotates its bf16 GEMM output
    back. That bf16 rounding (relative 2**-9) is far below E4M3's (2**-4).

    Raises:
      ValueError: as `check_hadamard_signs`, for the extent of `axis`.
    """
    xf = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    c = xf.shape[-1]
    check_hadamard_signs(signs, c, block, f"rotate (axis {axis} of x {x.shape})")
    signs = jnp.asarray(signs, jnp.float32)
    if not inverse:
        xf = xf * signs
    xb = xf.reshape(*xf.shape[:-1], c // block, block)
    if bf16_operands:
        h = jnp.asarray(hadamard_matrix(block), jnp.bfloat16)
        y = jnp.einsum("...gi,ij->...gj", xb.astype(jnp.bfloat16), h, preferred_element_type=jnp.float32) * np.float32(1.0 / np.sqrt(block))
    else:
        hb = jnp.asarray(hadamard_matrix(block) * (1.0 / np.sqrt(block)), jnp.float32)
        y = jnp.einsum("...gi,ij->...gj", xb, hb, precision=jax.lax.Precision.HIGHEST)
    y = y.reshape(xf.shape)
    if inverse:
        y = y * signs
    return jnp.moveaxis(y, -1, axis)


def random_hadamard(x: jax.Array, *, key: jax.Array, block: int = 32, inverse: bool = False) -> jax.Array:
    """Reference of `pallas_kernels.mxfp8.random_hadamard` (same arguments; computed in float32)."""
    return rotate(x, random_signs(key, x.shape[-1]), block=block, inverse=inverse).astype(x.dtype)
