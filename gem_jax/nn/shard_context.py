"""The per-device context of a sharded step: mesh axis sizes, lookup statistics, table row gradients.

Model code (embedding tables, the DHEN expert group) runs unchanged on one device and
inside the `shard_map` of `gem_jax.parallel.spmd`. Inside, it needs the sizes of the
named mesh axes for its collectives, and a place to report counters (out-of-range ids,
buffer overflows, bytes exchanged) that the step returns as metrics. `shard_context` provides both for
the duration of one trace. A step that updates unsharded tables row by row
(`gem_jax.train.sparse_tables`) also passes `TableRows` through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class TableRows:
    """Per-lookup row gradients of unsharded embedding tables, without a dense table gradient.

    Every lookup of an unsharded table records its ids. For the tables named in
    `deltas`, the lookup also gathers from the stop-gradient table and adds its next
    delta, a zero `[n, d]` input of the loss: the loss's gradient w.r.t. that delta is
    the gradient of each looked-up row, and no `[rows, d]` table gradient is formed
    (the technique of TensorFlow's `IndexedSlices` and PyTorch's
    `nn.Embedding(sparse=True)`).

    Attributes:
      deltas: by table name, one float `[n_i, d]` per lookup in trace order; None:
        record the ids only (a shape probe).
      ids: recorded by table name, one int32 `[n_i]` per lookup: the row looked up,
        or the table's parameter row count where the id policy rejected the id.
    """

    deltas: dict[str, list[jax.Array]] | None
    ids: dict[str, list[jax.Array]] = dataclasses.field(default_factory=dict)

    def take(self, name: str, ids: jax.Array) -> jax.Array | None:
        """Records `ids` of a lookup of table `name`; returns its delta, or None when the table has none.

        Raises:
          ValueError: the table is looked up more often than it has deltas, or a
            delta's length is not the lookup's.
        """
        recorded = self.ids.setdefault(name, [])
        recorded.append(ids)
        if self.deltas is None or name not in self.deltas:
            return None
        deltas = self.deltas[name]
        if len(recorded) > len(deltas):
            raise ValueError(f"table {name!r}: lookup {len(recorded)} has no row delta (only {len(deltas)} were traced)")
        delta = deltas[len(recorded) - 1]
        if delta.shape[0] != ids.shape[0]:
            raise ValueError(f"table {name!r}: lookup {len(recorded)} has {ids.shape[0]} ids but a delta of {delta.shape[0]} rows")
        return delta


@dataclasses.dataclass
class ShardContext:
    """Attributes:
    axis_sizes: size of every mesh axis, outermost first.
    exchange_dtype: dtype in which activations cross the network (embedding rows);
      None keeps theirs.
    stats: scalar counters recorded during the trace, by name (summed per name): int32,
      or float32 for quantities that overflow int32 (bytes).
    rows: the row gradients of unsharded tables, or None (tables get dense gradients).
    """

    axis_sizes: dict[str, int]
    exchange_dtype: jnp.dtype | None = None
    stats: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    rows: TableRows | None = None

    def record(self, name: str, value: jax.Array) -> None:
        """Adds a scalar to counter `name`: float32 if `value` is a float, else int32."""
        value = jnp.asarray(value)
        value = value.astype(jnp.float32 if jnp.issubdtype(value.dtype, jnp.floating) else jnp.int32)
        self.stats[name] = self.stats[name] + value if name in self.stats else value


_ACTIVE: contextvars.ContextVar[ShardContext | None] = contextvars.ContextVar("gem_jax_shard_context", default=None)


@contextlib.contextmanager
def shard_context(axis_sizes: dict[str, int], exchange_dtype=None, rows: TableRows | None = None) -> Iterator[ShardContext]:
    """Makes a fresh `ShardContext` the active one inside the `with` block."""
    ctx = ShardContext(dict(axis_sizes), None if exchange_dtype is None else jnp.dtype(exchange_dtype), rows=rows)
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)


def active() -> ShardContext | None:
    """The active `ShardContext`, or None outside a sharded step."""
    return _ACTIVE.get()


def record(name: str, value: jax.Array) -> None:
    """Adds `value` to counter `name` of the active context; a no-op outside one."""
    ctx = active()
    if ctx is not None:
        ctx.record(name, value)


def row_delta(name: str, ids: jax.Array) -> jax.Array | None:
    """`TableRows.take` of the active context; None outside one or without `rows`."""
    ctx = active()
    return None if ctx is None or ctx.rows is None else ctx.rows.take(name, ids)
