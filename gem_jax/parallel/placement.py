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

Multi-host: each process builds only the chunks of its own devices
(`gem_jax.batch.LocalBatch`, `gem_jax.data.shard`), stacks them, and
`jax.make_array_from_process_local_data` assembles the global `[D, ...]` arrays. The
token capacity comes from the rows of every chunk of the global batch, which each
process knows from the examples' lengths, so all processes choose the same static
shape without communicating.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from gem_jax.batch import Batch, BatchShard, LocalBatch
from gem_jax.jagged import Jagged, TokenBuckets, pick_capacity
from gem_jax.mesh import live_axes
from gem_jax.parallel.rules import spec_from_axes


def stack_batch(batch: Batch, num_shards: int, buckets: TokenBuckets, *, fullest_rows: int | None = None) -> Batch:
    """Splits a host (numpy) batch into `num_shards` per-device jagged batches, stacked.

    Args:
      batch: B examples; history values `[T, F]` (any slack is dropped), offsets `[B+1]`.
      num_shards: devices D; must divide B.
      buckets: `T_local` is the smallest of `buckets.capacities(B/D)` that
        holds the fullest device's rows.
      fullest_rows: the rows of the fullest device of the whole global batch
        when `batch` is one process's part of it (`BatchPlacement.put_local`);
        None: the fullest of `batch`'s own D devices.

    Returns:
      A `Batch` whose leaves have a leading `[D]` axis: history values
      `[D, T_local, F]` (slack rows zero), offsets `[D, B/D + 1]` starting at 0,
      per-example arrays `[D, B/D, ...]`.

    Raises:
      ValueError: D does not divide B, or a device of `batch` has more rows
        than `fullest_rows`.
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
    fullest = int(np.diff(starts).max(initial=0))
    if fullest_rows is not None:
        if fullest > fullest_rows:
            raise ValueError(f"a device of this batch holds {fullest} history rows, more than the fullest device's {fullest_rows}")
        fullest = fullest_rows
    capacity = pick_capacity(fullest, buckets.capacities(per))
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
        user=jax.tree.map(split, batch.user),
        candidate_item=split(batch.candidate_item),
        candidate_features=jax.tree.map(split, batch.candidate_features),
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

    @functools.cached_property
    def shard(self) -> BatchShard:
        """The chunks of each global batch this process's devices hold (all of them in a single process)."""
        chunks = set()
        for index in self.sharding.addressable_devices_indices_map((self.num_shards,)).values():
            chunks.update(range(*index[0].indices(self.num_shards)))
        return BatchShard(self.num_shards, tuple(sorted(chunks)))

    def _assemble(self, stacked: Batch) -> Batch:
        """This process's stacked chunks `[len(shard.chunks), ...]` -> global `[D, ...]` arrays."""
        sharding = self.sharding
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x, (self.num_shards,) + x.shape[1:]), stacked)

    def abstract(self, batch: Batch, capacity: int) -> Batch:
        """The stacked `Batch` that `put` gives for a batch shaped like `batch`, at token capacity `capacity`,
        as `jax.ShapeDtypeStruct`s with `sharding`: history values `[D, capacity, F]`, the rest as `put`'s.

        For compiling a step ahead of time (`jax.jit(...).lower(...)`) for each capacity.
        `batch` is a whole global host batch (numpy leaves); only its shapes and dtypes count.
        """
        stacked = stack_batch(batch, self.num_shards, self.buckets)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=self.sharding), stacked)
        values = abstract.history.values
        values = jax.ShapeDtypeStruct((values.shape[0], capacity, *values.shape[2:]), values.dtype, sharding=values.sharding)
        return dataclasses.replace(abstract, history=abstract.history.replace_values(values))

    def put(self, batch: Batch) -> Batch:
        """Host `Batch` (the whole global batch, on every process) -> stacked `Batch` of global `jax.Array`s.

        Each process stacks every device's chunk and places its own devices' chunks.
        A training job uses `put_local`, which builds only those.
        """
        stacked = stack_batch(batch, self.num_shards, self.buckets)
        chunks = np.asarray(self.shard.chunks)
        return self._assemble(jax.tree.map(lambda x: x[chunks], stacked))

    def put_local(self, local: LocalBatch, capacity: int | None = None) -> Batch:
        """This process's part of a global batch -> stacked `Batch` of global `jax.Array`s on the mesh.

        Every process passes its own part of the same global batch: history values
        become `[D, T_local, F]` with one `T_local` for all processes (the smallest
        capacity holding the fullest chunk of the global batch, from `local.lengths`),
        offsets `[D, B/D + 1]`, per-example arrays `[D, B/D, ...]`; device d holds
        chunk d. With a whole shard the result equals `put(local.batch)`.

        `capacity` (one of the buckets' capacities, at least the fullest chunk's rows)
        places the batch at that `T_local` instead: every eval batch at one shape, so
        the eval step is one program.

        Raises:
          ValueError: `local.shard` is not this process's shard, or its batch
            does not hold the rows `local.lengths` gives its chunks.
          JaggedError: the fullest chunk exceeds every capacity.
        """
        if local.shard != self.shard:
            raise ValueError(f"a local batch of chunks {local.shard} was given to the process holding chunks {self.shard}")
        rows = local.chunk_rows()
        fullest = int(rows.max())
        if capacity is not None:
            if capacity < fullest or capacity not in self.buckets.capacities(local.global_batch_size // self.num_shards):
                raise ValueError(f"token capacity {capacity} is not a capacity of these buckets holding the fullest chunk's {fullest} rows")
            fullest = capacity
        stacked = stack_batch(local.batch, len(self.shard.chunks), self.buckets, fullest_rows=fullest)
        built = np.asarray(stacked.history.offsets)[:, -1]
        if not np.array_equal(built, rows[list(self.shard.chunks)]):
            raise ValueError(
                f"the local batch holds {built.tolist()} history rows in chunks {list(self.shard.chunks)}, "
                f"but the global batch's lengths give {rows[list(self.shard.chunks)].tolist()}"
            )
        return self._assemble(stacked)
