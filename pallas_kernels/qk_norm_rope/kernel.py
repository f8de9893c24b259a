"""Pallas (Triton lowering) QK-norm + RoPE of a fused QKV projection: one pass forward, one backward.

Each program owns `ROWS` tokens of `qkv [T, 3*H*D]` (all heads). It loads the tile's RoPE
cosines and sines `[ROWS, D/2]` once; then, for each head of q and of k, the two halves of the
head in float32, and computes in registers (`scale` the part's RMSNorm scale)::

    inv = rsqrt((sum(x1**2) + sum(x2**2)) / D + eps)     # RMSNorm (Zhang & Sennrich, 2019)
    y1, y2 = x1 * (inv * scale1), x2 * (inv * scale2)
    out = (y1 cos - y2 sin, y2 cos + y1 sin)             # RoPE, rotate-half (Su et al., 2021)

and copies v's heads to a contiguous `[T, H*D]` output (the attention kernels' operand). The
backward reads the forward's input `qkv` (not the normalised values: `inv` is recomputed), the
output cotangents and the same tables, and writes `dqkv [T, 3*H*D]` whole (the v slot is a copy
of `dv`, so no concatenation pass follows) plus each program's partial scale gradients::

    g = (dy1 cos + dy2 sin, dy2 cos - dy1 sin)           # RoPE transposed
    xhat = x * inv;  gw = g * scale
    dx = inv * (gw - xhat * mean(gw * xhat))             # RMSNorm's input gradient
    dscale_partial[program] = sum over the tile's rows and heads of g * xhat

Equivalent jnp: `reference.qk_norm_rope` and its `jax.vjp`; the kernel sums the mean square
(and `mean(gw * xhat)`, and the scale gradients) in another order than XLA, so results may
differ by an ulp of the output dtype. The last row tile is masked: rows past `T` are neither
read nor written. The Triton lowering is used because this is a memory-bound row kernel, as
`pallas_kernels/mxfp8/kernel_quantize.py` (whose note on the backend's deprecation applies
here too). Triton addresses with 32-bit offsets: `kernel_takes` sends larger inputs elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt

from pallas_kernels._src import manual_axes

ROWS = 32  # tokens per program
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KERNEL_HEAD_DIMS = tuple(2**i for i in range(1, 11))  # D/2 a power of two: Triton's block shapes


def kernel_takes(shape: tuple[int, ...], dtype) -> bool:
    """Whether the kernels take `qkv [T, 3, H, D]` of `dtype`: bf16 or float32, D in
    `KERNEL_HEAD_DIMS`, fewer than 2**31 elements (32-bit offsets)."""
    t, _, h, d = shape
    return jnp.dtype(dtype) in KERNEL_DTYPES and d in KERNEL_HEAD_DIMS and t * 3 * h * d < 2**31


def _tile(t: int):
    """The program's rows and the mask of those before `t`."""
    i = pl.program_id(0)
    valid = i * ROWS + lax.broadcasted_iota(jnp.int32, (ROWS,), 0) < t
    return pl.ds(i * ROWS, ROWS), valid[:, None]


def _halves(ref, rows, mask, col: int, half: int):
    """The two float32 halves `[ROWS, D/2]` of the head starting at column `col` (zero past `t`)."""
    load = lambda c: plt.load(ref.at[rows, pl.ds(c, half)], mask=mask, other=0.0).astype(jnp.float32)  # noqa: E731
    return load(col), load(col + half)


def _inv_rms(x1, x2, eps: float):
    ms = (jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / (2 * x1.shape[1])
    return lax.rsqrt(ms + eps)[:, None]


def _copy_heads(src_ref, src_head: int, dst_ref, dst_head: int, rows, mask, heads: int, d: int):
    """Copies `heads` heads of `d` columns of the tile's rows, from head `src_head` on to head `dst_head` on."""
    for h in range(heads):
        x = plt.load(src_ref.at[rows, pl.ds((src_head + h) * d, d)], mask=mask, other=0.0)
        plt.store(dst_ref.at[rows, pl.ds((dst_head + h) * d, d)], x.astype(dst_ref.dtype), mask=mask)


def _forward(qkv_ref, scale_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, *, t: int, heads: int, eps: float):
    half = cos_ref.shape[1]
    rows, mask = _tile(t)
    cos, sin = (plt.load(r.at[rows, :], mask=mask, other=0.0) for r in (cos_ref, sin_ref))
    for part, out_ref in enumerate((q_ref, k_ref)):
        s1, s2 = scale_ref[part, pl.ds(0, half)][None, :], scale_ref[part, pl.ds(half, half)][None, :]
        for h in range(heads):
            x1, x2 = _halves(qkv_ref, rows, mask, (part * heads + h) * 2 * half, half)
            inv = _inv_rms(x1, x2, eps)
            y1, y2 = x1 * (inv * s1), x2 * (inv * s2)
            col = h * 2 * half
            plt.store(out_ref.at[rows, pl.ds(col, half)], (y1 * cos - y2 * sin).astype(out_ref.dtype), mask=mask)
            plt.store(out_ref.at[rows, pl.ds(col + half, half)], (y2 * cos + y1 * sin).astype(out_ref.dtype), mask=mask)
    _copy_heads(qkv_ref, 2 * heads, v_ref, 0, rows, mask, heads, 2 * half)


def _backward(qkv_ref, scale_ref, cos_ref, sin_ref, dq_ref, dk_ref, dv_ref, dqkv_ref, dscale_ref, *, t: int, heads: int, eps: float):
    half = cos_ref.shape[1]
    rows, mask = _tile(t)
    cos, sin = (plt.load(r.at[rows, :], mask=mask, other=0.0) for r in (cos_ref, sin_ref))
    for part, dy_ref in enumerate((dq_ref, dk_ref)):
        s1, s2 = scale_ref[part, pl.ds(0, half)][None, :], scale_ref[part, pl.ds(half, half)][None, :]
        ds1 = ds2 = jnp.zeros((half,), jnp.float32)
        for h in range(heads):
            col = (part * heads + h) * 2 * half
            x1, x2 = _halves(qkv_ref, rows, mask, col, half)
            dy1, dy2 = _halves(dy_ref, rows, mask, h * 2 * half, half)
            inv = _inv_rms(x1, x2, eps)
            g1, g2 = dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin
            xh1, xh2 = x1 * inv, x2 * inv
            gw1, gw2 = g1 * s1, g2 * s2
            c = ((jnp.sum(gw1 * xh1, axis=1) + jnp.sum(gw2 * xh2, axis=1)) / (2 * half))[:, None]
            plt.store(dqkv_ref.at[rows, pl.ds(col, half)], (inv * (gw1 - xh1 * c)).astype(dqkv_ref.dtype), mask=mask)
            plt.store(dqkv_ref.at[rows, pl.ds(col + half, half)], (inv * (gw2 - xh2 * c)).astype(dqkv_ref.dtype), mask=mask)
            ds1, ds2 = ds1 + jnp.sum(g1 * xh1, axis=0), ds2 + jnp.sum(g2 * xh2, axis=0)
        i = pl.program_id(0)
        dscale_ref[i, pl.ds(part * 2 * half, half)] = ds1
        dscale_ref[i, pl.ds(part * 2 * half + half, half)] = ds2
    _copy_heads(dv_ref, 0, dqkv_ref, 2 * heads, rows, mask, heads, 2 * half)  # v's cotangent into its slot


def _call(body, name: str, operands, out_shape, t: int, interpret: bool):
    # The tests' Mosaic GPU simulator does not run Triton-lowered kernels: they use the generic
    # interpreter (pallas_call reads the simulator's context when it is built).
    with plgpu.force_gpu_interpret_mode(None):
        return pl.pallas_call(
            body,
            out_shape=out_shape,
            grid=(pl.cdiv(t, ROWS),),
            compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
            interpret=interpret,
            name=name,
        )(*operands)


def forward(qkv, scales, cos, sin, *, heads: int, eps: float, dtype, interpret: bool = False):
    """`(q, k, v)` `[T, H*D]` from `qkv [T, 3*H*D]` (bf16 or float32), `scales` float32 `[2, D]`
    (q's, k's) and `cos`/`sin` float32 `[T, D/2]`: q and k in `dtype`, v (copied in the same pass,
    a contiguous operand for the attention) in qkv's dtype. Inputs already checked by the op."""
    t, width = qkv.shape
    operands = manual_axes.match_axes(qkv, scales, cos, sin)
    vary = jax.typeof(operands[0]).manual_axis_type
    out = jax.ShapeDtypeStruct((t, width // 3), dtype, manual_axis_type=vary)
    v = jax.ShapeDtypeStruct((t, width // 3), qkv.dtype, manual_axis_type=vary)
    if t == 0:
        return jnp.zeros(out.shape, dtype), jnp.zeros(out.shape, dtype), jnp.zeros(v.shape, v.dtype)
    body = functools.partial(_forward, t=t, heads=heads, eps=eps)
    return _call(body, "qk_norm_rope_forward", operands, (out, out, v), t, interpret)


def backward(qkv, scales, cos, sin, dq, dk, dv, *, heads: int, eps: float, interpret: bool = False):
    """`(dqkv [T, 3*H*D]` in qkv's dtype, `dscales` float32 `[2, D])` from the forward's operands and
    the cotangents `dq`, `dk` (`[T, H*D]`, the forward's output dtype) and `dv` (`[T, H*D]`)."""
    t, width = qkv.shape
    d = scales.shape[1]
    operands = manual_axes.match_axes(qkv, scales, cos, sin, dq, dk, dv)
    vary = jax.typeof(operands[0]).manual_axis_type
    if t == 0:
        return jnp.zeros((t, width), qkv.dtype), jnp.zeros((2, d), jnp.float32)
    out_shape = (
        jax.ShapeDtypeStruct((t, width), qkv.dtype, manual_axis_type=vary),
        jax.ShapeDtypeStruct((pl.cdiv(t, ROWS), 2 * d), jnp.float32, manual_axis_type=vary),
    )
    body = functools.partial(_backward, t=t, heads=heads, eps=eps)
    dqkv, partials = _call(body, "qk_norm_rope_backward", operands, out_shape, t, interpret)
    return dqkv, jnp.sum(partials, axis=0).reshape(2, d)
