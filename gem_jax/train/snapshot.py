"""On-device snapshots of the train state for checkpoint saves that do not block the loop.

A snapshot is a copy of every array of the state into new device buffers with the same
shardings (a jitted copy, nothing donated): once it is dispatched, the next train step
may donate and overwrite the live state while the snapshot is copied to the host and
written in the background (CheckFreq's snapshot-then-persist, Mohan et al., FAST'21;
torchtitan's async checkpoint with staging). It costs the state's bytes once more on
each device until its device-to-host copy is done, so `fits` compares them with what
the steps leave free.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gem_jax.units import format_bytes


def device_bytes(tree: Any) -> dict[jax.Device, int]:
    """Bytes of `tree`'s arrays on each addressable device (from shapes, dtypes and shardings:
    works on `jax.Array`s and on `jax.ShapeDtypeStruct`s that carry a sharding)."""
    per_device: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        shard = math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        for device in leaf.sharding.addressable_devices:
            per_device[device] += shard
    return dict(per_device)


def fits(tree: Any) -> tuple[bool | None, str]:
    """Whether a snapshot of `tree` fits beside the steps on every addressable device, and the line saying why.

    Free is `bytes_limit - peak_bytes_in_use` of `device.memory_stats()`: what the
    largest step so far left unused (measure after the first steps). The line names the
    tightest device, its need and its free bytes.

    Returns:
      (True or False, line), or (None, line) when a device reports no memory statistics
      (the CPU): nothing to decide by.
    """
    tightest = None
    for device, need in device_bytes(tree).items():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats or "peak_bytes_in_use" not in stats:
            return None, f"{device} reports no memory statistics"
        free = stats["bytes_limit"] - stats["peak_bytes_in_use"]
        if tightest is None or free - need < tightest[2] - tightest[1]:
            tightest = (device, need, free)
    device, need, free = tightest
    line = f"a device copy of the state needs {format_bytes(need)} on {device}, {format_bytes(free)} free at the steps' peak"
    return need <= free, line


def copy_program(tree: Any) -> Callable[[Any], Any]:
    """The copy of `tree` (arrays or `jax.ShapeDtypeStruct`s with shardings), compiled now: takes a tree
    of the same structure, shapes, dtypes and shardings and returns it in new buffers, placed alike
    (nothing donated). The compiled executable itself (`jax.stages.Compiled`), so a call neither
    traces nor compiles again (a jitted function's first call would, after an ahead-of-time compile).

    Raises:
      TypeError or ValueError: a call with a tree that differs from `tree` (jax's messages).
    """
    shardings = jax.tree.map(lambda leaf: leaf.sharding, tree)
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings).lower(tree).compile()
