"""Public op: RMSNorm over the last axis, as one kernel pass each way on Hopper."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels._src import dispatch, manual_axes, row_tiles
from pallas_kernels.rms_norm import kernel, reference

SUPPORT = dispatch.OpSupport(
    "rms_norm",
    kernel_dtypes=kernel.KERNEL_DTYPES,
    kernel_head_dims=kernel.KERNEL_WIDTHS,
    dim_name="width",
    reference_otherwise=True,
    size_limit="at least one row and under 2**31 elements",
)


def _check(x, scale, eps, dtype, return_input) -> None:
    """A ValueError naming what is wrong, for invalid inputs."""
    if jnp.ndim(x) < 1 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"rms_norm: x must be a floating array [..., d], got {jnp.shape(x)} {jnp.result_type(x)}")
    d = x.shape[-1]
    if jnp.shape(scale) != (d,) or not jnp.issubdtype(jnp.result_type(scale), jnp.floating):
        raise ValueError(f"rms_norm: scale must be a floating [{d}] (x's last axis), got {jnp.shape(scale)} {jnp.result_type(scale)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"rms_norm: eps must be a finite non-negative Python number (the kernels take it as a constant), got {eps!r}")
    if not isinstance(return_input, bool):
        raise ValueError(f"rms_norm: return_input must be True or False, got {return_input!r}")
    if dtype is not None and not dispatch.is_floating_dtype(dtype):
        raise ValueError(f"rms_norm: dtype must be a floating dtype (or None: x's and scale's promoted dtype), got {dtype!r}")


def rms_norm(
    x: jax.Array,
    scale: jax.Array,
    *,
    eps: float = 1e-6,
    dtype=None,
    return_input: bool = False,
    implementation: str | dispatch.Implementation | None = None,
    tile: tuple[int, int] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization") over the last axis.

    Equivalent jnp (flax's `nnx.RMSNorm(epsilon=eps, dtype=dtype)` op for op)::

        xf, sf = (a.astype(dtype).astype(float32) for a in (x, scale))    # flax's promote_dtype
        y = (xf * (rsqrt(mean(xf * xf, axis=-1, keepdims=True) + eps) * sf)).astype(dtype)

    The "xla" path is that composition (`reference.py`; values and autodiff gradients flax's bit for
    bit). The Pallas path (`kernel.py`, Triton lowering) normalises a tile of rows in one pass (x read
    once, y written once) and differentiates in one pass that recomputes the statistic from `x` (x
    and dy read once, dx written once; the scale gradient summed per program, then by XLA): its only
    residuals are `x` and `scale`. Its results may differ from the reference by an ulp of the output
    dtype (sums in another order). Each row is normalised on its own, so a NaN or Inf stays in its row,
    in `y` and in `dx`; the scale gradient sums every row, so it takes it up, as the reference's does.

    `return_input=True` also returns `x` itself, for the residual branch of a pre-norm block
    (`h = x + f(rms_norm(x))`): the cotangent of that returned `x` enters the norm's backward kernel,
    which adds it to `dx` in its own pass, where the two cotangents of `x` would otherwise be summed by
    an XLA pass of its own (reading both, writing the sum). Use it only when the returned `x` is used:
    an unused one has a zero cotangent, which the backward kernel then reads. When x is rounded to a
    narrower `dtype` first, the two cotangents are summed by XLA as without it.

    Args:
      x: floating `[..., d]`.
      scale: floating `[d]`, the gain (cast to `dtype`, then computed with in float32).
      eps: added to the mean square; a finite, non-negative Python number.
      dtype: dtype of the output (default: the promoted dtype of x and scale, as flax's).
      return_input: return `(y, x)` instead of `y` (above).
      implementation: "xla" (the jnp reference), "pallas" or None (pallas on a Hopper GPU). The
        kernels take bf16 and float32 x (after its cast to a narrower `dtype`) and `dtype`, with d a
        power of two from 16 to 4096
        (`kernel.KERNEL_WIDTHS`), at least one row and under 2**31 elements; other inputs (d = 1536,
        or no rows) run the reference under either name.
      tile: `(rows, warps)` of a kernel program, both powers of two (default `kernel.default_tile(d)`:
        4 rows, 4 warps up to d = 1024 and d / 256 warps past it); the results do not depend on it
        beyond the order of the scale gradient's sums.

    Returns:
      `y`, `[..., d]` in `dtype`; with `return_input`, `(y, x)`.

    Raises:
      ValueError: a non-floating or 0-d x, scale not a floating `[d]`, eps not a finite non-negative
        number, a non-floating dtype, a `tile` not of powers of two, or an unknown implementation name.
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside interpret mode).
    """
    _check(x, scale, eps, dtype, return_input)
    d = x.shape[-1]
    if tile is not None:
        tile = row_tiles.check_tile("rms_norm", tile)
    dtype = jnp.dtype(jnp.result_type(x, scale) if dtype is None else dtype)
    # x in `dtype` first, as flax's promote_dtype: rounded when `dtype` is narrower (a float32 x of a bf16 norm);
    # a wider `dtype` (a bf16 x of a float32 norm) changes no value, and the kernels widen x as they load it.
    x_in = x if jnp.promote_types(x.dtype, dtype) == dtype else x.astype(dtype)
    impl = dispatch.choose(SUPPORT, implementation, [x_in.dtype], d).implementation
    if impl is not dispatch.Implementation.PALLAS or not kernel.kernel_takes(x.shape, x_in.dtype) or dtype not in kernel.KERNEL_DTYPES:
        y = reference.rms_norm(x, scale, eps, dtype)
        return (y, x) if return_input else y
    # The scale in `dtype` too (a bf16 norm uses a bf16-rounded gain, and its gradient is rounded to bf16 on the way
    # back). Under shard_map both operands vary over the same manual axes before the custom VJP (the cast's
    # transpose sums an invariant scale's gradient over the axes).
    rows, scale32 = manual_axes.match_axes(x_in.reshape(-1, d), scale.astype(dtype).astype(jnp.float32))
    tile = kernel.default_tile(d) if tile is None else tile
    through = return_input and x_in is x  # the input passed through the kernels (not when it was rounded first)
    out = _fused(rows, scale32, float(eps), dtype, tile, dispatch.interpreting(), through)
    if through:
        return out[0].reshape(x.shape), out[1].reshape(x.shape)
    return (out.reshape(x.shape), x) if return_input else out.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _fused(x, scale, eps, dtype, tile, interpret, return_input):
    """`y [N, d]` of `x [N, d]`; with `return_input`, `(y, x)`: x passed through unchanged, its cotangent added to
    `dx` inside the backward kernel."""
    y = kernel.forward(x, scale, eps=eps, dtype=dtype, tile=tile, interpret=interpret)
    return (y, x) if return_input else y


def _fused_fwd(x, scale, eps, dtype, tile, interpret, return_input):
    return _fused(x, scale, eps, dtype, tile, interpret, return_input), (x, scale)


def _fused_bwd(eps, dtype, tile, interpret, return_input, residuals, cotangents):
    x, scale = residuals
    dy, dx_in = cotangents if return_input else (cotangents, None)
    return kernel.backward(x, scale, dy, dx_in, eps=eps, tile=tile, interpret=interpret)


_fused.defvjp(_fused_fwd, _fused_bwd)


def rms_norm_backward(
    x: jax.Array,
    scale: jax.Array,
    dy: jax.Array,
    dx_in: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    implementation: str | dispatch.Implementation | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The backward of a float32 RMSNorm whose forward ran elsewhere (fused into another pass, e.g. an FP8
    quantization: `pallas_kernels.mxfp8`'s RMSNorm prologue): `(dx, dscale)`.

    Equivalent jnp, for `y = x * rsqrt(mean(x**2, -1) + eps) * scale` computed in float32::

        _, vjp = jax.vjp(y, x.astype(float32), scale.astype(float32))
        dx32, dscale = vjp(dy.astype(float32))
        dx = (dx32 + dx_in.astype(x.dtype).astype(float32)).astype(x.dtype)   # without dx_in: dx32.astype(x.dtype)
        dscale = dscale.astype(scale.dtype)

    The Pallas path is `rms_norm`'s backward kernel: one pass that recomputes the statistic from `x`,
    reads `dy` (and `dx_in`, the cotangent of an input passed through, added in float32 before the
    rounding) and writes `dx`, where XLA runs the composition as several passes (the row sums, the
    scale's column sums, dx). Its sums run in another order: results may differ by an ulp of x.dtype.
    Sources: RMSNorm, Zhang & Sennrich (2019); the norm's backward beside an FP8 cast of its output,
    as Transformer Engine's LayerNormLinear runs it.

    Args:
      x: floating `[..., d]`, the norm's input.
      scale: floating `[d]`, the gain the forward multiplied by (its values, widened to float32).
      dy: floating `[..., d]`, the cotangent of the norm's float32 output.
      dx_in: floating `[..., d]` or None, a cotangent to add to `dx` (rounded to x.dtype first, on both paths).
      eps: added to the mean square; a finite, non-negative Python number.
      implementation: as `rms_norm`'s (the kernel for bf16 and float32 x of the widths it takes).

    Returns:
      `dx` in x.dtype, `[..., d]`, and `dscale` in scale's dtype, `[d]`.

    Raises:
      ValueError: as `rms_norm`, or `dy` or `dx_in` not of x's shape.
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside interpret mode).
    """
    _check(x, scale, eps, None, False)
    for name, cotangent in (("dy", dy), ("dx_in", dx_in)):
        if cotangent is not None and jnp.shape(cotangent) != x.shape:
            raise ValueError(f"rms_norm_backward: {name} must have x's shape {x.shape}, got {jnp.shape(cotangent)}")
    d = x.shape[-1]
    impl = dispatch.choose(SUPPORT, implementation, [x.dtype], d).implementation
    if impl is dispatch.Implementation.PALLAS and kernel.kernel_takes(x.shape, x.dtype):
        cotangents = [dy] if dx_in is None else [dy, dx_in.astype(x.dtype)]
        x_rows, *cotangents, scale32 = manual_axes.match_axes(*(a.reshape(-1, d) for a in [x, *cotangents]), scale.astype(jnp.float32))
        dx, partial = kernel.backward(x_rows, scale32, *cotangents, eps=float(eps), tile=kernel.default_tile(d), interpret=dispatch.interpreting())
        return dx.reshape(x.shape), manual_axes.gradient_of(partial, scale)
    norm = lambda xf, sf: reference.rms_norm(xf, sf, eps, jnp.float32)
    _, vjp = jax.vjp(norm, x.astype(jnp.float32), scale.astype(jnp.float32))
    dx, dscale = vjp(dy.astype(jnp.float32))
    if dx_in is not None:
        dx = dx + dx_in.astype(x.dtype).astype(jnp.float32)
    return dx.astype(x.dtype), dscale.astype(scale.dtype)
