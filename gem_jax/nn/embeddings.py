"""Sharded embedding lookup: ids to their owners, rows back, gradients back (`shard_map` + all-to-all).

GEM's engineering description (Meta, 2025) names three generations of sparse-table
sharding; each table picks one (`TableSharding.generation`):

- `Generation.GLOBAL` (gen 1): rows sharded over every device. Each device buckets its
  ids by owner into a static `[owners, C]` buffer, one all-to-all over all mesh axes
  sends them, owners gather their rows, a second all-to-all returns them.
- `Generation.GROUP` (gen 2): a full copy of the table per zone, rows sharded over the
  zone's devices (model-parallel inside the group, data-parallel across groups, as
  TorchRec's 2D sparse parallelism). The exchange stays inside the zone.
- `Generation.NODE_SPLIT` (gen 3): rows as gen 2, but each all-to-all runs in two hops
  (the hierarchical all-to-all of Tutel, Hwang et al. 2023, and DeepSpeed-MoE,
  Rajbhandari et al. 2022): between nodes, each GPU with the same GPU of every other
  node, then inside the node over NVLink to the GPU that owns the row. The cross-node
  exchange has one peer per node instead of one per GPU, in blocks `gpus_per_node`
  times larger; every buffer stays the size of gen 2's (TorchRec's table-row-wise
  all-gather / reduce-scatter inside the node would need `gpus_per_node` times the
  rows, mostly zeros).
- `Generation.REPLICATED`: a data-parallel copy on every device (small tables); its
  gradient is all-reduced.

Which ids travel. Only real ids leave a device: rows the caller masks out (a jagged
batch's slack rows) get zero rows, no gradient and no count, and the padding id
`PAD_ID` (0, frequent: absent features, padding examples) is served locally from one
copy of its row per lookup, a `psum` of the owner's row over the row axes (its
gradient, the sum over every device, returns to the owners by the transpose).

Replica consistency (gen 2 and 3). Replicas of a table shard in different zones stay
bit-identical by exchanging the *touched rows' gradients*: in the backward pass every
owner all-gathers, across zones, the (row, gradient) pairs it received (gradients in
the exchange dtype) and scatter-adds all of them in the same order. Every replica
therefore sees the same summed gradient (the one single-device training computes) and
applies the same optimizer update, with no dense all-reduce of the table and no
periodic weight averaging. The cost is one all-gather over zones of the owner's
receive buffer per step.

Static buffers and rounds. A device sends at most `C` ids to one owner per round. With
`capacity_factor=None`, `C` is the device's id count `n` (the worst case: one round,
buffers of `owners x n` rows). With a factor, `C = ceil(factor * (m + 4 sqrt(m)))` for
the balanced share `m = n / owners` (the margin covers the spread of uniform ids, which
matters in small lookups; factor 1 fits uniform ids, more leaves room for skew): ids
past an owner's `C` wait for the next round, which reuses the same buffers (a
`lax.scan` over the possible rounds, each skipped by `lax.cond` once every device is
served; the rounds run only when some device overflows), so memory stays bounded and
no id is dropped. Counters per table, summed over devices: `<table>/overflow` (real
ids that missed the first round), `<table>/sent_rows` (real ids sent to owners) and
`<table>/sent_bytes` (float32: bytes of the send buffers, ids out and rows back, over
all rounds; each NODE_SPLIT hop moves them once, and the backward sends the rows'
bytes again as gradients).

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

from gem_jax.batch import PAD_ID
from gem_jax import shard_context as context
from gem_jax.mesh import GROUP_AXES, INTRA_NODE_AXES, MESH_AXES, NODE, ZONE, live_axes
from gem_jax.units import format_bytes

MAX_ROW_MULTIPLE = 1024
CAPACITY_SIGMAS = 4.0  # margin of a bounded exchange buffer over its share, in standard deviations


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
      generation: where the table's rows live (`Generation`, `gem_jax.nn.embeddings`):
        GLOBAL sharded over every device, GROUP a copy per zone sharded over its devices,
        NODE_SPLIT as GROUP with each all-to-all in two hops (across nodes, then inside
        the node), REPLICATED a copy on every device.
      out_of_range: what a lookup does with an id outside `[0, num_rows)`, always
        counted (`OutOfRange`): ERROR a zero row and no gradient, and the host raises;
        ZERO a zero row and no gradient; HASH the id hashed into the vocabulary.
      capacity_factor: per-owner id buffer of one exchange round as a multiple of what
        uniform ids need (the balanced share `n / owners` plus a margin for its
        spread; see the module docstring); None: the worst case (`n`), one round.
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


def apply_id_policy(
    ids: jax.Array, num_rows: int, policy: OutOfRange, real: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Applies an out-of-range policy.

    Args:
      ids: int `[n]`.
      num_rows: vocabulary size.
      policy: see `OutOfRange`.
      real: bool `[n]`, False for rows that are not looked up at all (slack); None: all real.

    Returns:
      `(ids, valid, num_bad)`: int32 ids (in range wherever `valid`), bool `[n]` rows
      to look up (real, and in range or hashed), int32 count of real ids outside
      `[0, num_rows)`.
    """
    ids = ids.astype(jnp.int32)
    real = jnp.ones(ids.shape, bool) if real is None else real
    in_range = (ids >= 0) & (ids < num_rows)
    num_bad = jnp.sum(real & ~in_range, dtype=jnp.int32)
    if policy is OutOfRange.HASH:
        return jnp.where(in_range, ids, _hash_ids(ids, num_rows)), real, num_bad
    return jnp.where(in_range, ids, 0), real & in_range, num_bad


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _owner_rows(table: jax.Array, rows: jax.Array, sync_axes: tuple[str, ...], dtype) -> jax.Array:
    """`table[rows]` in `dtype`, zeros where `rows < 0`; the backward syncs touched rows across `sync_axes`."""
    valid = rows >= 0
    return jnp.where(valid[..., None], table[jnp.where(valid, rows, 0)], 0).astype(dtype)


def _owner_rows_fwd(table, rows, sync_axes, dtype):
    # The table is not a residual (rounds would stack a copy per round): a zero-width
    # array carries its row count and dtype to the backward.
    return _owner_rows(table, rows, sync_axes, dtype), (rows, jnp.zeros((table.shape[0], 0), table.dtype))


def _owner_rows_bwd(sync_axes, dtype, residuals, g):
    rows, like = residuals
    valid = rows >= 0
    idx = jnp.where(valid, rows, 0).reshape(-1)
    g = jnp.where(valid[..., None], g, 0).reshape(idx.shape[0], -1)  # in the exchange dtype
    if sync_axes:
        # Every replica scatter-adds every zone's (row, gradient) pairs in the same order.
        idx = jax.lax.all_gather(idx, sync_axes, to="invarying").reshape(-1)
        g = jax.lax.all_gather(g, sync_axes, to="invarying").reshape(idx.shape[0], -1)
    return jnp.zeros((like.shape[0], g.shape[-1]), like.dtype).at[idx].add(g.astype(like.dtype)), None


_owner_rows.defvjp(_owner_rows_fwd, _owner_rows_bwd)


def _pad_row(table: jax.Array, placement: TablePlacement, dtype) -> jax.Array:
    """Row `PAD_ID` `[d]` in `dtype` on every device, from its owner (a `psum` over the row axes).

    Under `shard_map`'s varying-axes typing the transpose sums the row's gradient over
    every device (all zones included) and hands it to the owner: the same gradient every
    replica gets for its other rows.
    """
    axes = placement.row_axes
    mine = jax.lax.axis_index(axes) == PAD_ID // placement.rows_per_shard
    row = jax.lax.psum(jnp.where(mine, table[PAD_ID % placement.rows_per_shard].astype(dtype), 0), axes)
    # Varying before it is broadcast over the ids, so that the transpose sums `[d]`, not `[n, d]`.
    invariant = tuple(a for a in placement.live(MESH_AXES) if a not in jax.typeof(row).manual_axis_type.varying)
    return jax.lax.pcast(row, invariant, to="varying") if invariant else row


def _buckets(owner: jax.Array, num_owners: int) -> tuple[jax.Array, jax.Array]:
    """Rank of each id among its owner's ids, and the ids per owner.

    Args:
      owner: int32 `[n]` in `[0, num_owners]`; `num_owners` marks ids not to send.

    Returns:
      `(pos, counts)`: int32 `[n]` rank of each id among the ids of its owner (arrival
      order), int32 `[num_owners]` ids to send per owner.
    """
    n = owner.shape[0]
    order = jnp.argsort(owner, stable=True)
    counts = jnp.zeros(num_owners + 1, jnp.int32).at[owner].add(1)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32) - starts[owner[order]])
    return pos, counts[:num_owners]


def _hops(placement: TablePlacement) -> tuple[tuple[tuple[str, ...], int], ...]:
    """`(axes, size)` of each all-to-all hop, outermost first; their sizes multiply to the owner count."""
    if placement.generation is Generation.NODE_SPLIT:
        groups = (placement.live((NODE,)), placement.live(INTRA_NODE_AXES))
    else:
        groups = (placement.row_axes,)
    return tuple((axes, placement.size(axes)) for axes in groups if axes)


def _route(buf: jax.Array, hops) -> jax.Array:
    """`[owners, ...]` -> `[owners, ...]`: block `i` goes to owner `i`; block `j` of the result came from device `j`.

    Owners are numbered over the row axes, outermost first, so hop `k` swaps index `k`
    of the `[size_0, size_1, ...]` view with the devices of its axes. Applied to the
    owners' replies it returns every block to the device that sent the request.
    """
    x = buf.reshape(*(size for _, size in hops), *buf.shape[1:])
    for k, (axes, _) in enumerate(hops):
        x = jax.lax.all_to_all(x, axes, k, k)
    return x.reshape(buf.shape)


def _round(table, local, owner, slot, fits, placement: TablePlacement, capacity: int, dtype) -> jax.Array:
    """One exchange of the ids with `fits`, at `(owner, slot)` of `[owners, capacity]` buffers.

    Returns their rows `[n, d]` in `dtype`, zeros for the other ids.
    """
    owners, hops = placement.num_shards, _hops(placement)
    o = jnp.where(fits, owner, owners)  # out of bounds: dropped by the scatter, never sent
    s = jnp.where(fits, slot, 0)
    send = jnp.full((owners, capacity), -1, jnp.int32).at[o, s].set(local, mode="drop")
    back = _route(_owner_rows(table, _route(send, hops), placement.sync_axes, dtype), hops)
    return jnp.where(fits[:, None], back[jnp.minimum(owner, owners - 1), s], 0)


def _capacity(n: int, owners: int, factor: float | None) -> int:
    """Ids a device sends to one owner per round, for a lookup of `n` ids.

    `factor` times the balanced share `m = n / owners` plus `CAPACITY_SIGMAS` standard
    deviations `sqrt(m)` of the share that uniform ids give (binomial, about Poisson):
    at factor 1 uniform ids fit, in small lookups as in large ones; larger factors
    leave room for skewed ids. At most `n`; None: `n`.
    """
    if factor is None:
        return max(n, 1)
    share = n / owners
    return max(1, min(n, math.ceil(factor * (share + CAPACITY_SIGMAS * math.sqrt(share)))))


def _exchange(table: jax.Array, ids: jax.Array, valid: jax.Array, placement: TablePlacement, dtype) -> jax.Array:
    """Rows `[n, d]` of a sharded table (zeros where not `valid`), in rounds of bounded buffers; records the counters."""
    n, d = ids.shape[0], table.shape[-1]
    owners, r = placement.num_shards, placement.rows_per_shard
    capacity = _capacity(n, owners, placement.capacity_factor)
    send = valid & (ids != PAD_ID)
    owner = jnp.where(send, ids // r, owners)
    pos, counts = _buckets(owner, owners)
    local = ids - jnp.minimum(owner, owners - 1) * r

    def exchange_round(k, rows):
        slot = pos - k * capacity
        fits = send & (slot >= 0) & (slot < capacity)
        return rows + _round(table, local, owner, slot, fits, placement, capacity, dtype)

    rows = exchange_round(0, jnp.zeros((n, d), dtype))
    max_rounds, rounds = -(-n // capacity), 1
    if max_rounds > 1:
        rounds = jax.lax.pmax(-(-jnp.max(counts) // capacity), placement.live(MESH_AXES))  # every device runs as many

        def more_rounds(rows):
            def body(rows, k):
                return jax.lax.cond(k < rounds, exchange_round, lambda k, rows: rows, k, rows), None

            return jax.lax.scan(body, rows, jnp.arange(1, max_rounds, dtype=jnp.int32))[0]

        rows = jax.lax.cond(rounds > 1, more_rounds, lambda rows: rows, rows)
    pad = valid & (ids == PAD_ID)
    rows = jnp.where(pad[:, None], _pad_row(table, placement, dtype)[None], rows)
    name = placement.name
    context.record(f"{name}/overflow", jnp.sum(jnp.maximum(counts - capacity, 0)))
    context.record(f"{name}/sent_rows", jnp.sum(send, dtype=jnp.int32))
    round_bytes = owners * capacity * (jnp.dtype(jnp.int32).itemsize + d * jnp.dtype(dtype).itemsize)
    context.record(f"{name}/sent_bytes", jnp.maximum(rounds, 1).astype(jnp.float32) * round_bytes)
    return rows


def exchange_buffer(placement: TablePlacement, n: int) -> tuple[int, int]:
    """`(owners, capacity)`: a lookup of `n` ids per device sends `[owners, capacity]` ids per round, gets as many rows back."""
    return placement.num_shards, _capacity(n, placement.num_shards, placement.capacity_factor)


def describe_exchange(placement: TablePlacement, n: int, dim: int, dtype) -> str:
    """One line: how a sharded table exchanges a lookup of `n` ids of width `dim` in `dtype`, and its buffer bytes per device.

    Raises:
      ValueError: a REPLICATED placement (nothing is exchanged).
    """
    if placement.generation is Generation.REPLICATED:
        raise ValueError(f"table {placement.name!r} is replicated: nothing is exchanged")
    owners, capacity = exchange_buffer(placement, n)
    hops = " then ".join(f"{size} ({'/'.join(axes)})" for axes, size in _hops(placement))
    row_bytes = dim * jnp.dtype(dtype).itemsize
    buffer = owners * capacity * row_bytes
    factor = placement.capacity_factor
    bound = f"capacity factor {factor:g}" if factor is not None else "worst-case buffers (no capacity factor)"
    return (
        f"{placement.name}: {placement.generation.name}, {owners} owners (all-to-all over {hops}), {bound}: "
        f"a lookup of {n:,} ids sends {capacity:,} per owner per round, {format_bytes(buffer)} of "
        f"{jnp.dtype(dtype).name} rows per device ({buffer / max(n * row_bytes, 1):.2f}x the rows looked up)"
    )


def lookup(
    table: jax.Array,
    ids: jax.Array,
    num_rows: int,
    placement: TablePlacement | None,
    *,
    mask: jax.Array | None = None,
    name: str = "table",
    exchange_dtype: jnp.dtype | str | None = None,
) -> jax.Array:
    """Embedding rows of `ids`.

    Outside a sharded step (`placement` None or REPLICATED) `table` is the whole
    parameter; inside one (`gem_jax.parallel.spmd`), it is this device's shard and the
    exchange of the module docstring runs over the named mesh axes. An unsharded
    table's lookup records its ids, and adds a row delta instead of differentiating
    `table`, when the active context carries `shard_context.TableRows`.

    Equivalent jnp (ids in range)::

        jnp.where(mask[..., None], table[ids], 0)

    Args:
      table: `[padded_rows, d]` or this device's `[padded_rows / shards, d]` shard.
      ids: int `[...]` this device's ids.
      num_rows: vocabulary size; ids outside `[0, num_rows)` follow the policy.
      placement: the resolved sharding; None: a local lookup with `OutOfRange.ERROR`.
      mask: bool, the shape of `ids`: False for rows that are not real (slack rows of
        a jagged batch): zero rows, no gradient, not counted, never sent. None: all real.
      name: counter prefix when `placement` is None.
      exchange_dtype: the dtype rows cross the network in (the model's compute dtype);
        None: the table's.

    Returns:
      `[..., d]` in table.dtype, or in `exchange_dtype` when rows cross the network;
      zero rows for masked ids and for ids the policy rejects.

    Raises:
      ValueError: `mask` of another shape than `ids`, or a sharded placement used
        outside a sharded step.
    """
    policy = placement.out_of_range if placement is not None else OutOfRange.ERROR
    name = placement.name if placement is not None else name
    if mask is not None and mask.shape != ids.shape:
        raise ValueError(f"table {name!r}: mask has shape {mask.shape}, ids {ids.shape}")
    real = None if mask is None else mask.reshape(-1).astype(bool)
    flat, valid, num_bad = apply_id_policy(ids.reshape(-1), num_rows, policy, real)
    context.record(f"{name}/out_of_range", num_bad)
    d = table.shape[-1]
    unsharded = placement is None or placement.generation is Generation.REPLICATED
    if unsharded or flat.shape[0] == 0:
        # Row gradients without a dense table gradient (`shard_context.TableRows`).
        delta = context.row_delta(name, jnp.where(valid, flat, table.shape[0])) if unsharded else None
        rows = table[flat] if delta is None else jax.lax.stop_gradient(table)[flat] + delta.astype(table.dtype)
        rows = jnp.where(valid[:, None], rows, 0)
        return rows.reshape(*ids.shape, d)
    if context.active() is None:
        raise ValueError(f"table {name!r} is sharded ({placement.generation.name}); look it up inside the sharded step")
    dtype = table.dtype if exchange_dtype is None else jnp.dtype(exchange_dtype)
    return _exchange(table, flat, valid, placement, dtype).reshape(*ids.shape, d)


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
