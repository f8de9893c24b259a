"""Pallas (Triton lowering) QK-norm + RoPE of a fused QKV projection: one pass forward, one backward.

Each program owns `rows` tokens of `qkv [T, 3*H*D]` (all heads; `TILE` gives the default rows and
warps). It loads the tile's RoPE cosines and sines `[rows, D/2]` once; then, for each head of q and
of k, the two halves of the head in float32, and computes in registers (`scale` the part's RMSNorm
scale)::

    inv = rsqrt(sum(x1**2 + x2**2) / D + eps)            # RMSNorm (Zhang & Sennrich, 2019)
    y1, y2 = x1 * (inv * scale1), x2 * (inv * scale2)
    out = (y1 cos - y2 sin, y2 cos + y1 sin)             # RoPE, rotate-half (Su et al., 2021)

and copies v's heads to a contiguous `[T, H*D]` output (the attention kernels' operand). The
backward reads the forward's input `qkv` (not the normalised values: `inv` is recomputed), the
output cotangents and the same tables, and writes `dqkv [T, 3*H*D]` whole (the v slot is a copy
of `dv`, so no concatenation pass follows) plus each program's partial scale gradients::

    g = (dy1 cos + dy2 sin, dy2 cos - dy1 sin)           # RoPE transposed
    xhat = x * inv;  gw = g * scale
    dx = inv * (gw - xhat * mean(gw * xhat))             # RMSNorm's input gradient
    dscale_partial[program] = sum over the tile's rows of (sum over its heads of g * xhat)

Equivalent jnp: `reference.qk_norm_rope` and its `jax.vjp`; the kernel sums the mean square
(and `mean(gw * xhat)`, and the scale gradients) in another order than XLA, so results may
differ by an ulp of the output dtype. The last row tile is masked: rows past `T` are neither
read nor written. The Triton lowering is used because this is a memory-bound row kernel, as
`pallas_kernels/mxfp8/kernel_quantize.py` (whose note on the backend's deprecation applies
here too). Triton addresses with 32-bit offsets: `kernel_takes` sends larger inputs, and inputs
of no tokens, to the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._src.row_tiles import tile_rows
from pallas_kernels._src.triton_call import triton_call

# Tokens per program, warps per program. On the H200 at 166,528 tokens (H=8, D=128) the forward takes
# 0.52 ms at 16x4, 32x4 and 16x8 alike; the backward at 32 rows is twice as slow (fwd+bwd 2.53 ms
# against 1.33 at 16x4; benchmarks/results/qk_norm_rope_h200.json).
TILE = (16, 4)
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)  # D/2 a power of two (Triton's block shapes); the range the tests run


def kernel_takes(shape: tuple[int, ...], dtype) -> bool:
    """Whether the kernels take `qkv [T, 3, H, D]` of `dtype`: bf16 or float32, D in `KERNEL_HEAD_DIMS`,
    at least one token and fewer than 2**31 elements (32-bit offsets)."""
    t, _, h, d = shape
    return jnp.dtype(dtype) in KERNEL_DTYPES and d in KERNEL_HEAD_DIMS and 0 < t * 3 * h * d < 2**31


def _halves(ref, rows, mask, col: int, half: int):
    """The two float32 halves `[rows, D/2]` of the head starting at column `col` (zero past `t`)."""
    load = lambda c: plt.load(ref.at[rows, pl.ds(c, half)], mask=mask, other=0.0).astype(jnp.float32)  # noqa: E731
    return load(col), load(col + half)


def _inv_rms(x1, x2, eps: float):
    """`rsqrt(mean square + eps)` of each row of the head `(x1, x2)`, `[rows, 1]` (one row sum)."""
    ms = jnp.sum(x1 * x1 + x2 * x2, axis=1) / (2 * x1.shape[1])
    return lax.rsqrt(ms + eps)[:, None]


def _copy_heads(src_ref, src_head: int, dst_ref, dst_head: int, rows, mask, heads: int, d: int):
    """Copies `heads` heads of `d` columns of the tile's rows, from head `src_head` on to head `dst_head` on."""
    for h in range(heads):
        x = plt.load(src_ref.at[rows, pl.ds((src_head + h) * d, d)], mask=mask, other=0.0)
        plt.store(dst_ref.at[rows, pl.ds((dst_head + h) * d, d)], x.astype(dst_ref.dtype), mask=mask)


def _forward(qkv_ref, scale_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, *, t: int, heads: int, eps: float, rows: int):
    """One program of the forward: normalises and rotates q's and k's heads of its `rows` tokens into `q_ref` and
    `k_ref` (`[T, H*D]`), and copies v's heads into `v_ref`. Operands as `forward`'s."""
    half = cos_ref.shape[1]
    tile, mask = tile_rows(t, rows)
    cos, sin = (plt.load(r.at[tile, :], mask=mask, other=0.0) for r in (cos_ref, sin_ref))
    for part, out_ref in enumerate((q_ref, k_ref)):
        s1, s2 = scale_ref[part, pl.ds(0, half)][None, :], scale_ref[part, pl.ds(half, half)][None, :]
        for h in range(heads):
            x1, x2 = _halves(qkv_ref, tile, mask, (part * heads + h) * 2 * half, half)
            inv = _inv_rms(x1, x2, eps)
            y1, y2 = x1 * (inv * s1), x2 * (inv * s2)
            col = h * 2 * half
            plt.store(out_ref.at[tile, pl.ds(col, half)], (y1 * cos - y2 * sin).astype(out_ref.dtype), mask=mask)
            plt.store(out_ref.at[tile, pl.ds(col + half, half)], (y2 * cos + y1 * sin).astype(out_ref.dtype), mask=mask)
    _copy_heads(qkv_ref, 2 * heads, v_ref, 0, tile, mask, heads, 2 * half)


def _backward(qkv_ref, scale_ref, cos_ref, sin_ref, dq_ref, dk_ref, dv_ref, dqkv_ref, dscale_ref, *, t: int, heads: int, eps: float, rows: int):
    """One program of the backward: writes its `rows` tokens of `dqkv_ref` (q's and k's slots from the cotangents
    `dq_ref`, `dk_ref` and the recomputed norm, v's a copy of `dv_ref`) and its row of partial scale gradients
    `dscale_ref [programs, 2*D]`. `g * xhat` is accumulated per row over the heads, `[rows, D/2]` a half,
    and summed over the rows once per half. Operands as `backward`'s."""
    half = cos_ref.shape[1]
    tile, mask = tile_rows(t, rows)
    cos, sin = (plt.load(r.at[tile, :], mask=mask, other=0.0) for r in (cos_ref, sin_ref))
    i = pl.program_id(0)
    for part, dy_ref in enumerate((dq_ref, dk_ref)):
        s1, s2 = scale_ref[part, pl.ds(0, half)][None, :], scale_ref[part, pl.ds(half, half)][None, :]
        acc1 = acc2 = jnp.zeros((rows, half), jnp.float32)  # g * xhat, summed over the heads (rows past t add 0)
        for h in range(heads):
            col = (part * heads + h) * 2 * half
            x1, x2 = _halves(qkv_ref, tile, mask, col, half)
            dy1, dy2 = _halves(dy_ref, tile, mask, h * 2 * half, half)
            inv = _inv_rms(x1, x2, eps)
            g1, g2 = dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin
            xh1, xh2 = x1 * inv, x2 * inv
            gw1, gw2 = g1 * s1, g2 * s2
            c = (jnp.sum(gw1 * xh1 + gw2 * xh2, axis=1) / (2 * half))[:, None]
            plt.store(dqkv_ref.at[tile, pl.ds(col, half)], (inv * (gw1 - xh1 * c)).astype(dqkv_ref.dtype), mask=mask)
            plt.store(dqkv_ref.at[tile, pl.ds(col + half, half)], (inv * (gw2 - xh2 * c)).astype(dqkv_ref.dtype), mask=mask)
            # Rows past t are read as zeros: their xhat is 0 * rsqrt(eps), NaN for eps = 0, so they are masked out.
            acc1, acc2 = acc1 + jnp.where(mask, g1 * xh1, 0.0), acc2 + jnp.where(mask, g2 * xh2, 0.0)
        dscale_ref[i, pl.ds(part * 2 * half, half)] = jnp.sum(acc1, axis=0)
        dscale_ref[i, pl.ds(part * 2 * half + half, half)] = jnp.sum(acc2, axis=0)
    _copy_heads(dv_ref, 0, dqkv_ref, 2 * heads, tile, mask, heads, 2 * half)  # v's cotangent into its slot


def forward(qkv, scales, cos, sin, *, heads: int, eps: float, dtype, tile=TILE, interpret: bool = False):
    """`(q, k, v)` `[T, H*D]` from `qkv [T, 3*H*D]` (bf16 or float32), `scales` float32 `[2, D]`
    (q's, k's) and `cos`/`sin` float32 `[T, D/2]`: q and k in `dtype`, v (copied in the same pass,
    a contiguous operand for the attention) in qkv's dtype. `tile`: `(rows, warps)` of a program.
    Inputs already checked by the op (T > 0), operands already of one manual-axis type (`manual_axes.match_axes`)."""
    t, width = qkv.shape
    rows, warps = tile
    vary = jax.typeof(qkv).manual_axis_type
    out = jax.ShapeDtypeStruct((t, width // 3), dtype, manual_axis_type=vary)
    v = jax.ShapeDtypeStruct((t, width // 3), qkv.dtype, manual_axis_type=vary)
    body = functools.partial(_forward, t=t, heads=heads, eps=eps, rows=rows)
    operands = (qkv, scales, cos, sin)
    return triton_call(body, operands, out_shape=(out, out, v), grid=(pl.cdiv(t, rows),), name="qk_norm_rope_forward", interpret=interpret, num_warps=warps)


def backward(qkv, scales, cos, sin, dq, dk, dv, *, heads: int, eps: float, tile=TILE, interpret: bool = False):
    """`(dqkv [T, 3*H*D]` in qkv's dtype, `dscales` float32 `[2, D])` from the forward's operands and
    the cotangents `dq`, `dk` (`[T, H*D]`, the forward's output dtype) and `dv` (`[T, H*D]`), all of
    one manual-axis type (the op's operands and their cotangents)."""
    t, width = qkv.shape
    d = scales.shape[1]
    rows, warps = tile
    vary = jax.typeof(qkv).manual_axis_type
    programs = pl.cdiv(t, rows)
    out_shape = (
        jax.ShapeDtypeStruct((t, width), qkv.dtype, manual_axis_type=vary),
        jax.ShapeDtypeStruct((programs, 2 * d), jnp.float32, manual_axis_type=vary),
    )
    body = functools.partial(_backward, t=t, heads=heads, eps=eps, rows=rows)
    operands = (qkv, scales, cos, sin, dq, dk, dv)
    dqkv, partials = triton_call(body, operands, out_shape=out_shape, grid=(programs,), name="qk_norm_rope_backward", interpret=interpret, num_warps=warps)
    return dqkv, jnp.sum(partials, axis=0).reshape(2, d)
