"""Pallas (Triton lowering) RMSNorm over rows of width d: one pass forward, one pass backward.

Forward: each program owns `rows` rows of `x [N, d]`, loads them whole in float32 and writes::

    inv = rsqrt(sum(x**2) / d + eps)                 # RMSNorm (Zhang & Sennrich, 2019)
    y = x * (inv * scale)

Backward: each of at most `BACKWARD_PROGRAMS` programs walks the row tiles `i, i + P, i + 2P, ...`
(P programs), recomputes `inv` from `x` and writes::

    xhat = x * inv;  gw = dy * scale
    dx = inv * (gw - xhat * mean(gw * xhat))  (+ dx_in, the cotangent of the input passed through)
    dscale_partial[program] = sum over its rows of dy * xhat

The partial scale gradients `[P, d]` float32 are summed by XLA (4 MB at d = 1024): a program per
row tile would write `N / rows` of them, 0.17 GB at the GEM step's 166,528 tokens, half a token
tensor. Equivalent jnp: `reference.rms_norm` and its `jax.vjp`; the kernels sum the mean square
(and `mean(gw * xhat)`, and the scale gradient) in another order than XLA, so results may differ
by an ulp of the output dtype. Rows past `N` are neither read nor written. The Triton lowering
is used because this is a memory-bound row kernel, as `pallas_kernels/qk_norm_rope/kernel.py`.
Triton addresses with 32-bit offsets: `kernel_takes` sends larger inputs, and inputs of no rows,
to the reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._src.row_tiles import tile_rows
from pallas_kernels._src.triton_call import triton_call

TILE = (4, 4)  # rows and warps of a program at widths up to 1024 (`default_tile`)
BACKWARD_PROGRAMS = 8 * 132  # eight per SM of an H100/H200; each sums its rows' scale gradients
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KERNEL_WIDTHS = tuple(2**k for k in range(4, 13))  # d from 16 to 4096, a power of two (Triton's block shapes)


def kernel_takes(shape: tuple[int, ...], dtype) -> bool:
    """Whether the kernels take `x` of `shape` (`[..., d]`) and `dtype`: bf16 or float32, d in `KERNEL_WIDTHS`,
    at least one row and fewer than 2**31 elements (32-bit offsets)."""
    return jnp.dtype(dtype) in KERNEL_DTYPES and len(shape) >= 1 and shape[-1] in KERNEL_WIDTHS and 0 < math.prod(shape) < 2**31


def default_tile(d: int) -> tuple[int, int]:
    """`TILE` at widths up to 1024; wider rows get more warps (d / 256), so each thread holds the same 32
    elements of a `[rows, d]` float32 tile (at d = 4096 four warps would hold 128 each: spilled registers).
    For the widths the kernels take (`KERNEL_WIDTHS`)."""
    return TILE[0], max(TILE[1], d // 256)


def _inv_rms(x, eps: float):
    """`rsqrt(mean square + eps)` of each row of `x [rows, d]` float32, `[rows, 1]`."""
    return lax.rsqrt(jnp.sum(x * x, axis=1) / x.shape[1] + eps)[:, None]


def _load(ref, tile, mask):
    return plt.load(ref.at[tile, :], mask=mask, other=0.0).astype(jnp.float32)


def _forward(x_ref, scale_ref, y_ref, *, t: int, eps: float, rows: int):
    """One program of the forward: its `rows` rows of `y_ref`. Operands as `forward`'s."""
    tile, mask = tile_rows(t, rows)
    x = _load(x_ref, tile, mask)
    y = x * (_inv_rms(x, eps) * scale_ref[...][None, :])
    plt.store(y_ref.at[tile, :], y.astype(y_ref.dtype), mask=mask)


def _backward(x_ref, scale_ref, dy_ref, *refs, t: int, eps: float, rows: int, programs: int, steps: int):
    """One program of the backward: `dx` of the row tiles `i + j * programs` (`j < steps`) and the program's row
    of partial scale gradients. `refs`: `(dx_in_ref, dx_ref, dscale_ref)` with a passed-through input's
    cotangent, else `(dx_ref, dscale_ref)`."""
    *dx_in, dx_ref, dscale_ref = refs
    i = pl.program_id(0)
    scale = scale_ref[...][None, :]
    d = x_ref.shape[1]

    def tile_step(j, acc):
        tile, mask = tile_rows(t, rows, i + j * programs)
        x, dy = _load(x_ref, tile, mask), _load(dy_ref, tile, mask)
        inv = _inv_rms(x, eps)
        xhat, gw = x * inv, dy * scale
        dx = inv * (gw - xhat * (jnp.sum(gw * xhat, axis=1) / d)[:, None])
        if dx_in:
            dx = dx + _load(dx_in[0], tile, mask)
        plt.store(dx_ref.at[tile, :], dx.astype(dx_ref.dtype), mask=mask)
        # Rows past t are read as zeros: their xhat is 0 * rsqrt(eps), NaN for eps = 0, so they are masked out.
        return acc + jnp.sum(jnp.where(mask, dy * xhat, 0.0), axis=0)

    dscale_ref[i, :] = lax.fori_loop(0, steps, tile_step, jnp.zeros((d,), jnp.float32))


def forward(x, scale, *, eps: float, dtype, tile: tuple[int, int], interpret: bool = False):
    """`y [N, d]` in `dtype` from `x [N, d]` (bf16 or float32) and `scale` float32 `[d]`, `tile` `(rows, warps)` of
    a program (`default_tile(d)` for the op). Inputs already checked by the op (N > 0), operands already of one
    manual-axis type (`manual_axes.match_axes`)."""
    t, _ = x.shape
    rows, warps = tile
    out = jax.ShapeDtypeStruct(x.shape, dtype, manual_axis_type=jax.typeof(x).manual_axis_type)
    body = functools.partial(_forward, t=t, eps=eps, rows=rows)
    return triton_call(body, (x, scale), out_shape=out, grid=(pl.cdiv(t, rows),), name="rms_norm_forward", interpret=interpret, num_warps=warps)


def backward(x, scale, dy, dx_in=None, *, eps: float, tile: tuple[int, int], programs: int = BACKWARD_PROGRAMS, interpret: bool = False):
    """`(dx [N, d]` in x's dtype, `dscale` float32 `[d])` from the forward's operands, the output cotangent `dy`
    (`[N, d]`) and, for an input passed through the op, its cotangent `dx_in` (`[N, d]`, x's dtype), added to
    `dx`; all of one manual-axis type. `programs`: at most this many programs, each over several row tiles."""
    t, d = x.shape
    rows, warps = tile
    tiles = pl.cdiv(t, rows)
    programs = min(programs, tiles)
    vary = jax.typeof(x).manual_axis_type
    out_shape = (
        jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=vary),
        jax.ShapeDtypeStruct((programs, d), jnp.float32, manual_axis_type=vary),
    )
    body = functools.partial(_backward, t=t, eps=eps, rows=rows, programs=programs, steps=pl.cdiv(tiles, programs))
    operands = (x, scale, dy) + (() if dx_in is None else (dx_in,))
    dx, partials = triton_call(body, operands, out_shape=out_shape, grid=(programs,), name="rms_norm_backward", interpret=interpret, num_warps=warps)
    return dx, jnp.sum(partials, axis=0)
