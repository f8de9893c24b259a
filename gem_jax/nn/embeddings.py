"""Sharded embedding lookup: ids to their owners, rows back, gradients back (`shard_map` + all-to-all).

GEM's engineering description (Meta, 2025) names three generations of sparse-table
sharding; each table picks one (`TableSharding.generation`):

- `Generation.GLOBAL` (gen 1): rows sharded over every device. Each device buckets its
  ids by owner into a static `[S, C]` buffer, one all-to-all over all mesh axes sends
  them, owners gather their rows, a second all-to-all returns them.
- `Generation.GROUP` (gen 2): a full copy of the table per zone, rows sharded over the
  zone's devices (model-parallel inside the group, data-parallel across groups, as
  TorchRec's 2D sparse parallelism). The exchange stays inside the zone.
- `Generation.NODE_SPLIT` (gen 3): as gen 2, but the all-to-all runs between nodes
  only; inside the owning node the ids are all-gathered over its GPUs, each GPU
  looks up the rows of its slice of the node's shard, and a reduce-scatter returns the
  rows to the GPU that received the ids (TorchRec's table-row-wise `TwRw` pattern).
  The cross-node exchange has one peer per node instead of one per GPU; the price is
  NVLink traffic: the reduce-scatter carries `gpus_per_node` times the rows (the
  non-owners contribute zeros).
- `Generation.REPLICATED`: a data-parallel copy on every device (small tables); its
  gradient is all-reduced.

Replica consistency (gen 2 and 3). Replicas of a table shard in different zones stay
bit-identical by exchanging the *touched rows' gradients*: in the backward pass every
owner all-gathers, across zones, the (row, gradient) pairs it received and scatter-adds
all of them in the same order. Every replica therefore sees the same summed gradient
(the one single-device training computes) and applies the same optimizer update, with no
dense all-reduce of the table and no periodic weight averaging. The cost is one
all-gather over zones of the owner's receive buffer per step.

Static buffers and overflow. A device sends at most `C` ids to one owner. With
`capacity_factor=None`, `C` is the device's id count (the worst case: nothing can
overflow). With a factor, `C = ceil(factor * n / owners)`; the step counts the ids that
do not fit (`<table>/overflow`) and, when any device overflows, all devices redo the
lookup with worst-case buffers (a `lax.cond` on a global flag), so no id is dropped.

Out-of-range ids follow `OutOfRange` per table and are always counted
(`<table>/out_of_range`): ERROR (zero row, no gradient, and `check_lookup_stats` raises
on the host), ZERO (zero row, no gradient) or HASH (mapped into the vocabulary). Never
NaN (`jnp.take`'s fill), a clamp (`x[i]`) or a silent drop (`segment_sum`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.nn import shard_context as context
from gem_jax.mesh import GROUP_AXES, INTRA_NODE_AXES, MESH_AXES, NODE, ZONE, live_axes
from gem_jax.pytree import path_str

MAX_ROW_MULTIPLE = 1024


class Generation(enum.IntEnum):
    """Where a table's rows live (see the module docstring)."""

    REPLICATED = 0
    GLOBAL = 1
    GROUP = 2
    NODE_SPLIT = 3


class OutOfRange(enum.Enum):
    """What a lookup does with an id outside `[0, num_rows)`."""

    ERROR = "error"  # zero row, counted; the host raises (`check_lookup_stats`)
    ZERO = "zero"  # zero row and no gradient, counted
    HASH = "hash"  # hashed into [0, num_rows), counted


class EmbeddingLookupError(ValueError):
    """Out-of-range ids reached a table whose policy is `OutOfRange.ERROR`."""


@dataclasses.dataclass(frozen=True)
class TableSharding:
    """How one table is sharded and looked up.

    Attributes:
      generation: see `Generation`.
      out_of_range: see `OutOfRange`.
      capacity_factor: per-owner id buffer as a multiple of the balanced share
        (`n / owners`); None: the worst case (`n`), which cannot overflow.
    """

    generation: Generation = Generation.GLOBAL
    out_of_range: OutOfRange = OutOfRange.ERROR
    capacity_factor: float | None = None

    def __post_init__(self):
        if not isinstance(self.generation, Generation):
            raise TypeError(f"generation must be a Generation, got {self.generation!r}")
        if not isinstance(self.out_of_range, OutOfRange):
            raise TypeError(f"out_of_range must be an OutOfRange, got {self.out_of_range!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """A table's sharding resolved against a mesh (static; built by `place_table`).

    Attributes:
      name: the table's module path, e.g. "embed/item".
      num_rows: vocabulary size (valid ids are `[0, num_rows)`).
      padded_rows: rows of the parameter (`padded_table_rows(num_rows)`).
      generation: the effective generation (REPLICATED when the rows do not divide
        over the owners).
      out_of_range, capacity_factor: from `TableSharding`.
      axis_sizes: `(axis, size)` of every mesh axis, outermost first.
    """

    name: str
    num_rows: int
    padded_rows: int
    generation: Generation
    out_of_range: OutOfRange
    capacity_factor: float | None
    axis_sizes: tuple[tuple[str, int], ...]

    def live(self, axes) -> tuple[str, ...]:
        """`axes` without those of size 1."""
        return live_axes(self.axis_sizes, axes)

    @property
    def row_axes(self) -> tuple[str, ...]:
        """Mesh axes the rows are sharded over, outermost first (the parameter's spec)."""
        axes = {Generation.REPLICATED: (), Generation.GLOBAL: MESH_AXES}.get(self.generation, GROUP_AXES)
        return self.live(axes)

    @property
    def sync_axes(self) -> tuple[str, ...]:
        """Axes across which replicas exchange touched-row gradients (gen 2 and 3)."""
        return self.live((ZONE,)) if self.generation in (Generation.GROUP, Generation.NODE_SPLIT) else ()

    def size(self, axes) -> int:
        """Product of the sizes of `axes` on this placement's mesh (1 for none)."""
        sizes = dict(self.axis_sizes)
        return math.prod(sizes[a] for a in axes)

    @property
    def num_shards(self) -> int:
        return self.size(self.row_axes)

    @property
    def rows_per_shard(self) -> int:
        return self.padded_rows // self.num_shards


def padded_table_rows(num_rows: int) -> int:
    """Parameter rows of a table with `num_rows` ids: a multiple of `min(1024, bit_ceil(num_rows))`.

    The padding is independent of the mesh (checkpoints move between meshes), and the
    rows divide over any power-of-two number of owners up to that multiple. Padding
    rows are never looked up.

    Raises:
      ValueError: `num_rows < 1`.
    """
    if num_rows < 1:
        raise ValueError(f"a table needs at least one row, got {num_rows}")
    multiple = min(MAX_ROW_MULTIPLE, 1 << (num_rows - 1).bit_length())
    return -(-num_rows // multiple) * multiple


def place_table(name: str, num_rows: int, padded_rows: int, sharding: TableSharding, axis_sizes: dict[str, int]) -> TablePlacement:
    """Resolves `sharding` on a mesh with `axis_sizes`.

    Falls back to REPLICATED when the rows do not divide over the owners, or when
    there is a single owner.
    """
    placement = TablePlacement(
        name, num_rows, padded_rows, sharding.generation, sharding.out_of_range, sharding.capacity_factor, tuple(axis_sizes.items())
    )
    if placement.num_shards == 1 or padded_rows % placement.num_shards:
        placement = dataclasses.replace(placement, generation=Generation.REPLICATED)
    return placement


def _hash_ids(ids: jax.Array, num_rows: int) -> jax.Array:
    """int32 ids in [0, num_rows) from any int32 ids (lowbias32 integer hash, C. Wellons 2018)."""
    x = ids.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return (x % jnp.uint32(num_rows)).astype(jnp.int32)


def apply_id_policy(ids: jax.Array, num_rows: int, policy: OutOfRange) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Applies an out-of-range policy.

    Args:
      ids: int `[n]`.
      num_rows: vocabulary size.
      policy: see `OutOfRange`.

    Returns:
      `(ids, valid, num_bad)`: int32 ids (in range wherever `valid`), bool `[n]` rows
      to look up, int32 count of ids outside `[0, num_rows)`.
    """
    ids = ids.astype(jnp.int32)
    in_range = (ids >= 0) & (ids < num_rows)
    num_bad = jnp.sum(~in_range, dtype=jnp.int32)
    if policy is OutOfRange.HASH:
        return jnp.where(in_range, ids, _hash_ids(ids, num_rows)), jnp.ones_like(in_range), num_bad
    return jnp.where(in_range, ids, 0), in_range, num_bad


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _owner_rows(table: jax.Array, rows: jax.Array, sync_axes: tuple[str, ...]) -> jax.Array:
    """`table[rows]` with zeros where `rows < 0`; the backward syncs touched rows across `sync_axes`."""
    valid = rows >= 0
    return jnp.where(valid[..., None], table[jnp.where(valid, rows, 0)], 0)


def _owner_rows_fwd(table, rows, sync_axes):
    return _owner_rows(table, rows, sync_axes), (table, rows)


def _owner_rows_bwd(sync_axes, residuals, g):
    table, rows = residuals
    valid = rows >= 0
    idx = jnp.where(valid, rows, 0).reshape(-1)
    g = jnp.where(valid[..., None], g, 0).reshape(idx.shape[0], -1).astype(table.dtype)
    if sync_axes:
        # Every replica scatter-adds every zone's (row, gradient) pairs in the same order.
        idx = jax.lax.all_gather(idx, sync_axes, to="invarying").reshape(-1)
        g = jax.lax.all_gather(g, sync_axes, to="invarying").reshape(idx.shape[0], -1)
    return jnp.zeros_like(table).at[idx].add(g), None


_owner_rows.defvjp(_owner_rows_fwd, _owner_rows_bwd)


def _buckets(owner: jax.Array, num_owners: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Slot of each id in a `[num_owners, capacity]` send buffer.

    Args:
      owner: int32 `[n]` in `[0, num_owners]`; `num_owners` marks ids not to send.

    Returns:
      `(pos, fits, overflow)`: int32 `[n]` rank of each id among its owner's ids
      (arrival order), bool `[n]` sent (owner real and rank < capacity), int32 count
      of ids with a real owner that do not fit.
    """
    n = owner.shape[0]
    order = jnp.argsort(owner, stable=True)
    counts = jnp.zeros(num_owners + 1, jnp.int32).at[owner].add(1)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32) - starts[owner[order]])
    real = owner < num_owners
    overflow = jnp.sum(jnp.maximum(counts[:num_owners] - capacity, 0), dtype=jnp.int32)
    return pos, real & (pos < capacity), overflow


def _send_buffer(values: jax.Array, owner: jax.Array, pos: jax.Array, fits: jax.Array, num_owners: int, capacity: int) -> jax.Array:
    """int32 `[num_owners, capacity]`: `values[i]` at `(owner[i], pos[i])` for sent ids, -1 elsewhere."""
    o = jnp.where(fits, owner, num_owners)  # out of bounds: dropped by the scatter, never sent
    return jnp.full((num_owners, capacity), -1, jnp.int32).at[o, pos].set(values, mode="drop")


def _receive(back: jax.Array, owner: jax.Array, pos: jax.Array, fits: jax.Array) -> jax.Array:
    """Rows `[n, d]` of the sent ids from the returned `[owners, capacity, d]` buffer; zeros elsewhere."""
    o = jnp.minimum(owner, back.shape[0] - 1)
    p = jnp.minimum(pos, back.shape[1] - 1)
    return jnp.where(fits[:, None], back[o, p], 0)


def _flat_exchange(table, ids, valid, placement: TablePlacement, capacity: int, dtype):
    """Gen 1 / gen 2: one all-to-all over the row axes each way. Returns `(rows [n, d], overflow)`."""
    axes, owners, r = placement.row_axes, placement.num_shards, placement.rows_per_shard
    owner = jnp.where(valid, ids // r, owners)
    pos, fits, overflow = _buckets(owner, owners, capacity)
    send = _send_buffer(ids - jnp.minimum(owner, owners - 1) * r, owner, pos, fits, owners, capacity)
    recv = jax.lax.all_to_all(send, axes, 0, 0)
    back = jax.lax.all_to_all(_owner_rows(table, recv, placement.sync_axes).astype(dtype), axes, 0, 0)
    return _receive(back, owner, pos, fits), overflow


def _node_exchange(table, ids, valid, placement: TablePlacement, capacity: int, dtype):
    """Gen 3: all-to-all between nodes, all-gather / reduce-scatter inside the owning node."""
    node_axes = placement.live((NODE,))
    intra = placement.live(INTRA_NODE_AXES)
    nodes, per_node = placement.size(node_axes), placement.size(intra)
    r = placement.rows_per_shard
    owner = jnp.where(valid, ids // (r * per_node), nodes)
    pos, fits, overflow = _buckets(owner, nodes, capacity)
    send = _send_buffer(ids - jnp.minimum(owner, nodes - 1) * r * per_node, owner, pos, fits, nodes, capacity)
    recv = jax.lax.all_to_all(send, node_axes, 0, 0) if node_axes else send  # [nodes, C] for my node
    gathered = jax.lax.all_gather(recv, intra) if intra else recv[None]  # [per_node, nodes, C]
    local = gathered - (jax.lax.axis_index(intra) if intra else 0) * r
    mine = (gathered >= 0) & (local >= 0) & (local < r)
    rows = _owner_rows(table, jnp.where(mine, local, -1), placement.sync_axes).astype(dtype)  # zero where not mine
    part = jax.lax.psum_scatter(rows, intra) if intra else rows[0]  # [nodes, C, d]
    back = jax.lax.all_to_all(part, node_axes, 0, 0) if node_axes else part
    return _receive(back, owner, pos, fits), overflow


def _capacity(n: int, owners: int, factor: float | None) -> int:
    if factor is None:
        return n
    return max(1, min(n, math.ceil(factor * n / owners)))


def lookup(table: jax.Array, ids: jax.Array, num_rows: int, placement: TablePlacement | None, *, name: str = "table") -> jax.Array:
    """Embedding rows of `ids`.

    Outside a sharded step (`placement` None or REPLICATED) `table` is the whole
    parameter; inside one (`gem_jax.parallel.spmd`), it is this device's shard and the
    exchange of the module docstring runs over the named mesh axes. An unsharded
    table's lookup records its ids, and adds a row delta instead of differentiating
    `table`, when the active context carries `shard_context.TableRows`.

    Equivalent jnp (ids in range)::

        table[ids]

    Args:
      table: `[padded_rows, d]` or this device's `[padded_rows / shards, d]` shard.
      ids: int `[...]` this device's ids.
      num_rows: vocabulary size; ids outside `[0, num_rows)` follow the policy.
      placement: the resolved sharding; None: a local lookup with `OutOfRange.ERROR`.
      name: counter prefix when `placement` is None.

    Returns:
      `[..., d]` in table.dtype, or in the step's exchange dtype when rows cross the
      network; zero rows for ids the policy rejects.

    Raises:
      ValueError: a sharded placement used outside a sharded step.
    """
    policy = placement.out_of_range if placement is not None else OutOfRange.ERROR
    name = placement.name if placement is not None else name
    flat, valid, num_bad = apply_id_policy(ids.reshape(-1), num_rows, policy)
    context.record(f"{name}/out_of_range", num_bad)
    d = table.shape[-1]
    unsharded = placement is None or placement.generation is Generation.REPLICATED
    if unsharded or flat.shape[0] == 0:
        # Row gradients without a dense table gradient (`shard_context.TableRows`).
        delta = context.row_delta(name, jnp.where(valid, flat, table.shape[0])) if unsharded else None
        rows = table[flat] if delta is None else jax.lax.stop_gradient(table)[flat] + delta.astype(table.dtype)
        rows = jnp.where(valid[:, None], rows, 0)
        return rows.reshape(*ids.shape, d)
    ctx = context.active()
    if ctx is None:
        raise ValueError(f"table {name!r} is sharded ({placement.generation.name}); look it up inside the sharded step")
    exchange = _node_exchange if placement.generation is Generation.NODE_SPLIT else _flat_exchange
    owners = placement.size(placement.live((NODE,))) if placement.generation is Generation.NODE_SPLIT else placement.num_shards
    n = flat.shape[0]
    capacity = _capacity(n, owners, placement.capacity_factor)
    dtype = table.dtype if ctx.exchange_dtype is None else ctx.exchange_dtype
    rows, overflow = exchange(table, flat, valid, placement, capacity, dtype)
    if capacity < n:
        any_overflow = jax.lax.psum(overflow, placement.live(MESH_AXES)) > 0
        rows = jax.lax.cond(any_overflow, lambda: exchange(table, flat, valid, placement, n, dtype)[0], lambda: rows)
    context.record(f"{name}/overflow", overflow)
    return rows.reshape(*ids.shape, d)


def bind_tables(model: nnx.Module, placements: dict[str, TablePlacement]) -> None:
    """Sets `placement` on the embedding tables of `model` named by `placements` (module
    paths such as "embed/item", "embed/user/0"), so that their lookups run sharded."""
    for path, module in nnx.iter_modules(model):
        key = path_str(path)
        if key in placements:
            module.placement = placements[key]


def check_lookup_stats(metrics: dict, placements: dict[str, TablePlacement], *, where: str = "step") -> None:
    """Raises on out-of-range ids that reached an `OutOfRange.ERROR` table.

    Args:
      metrics: a step's (fetched) metrics; counters are `<table>/out_of_range`.
      placements: the tables' placements, by name.
      where: named in the message.

    Raises:
      EmbeddingLookupError: naming the table and the count.
    """
    for name, placement in placements.items():
        count = int(metrics.get(f"{name}/out_of_range", 0))
        if count and placement.out_of_range is OutOfRange.ERROR:
            raise EmbeddingLookupError(
                f"{where}: {count} ids outside [0, {placement.num_rows}) reached table {name!r} (policy ERROR)"
            )
