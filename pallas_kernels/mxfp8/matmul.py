"""Public block-scaled FP8 matmul: `mxfp8_matmul(a, a_scales, b, b_scales) = a @ b.T`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch
from pallas_kernels.mxfp8 import formats, reference

K_BLOCKS = (32, 128)  # K extent of one scale block (and of one promotion in the kernel)
A_ROW_BLOCKS = (1, 32, 128)  # rows of `a` sharing a scale: 1x128 activations, 32x32 MX tiles
B_ROW_BLOCKS = (32, 128)  # rows of `b` sharing a scale: 32x32 MX tiles, 128x128 weight blocks


def _infer_block(extent: int, n_blocks: int, candidates, what: str) -> int:
    for c in candidates:
        if math.ceil(extent / c) == n_blocks:
            return c
    raise ValueError(
        f"{what}: {n_blocks} scale blocks for extent {extent} matches no supported block size {candidates} "
        f"(want ceil({extent}/block) blocks)"
    )


def scale_blocks(a_shape, a_scales_shape, b_shape, b_scales_shape) -> tuple[tuple[int, int], tuple[int, int]]:
    """The `(rows, K)` block shapes of `a` and `b` implied by their scale shapes.

    Raises:
      ValueError: shapes that match no supported granularity, or different K blocks.
    """
    (m, k), (n, _) = a_shape, b_shape
    if len(a_scales_shape) != 2 or len(b_scales_shape) != 2:
        raise ValueError(f"scales must be 2-D; got {a_scales_shape} and {b_scales_shape}")
    if a_scales_shape[1] != b_scales_shape[1]:
        raise ValueError(f"a_scales {a_scales_shape} and b_scales {b_scales_shape} must have the same number of K blocks")
    kb = _infer_block(k, a_scales_shape[1], K_BLOCKS, "K blocks of a_scales")
    ra = _infer_block(m, a_scales_shape[0], A_ROW_BLOCKS, "row blocks of a_scales")
    rb = _infer_block(n, b_scales_shape[0], B_ROW_BLOCKS, "row blocks of b_scales")
    return (ra, kb), (rb, kb)


def mxfp8_matmul(
    a: jax.Array,
    a_scales: jax.Array,
    b: jax.Array,
    b_scales: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    implementation: str | _dispatch.Implementation | None = None,
    config=None,
) -> jax.Array:
    """Block-scaled FP8 GEMM `a @ b.T` with both operands K-major, scales applied in float32.

    Equivalent jnp::

        A = a.astype(f32) * repeat(a_scales, blocks)         # dequantize_mxfp8
        B = b.astype(f32) * repeat(b_scales, blocks)
        out = (A @ B.T).astype(out_dtype)                    # float32 accumulation

    The Pallas kernel (Hopper) runs FP8 wgmma per K block and promotes every block into a
    float32 accumulator on the CUDA cores (DeepSeek-V3, arXiv:2412.19437 section 3.3):
    every 32 K for MXFP8 32x32 scales, every 128 K for the 1x128 / 128x128 variant. Hopper
    has no block-scaled MMA, so the 32-wide promotion costs CUDA-core work of the same
    order as the MMA (see kernel_matmul.py).

    Args:
      a: float8_e4m3fn `[M, K]` (K-major), from `quantize_mxfp8`.
      a_scales: float8_e8m0fnu `[ceil(M/ra), ceil(K/kb)]` with ra in {1, 32, 128}, kb in {32, 128}.
      b: float8_e4m3fn `[N, K]` (K-major: the weight stored as `[out, in]`).
      b_scales: float8_e8m0fnu `[ceil(N/rb), ceil(K/kb)]` with rb in {32, 128}, the same kb.
      out_dtype: result dtype (bfloat16 or float32).
      implementation: "xla" (reference), "pallas" (Hopper kernel) or None (pallas on Hopper).
      config: `kernel_matmul.TuningConfig` for the Pallas kernel (None: the default for kb).

    Returns:
      `[M, N]` in `out_dtype`. NaN scale bytes (255) make their rows/columns NaN. Scale
      products outside the float32 normal range overflow to Inf or flush to zero.

    Raises:
      ValueError: wrong dtypes, mismatched shapes, or unsupported block granularity.
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a must be [M, K] and b [N, K] with the same K; got {a.shape} and {b.shape}")
    if a.dtype != jnp.float8_e4m3fn or b.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"a and b must be float8_e4m3fn; got {a.dtype} and {b.dtype}")
    if a_scales.dtype != jnp.float8_e8m0fnu or b_scales.dtype != jnp.float8_e8m0fnu:
        raise ValueError(f"scales must be float8_e8m0fnu; got {a_scales.dtype} and {b_scales.dtype}")
    a_block, b_block = scale_blocks(a.shape, a_scales.shape, b.shape, b_scales.shape)
    impl = _dispatch.resolve(implementation)
    (m, k), n = a.shape, b.shape[0]
    if impl is _dispatch.Implementation.XLA or m == 0 or n == 0 or k == 0:
        return reference.matmul(a, a_scales, b, b_scales, a_block=a_block, b_block=b_block, out_dtype=out_dtype)
    return _pallas_matmul(a, a_scales, b, b_scales, a_block, b_block, out_dtype, config)


def _pad_to(x: jax.Array, shape, value) -> jax.Array:
    pads = [(0, t - s) for s, t in zip(x.shape, shape)]
    return x if not any(p for _, p in pads) else jnp.pad(x, pads, constant_values=value)


def _pallas_matmul(a, a_scales, b, b_scales, a_block, b_block, out_dtype, config):
    from pallas_kernels.mxfp8 import kernel_matmul  # Mosaic GPU; imported only when used

    (m, k), n = a.shape, b.shape[0]
    kb = a_block[1]
    config = config or kernel_matmul.default_config(kb)
    mp = math.ceil(m / config.m_multiple) * config.m_multiple
    np_ = math.ceil(n / config.n_multiple) * config.n_multiple
    kp = math.ceil(k / config.k_multiple(kb)) * config.k_multiple(kb)
    a8 = _pad_to(a, (mp, kp), 0)
    b8 = _pad_to(b, (np_, kp), 0)
    # Per-row / per-column float32 scales [K/kb, rows]; padding rows get scale 1 (their data is 0).
    rs = _pad_to(jnp.repeat(formats.decode_e8m0(a_scales).T, a_block[0], axis=1)[:, :m], (kp // kb, mp), 1.0)
    cs = _pad_to(jnp.repeat(formats.decode_e8m0(b_scales).T, b_block[0], axis=1)[:, :n], (kp // kb, np_), 1.0)
    out = kernel_matmul.scaled_matmul(a8, b8, rs, cs, block_k=kb, col_group=b_block[0], out_dtype=out_dtype, config=config)
    return out[:m, :n]
