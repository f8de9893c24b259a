"""Mosaic GPU kernels under `jax.shard_map`: giving kernel results their operands' mesh-axis type.

Inside `shard_map` (with its default `check_vma=True`) every array is typed by
the manual mesh axes it varies over. `plgpu.kernel` traces its body with those
checks off and returns results typed as invariant, which breaks `custom_vjp`
(a cotangent must have its primal's type) and mixes badly with the operands.
The kernels' wrappers therefore make all operands vary over the same axes
(the transpose of that cast is the `psum` an invariant operand's gradient
needs) and cast each kernel result to those axes.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(*xs: jax.Array) -> tuple[str, ...]:
    """The manual mesh axes any of `xs` varies over (empty outside `shard_map`)."""
    axes: set[str] = set()
    for x in xs:
        axes |= set(jax.typeof(x).manual_axis_type.varying)
    return tuple(sorted(axes))


def to_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` typed as varying over `axes` (a no-op for axes it already varies over)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def match_axes(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """`xs`, each cast to vary over the axes any of them varies over (kernel operands share one type)."""
    axes = varying_axes(*xs)
    return tuple(to_varying(x, axes) for x in xs)


def gradient_of(partial: jax.Array, param: jax.Array) -> jax.Array:
    """The gradient of an operand `param` (of its dtype) from `partial`, its gradient summed over this
    device's part of the operands that vary over more manual axes (a kernel's per-device partial sum):
    `partial` summed over the axes those operands vary over and `param` does not (the transpose of
    casting `param` to vary over them, as `match_axes` casts it on the way in)."""
    axes = varying_axes(partial)
    _, transpose = jax.vjp(lambda p: to_varying(p, axes), param.astype(partial.dtype))
    (grad,) = transpose(partial)
    return grad.astype(param.dtype)


def call_kernel(kernel, *operands):
    """`kernel(*operands)` with every result cast to vary over the axes any operand varies over."""
    axes = varying_axes(*operands)
    return jax.tree.map(lambda out: to_varying(out, axes), kernel(*operands))
