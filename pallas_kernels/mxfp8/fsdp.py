"""Quantize FSDP weight shards before the all-gather, so 8-bit data crosses the network.

Two callers: a jitted program over a mesh, whose weight is a global array sharded over
the FSDP axes (the gather runs in a `shard_map` over those axes), and code already
inside a `shard_map` over them (a sharded train step), whose weight is this device's
shard (the gather is a plain collective over the manual axes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from pallas_kernels.mxfp8.ops import quantize_mxfp8


def _axes(axis_name) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _inside_shard_map(axes: tuple[str, ...]) -> bool:
    """Whether the current trace is inside a `shard_map` whose manual axes include `axes`."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and all(a in mesh.manual_axes for a in axes)


def gathered_extent(w: jax.Array, *, axis_name: str | tuple[str, ...], dim: int = 0) -> int:
    """The size along `dim` of the whole weight whose shard `w` is, as `quantize_gathered` gathers it.

    Inside a `shard_map` over `axis_name` `w` is one device's shard: `w.shape[dim]` times
    the product of the axes' sizes. Outside, `w` is the whole (global) array: `w.shape[dim]`.

    Args:
      w: `[R, C]` weight or weight shard.
      axis_name, dim: as given to `quantize_gathered`.

    Returns:
      The gathered size along `dim` (rows for dim 0, columns for dim 1).
    """
    axes = _axes(axis_name)
    shards = math.prod(lax.axis_size(a) for a in axes) if _inside_shard_map(axes) else 1
    return w.shape[dim] * shards


def local_part(v: jax.Array, *, axis_name: str | tuple[str, ...], size: int) -> jax.Array:
    """This device's `size` entries of `v [gathered extent]`, a vector laid out along the gathered dimension.

    Inside a `shard_map` over `axis_name`, `quantize_gathered` concatenates the shards with the
    outermost axis first; device `i` (its index over `axis_name`) holds entries
    `[i * size, (i + 1) * size)`. E.g. the slice of the per-row Hadamard signs that a row shard
    of a kernel needs.
    """
    return lax.dynamic_slice_in_dim(v, lax.axis_index(_axes(axis_name)) * size, size)


def _gather_bytes(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """All-gather an 8-bit float array as uint8 (no reliance on FP8 collectives) and bitcast back."""
    gathered = lax.all_gather(lax.bitcast_convert_type(x, jnp.uint8), axes, axis=dim, tiled=True, to="invarying")
    return lax.bitcast_convert_type(gathered, x.dtype)


def quantize_gathered(
    w: jax.Array, *, axis_name: str | tuple[str, ...], dim: int = 0, block=(32, 32), mesh=None
) -> tuple[jax.Array, jax.Array]:
    """`quantize_mxfp8(w)` computed as quantize-on-shard, then all-gather of data and scales.

    Each device quantizes its own shard of `w` (sharded along `dim` over the mesh axes
    `axis_name`), then the FP8 data (1 byte/element) and E8M0 scales are all-gathered:
    a quarter of the bytes of an f32 gather, half of bf16 (GEM: weights quantized on
    the local shard before the FSDP all-gather). When shard boundaries fall on block
    boundaries the result is bit-identical to gathering first and quantizing after.

    Equivalent jnp::

        quantize_mxfp8(w, block=block)          # on the gathered w

    Args:
      w: `[R, C]` weight, sharded (or to be sharded) along `dim` over `axis_name`; inside
        a `shard_map` over `axis_name`, this device's shard (the gathered result is
        `R` or `C` times the axes' size).
      axis_name: the FSDP mesh axis, or axes (outermost first, as a `PartitionSpec` entry).
      dim: the dimension of `w` that is sharded (0 or 1).
      block: quantization block; each shard's extent along `dim` must be a multiple of `block[dim]`.
      mesh: the mesh; None uses the context mesh (`jax.set_mesh`, or the enclosing `shard_map`).

    Returns:
      `(data, scales)` replicated over `axis_name`, as `quantize_mxfp8` of the whole weight.

    Raises:
      ValueError: no mesh, unknown axis, or shards that do not align with the blocks.
    """
    axes = _axes(axis_name)
    if w.ndim != 2 or dim not in (0, 1):
        raise ValueError(f"w must be 2-D and dim 0 or 1; got shape {w.shape}, dim={dim}")
    if _inside_shard_map(axes):
        if w.shape[dim] % block[dim]:
            raise ValueError(
                f"the shard of w along dim {dim} has {w.shape[dim]} rows, not a multiple of block {block[dim]}: "
                "every shard must hold whole quantization blocks"
            )
        data, scales = quantize_mxfp8(w, block=block)
        return _gather_bytes(data, axes, dim), _gather_bytes(scales, axes, dim)
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("quantize_gathered needs a mesh: pass mesh= or call it under jax.set_mesh(...)")
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"axis {unknown[0]!r} is not a mesh axis {mesh.axis_names}")
    shards = math.prod(mesh.shape[a] for a in axes)
    if w.shape[dim] % (shards * block[dim]):
        raise ValueError(
            f"w.shape[{dim}]={w.shape[dim]} must be a multiple of {shards} shards x block {block[dim]} "
            "so that every shard holds whole quantization blocks"
        )
    entry = axes[0] if len(axes) == 1 else axes
    spec = PartitionSpec(*(entry if d == dim else None for d in range(2)))

    def local(shard):
        data, scales = quantize_mxfp8(shard, block=block)
        return _gather_bytes(data, axes, dim), _gather_bytes(scales, axes, dim)

    return jax.shard_map(
        local, mesh=mesh, in_specs=spec, out_specs=(PartitionSpec(), PartitionSpec()), axis_names=set(axes)
    )(w)


def shard_gradient(dw: jax.Array, *, axis_name: str | tuple[str, ...], dim: int = 0) -> jax.Array:
    """The gradient of a weight shard from the gradient of the gathered weight (the gather's transpose).

    Inside a `shard_map` over `axis_name`, where `quantize_gathered` gathered the shard,
    each device's `dw` is its contribution to the whole weight's gradient: the shard's
    gradient is their sum, scattered along `dim` (a reduce-scatter, in `dw`'s dtype).
    Outside, `dw` is already the global array's gradient and is returned unchanged.

    Args:
      dw: `[R, C]` gradient of the gathered weight.
      axis_name, dim: as given to `quantize_gathered`.

    Returns:
      `dw`'s shard along `dim` summed over `axis_name` inside a `shard_map`; `dw` outside.
    """
    axes = _axes(axis_name)
    if not _inside_shard_map(axes):
        return dw
    return lax.psum_scatter(dw, axes, scatter_dimension=dim, tiled=True)
