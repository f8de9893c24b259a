"""The per-device context of a sharded step: mesh axis sizes and lookup statistics.

Model code (embedding tables, the DHEN expert group) runs unchanged on one device and
inside the `shard_map` of `gem_jax.parallel.spmd`. Inside, it needs the sizes of the
named mesh axes for its collectives, and a place to report counters (out-of-range ids,
buffer overflows) that the step returns as metrics. `shard_context` provides both for
the duration of one trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class ShardContext:
    """Attributes:
    axis_sizes: size of every mesh axis, outermost first.
    exchange_dtype: dtype in which activations cross the network (embedding rows);
      None keeps theirs.
    stats: int32 scalar counters recorded during the trace, by name (summed per name).
    """

    axis_sizes: dict[str, int]
    exchange_dtype: jnp.dtype | None = None
    stats: dict[str, jax.Array] = dataclasses.field(default_factory=dict)

    def record(self, name: str, value: jax.Array) -> None:
        """Adds an int32 scalar to counter `name`."""
        value = jnp.asarray(value, jnp.int32)
        self.stats[name] = self.stats[name] + value if name in self.stats else value


_ACTIVE: contextvars.ContextVar[ShardContext | None] = contextvars.ContextVar("gem_jax_shard_context", default=None)


@contextlib.contextmanager
def shard_context(axis_sizes: dict[str, int], exchange_dtype=None) -> Iterator[ShardContext]:
    """Makes a fresh `ShardContext` the active one inside the `with` block."""
    ctx = ShardContext(dict(axis_sizes), None if exchange_dtype is None else jnp.dtype(exchange_dtype))
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
