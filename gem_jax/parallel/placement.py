"""Data parallelism over jagged batches: one local jagged batch per device, stacked.

A global `Batch` of B examples is cut into D contiguous per-device batches of B/D
examples. Each keeps only its own history rows with offsets starting at 0 (local to the
device), packed into a common static capacity `T_local`: the smallest of the data set's
token buckets for B/D examples (`gem_jax.jagged.TokenBuckets`, sized from the real token
count, not B/D x max_seq_len) that holds the fullest device. This is the only place rows
are packed into a capacity: the data pipeline's batches hold no slack. Every leaf then gets a leading
device axis `[D, ...]` sharded over all mesh axes, and the model runs on one slice per
device under `shard_map` (`gem_jax.parallel.spmd`). Example order is kept: device d
holds global examples `d*B/D ... (d+1)*B/D - 1`, so a balanced per-device order from the
data pipeline (BBS) maps to devices as it was dealt.

Multi-host: every process builds the same global batch (the pipeline is deterministic)
and materialises only the slices of its own devices
(`jax.make_array_from_callback`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from gem_jax.batch import Batch
from gem_jax.jagged import Jagged, TokenBuckets, pick_capacity
from gem_jax.mesh import live_axes
from gem_jax.parallel.rules import spec_from_axes


def stack_batch(batch: Batch, num_shards: int, buckets: TokenBuckets) -> Batch:
    """Splits a host (numpy) batch into `num_shards` per-device jagged batches, stacked.

    Args:
      batch: B examples; history values `[T, F]` (any slack is dropped), offsets `[B+1]`.
      num_shards: devices D; must divide B.
      buckets: `T_local` is the smallest of `buckets.capacities(B/D)` that
        holds the fullest device's rows.

    Returns:
      A `Batch` whose leaves have a leading `[D]` axis: history values
      `[D, T_local, F]` (slack rows zero), offsets `[D, B/D + 1]` starting at 0,
      per-example arrays `[D, B/D, ...]`.

    Raises:
      ValueError: D does not divide B.
      JaggedError: a device's rows exceed every capacity (a history is longer
        than `buckets.max_seq_len`).
    """
    b = batch.batch_size
    if num_shards < 1 or b % num_shards:
        raise ValueError(f"batch size {b} is not divisible by {num_shards} devices")
    per = b // num_shards
    history = batch.history
    offsets = np.asarray(history.offsets)
    values = np.asarray(history.values)
    starts = offsets[: b + 1 : per]  # [D+1]: first row of each device's examples
    capacity = pick_capacity(int(np.diff(starts).max(initial=0)), buckets.capacities(per))
    local_values = np.zeros((num_shards, capacity) + values.shape[1:], values.dtype)
    local_offsets = np.empty((num_shards, per + 1), np.int32)
    for d in range(num_shards):
        lo, hi = int(starts[d]), int(starts[d + 1])
        local_values[d, : hi - lo] = values[lo:hi]
        local_offsets[d] = offsets[d * per : (d + 1) * per + 1] - lo

    def split(x):
        x = np.asarray(x)
        return x.reshape((num_shards, per) + x.shape[1:])

    return Batch(
        history=Jagged(local_values, local_offsets, history.max_seq_len),
        user=split(batch.user),
        candidate_item=split(batch.candidate_item),
        candidate_genres=split(batch.candidate_genres),
        labels=split(batch.labels),
        weights=split(batch.weights),
    )


@dataclasses.dataclass(frozen=True)
class BatchPlacement:
    """Puts host batches on a mesh in the stacked per-device layout.

    Attributes:
      mesh: the device mesh; the batch is split over all of its devices.
      buckets: the token capacities of each device's rows (`Dataset.token_buckets`).
    """

    mesh: Mesh
    buckets: TokenBuckets

    @property
    def num_shards(self) -> int:
        return self.mesh.devices.size

    @property
    def sharding(self) -> NamedSharding:
        """The sharding of every stacked-batch leaf (a prefix for the whole `Batch`)."""
        axes = live_axes(self.mesh)
        return NamedSharding(self.mesh, spec_from_axes(axes, 1))

    def put(self, batch: Batch) -> Batch:
        """Host `Batch` (global) -> stacked `Batch` of global `jax.Array`s on the mesh.

        Each process materialises only its addressable devices' slices.
        """
        stacked = stack_batch(batch, self.num_shards, self.buckets)
        sharding = self.sharding
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index]), stacked
        )
