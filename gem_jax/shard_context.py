"""The one per-step context of a sharded step: what the sharding plan and the step tell the layers.

Model code (embedding tables, FP8 layers, the DHEN expert group) runs unchanged on one
device and inside the `shard_map` of `gem_jax.parallel.spmd`. Inside, it needs what the
sharding plan decided and the model's own configuration does not hold: the sizes of the
named mesh axes for its collectives, where each FP8 layer's kernel is sharded
(`pallas_kernels.mxfp8.Fp8Gather`: quantized on the shard, gathered in 8 bits) and each
table's placement, both by module path; and a place
to report counters (out-of-range ids, buffer overflows, bytes exchanged) that the step
returns as metrics. A step that updates unsharded tables row by row
(`gem_jax.train.sparse_tables`) also passes `TableRows` through it. The numerics of a
layer (its `Fp8Recipe`, its compute dtype, the dtype a table's rows are exchanged in)
stay with the layer, from `ModelConfig`: the context holds placement, not numerics.

`ShardedModel` builds one `ShardContext` per step and makes it the active one for the
duration of the trace (`shard_context`); layers read it with `active()` and look
themselves up by their module path (`Fp8Linear.path`, `EmbeddingTable.path`). The
context is held by this single scope rather than passed through every `__call__`: the
same model code runs outside any step (then `active()` is None and every layer is whole
and local), and no module attribute is rewritten per step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp8 import Fp8Gather


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
    fp8: by FP8 layer path ("sequence_tower/blocks/0/qkv"), where its kernel shard is
      quantized and gathered (`ShardingPlan.fp8`); a layer not named gets its whole kernel.
    tables: by table path ("embed/item"), its `gem_jax.nn.embeddings.TablePlacement`
      (`ShardingPlan.tables`); a table not named is looked up locally.
    stats: scalar counters recorded during the trace, by name (summed per name): int32,
      or float32 for quantities that overflow int32 (bytes).
    rows: the row gradients of unsharded tables, or None (tables get dense gradients).
    """

    axis_sizes: dict[str, int]
    fp8: Mapping[str, Fp8Gather] = dataclasses.field(default_factory=dict)
    tables: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stats: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    rows: TableRows | None = None

    def record(self, name: str, value: jax.Array) -> None:
        """Adds a scalar to counter `name`: float32 if `value` is a float, else int32."""
        value = jnp.asarray(value)
        value = value.astype(jnp.float32 if jnp.issubdtype(value.dtype, jnp.floating) else jnp.int32)
        self.stats[name] = self.stats[name] + value if name in self.stats else value


_ACTIVE: contextvars.ContextVar[ShardContext | None] = contextvars.ContextVar("gem_jax_shard_context", default=None)


@contextlib.contextmanager
def shard_context(
    axis_sizes: dict[str, int],
    *,
    fp8: Mapping[str, Fp8Gather] | None = None,
    tables: Mapping[str, Any] | None = None,
    rows: TableRows | None = None,
) -> Iterator[ShardContext]:
    """Makes a fresh `ShardContext` (fields as its attributes) the active one inside the `with` block."""
    ctx = ShardContext(dict(axis_sizes), dict(fp8 or {}), dict(tables or {}), rows=rows)
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


def fp8_gather(path: str | None) -> Fp8Gather | None:
    """The gather of the FP8 layer at module path `path` in the active step; None outside one, or for a whole kernel."""
    ctx = active()
    return None if ctx is None or path is None else ctx.fp8.get(path)


def table_placement(path: str | None):
    """The `TablePlacement` of the table at module path `path` in the active step; None outside one (a local lookup)."""
    ctx = active()
    return None if ctx is None or path is None else ctx.tables.get(path)
