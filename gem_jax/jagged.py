"""The jagged (values, offsets) representation of variable-length sequences.

B sequences are packed back to back in one `values` array of static capacity
`T_cap`; `offsets[b]:offsets[b+1]` are the rows of sequence b::

    lengths  = [3, 0, 2]
    offsets  = [0, 3, 3, 5]                  int32[B+1]
    values   = [a0 a1 a2 | c0 c1 | s s s]    [T_cap, ...], T_cap = 8
                                     ^^^^^ slack rows (offsets[B] <= row < T_cap)

Slack rows exist so that `T_cap` can be a static, bucketed capacity (XLA
recompiles only when the bucket changes). They may hold anything, NaN included,
and must never change a result. This is the layout of HSTU / GEM's jagged
kernels (Zhai et al., "Actions Speak Louder than Words", 2024).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import jagged_layout
from pallas_kernels.jagged_layout import from_padded, positions_in_sequence, segment_ids, to_padded

__all__ = [
    "Jagged",
    "JaggedError",
    "from_lengths",
    "from_padded",
    "offsets_from_lengths",
    "positions_in_sequence",
    "segment_ids",
    "to_padded",
    "validate",
]


class JaggedError(ValueError):
    """A jagged structure is malformed (negative length, bad offsets, overflow)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Jagged:
    """Packed variable-length sequences.

    Attributes:
      values: `[T_cap, ...]` rows of all sequences, back to back, then slack.
      offsets: int32 `[B+1]`; `offsets[0] == 0`, non-decreasing,
        `offsets[B] <= T_cap`.
      max_seq_len: static upper bound on any sequence length (not a pytree leaf).
    """

    values: jax.Array
    offsets: jax.Array
    max_seq_len: int = dataclasses.field(metadata=dict(static=True))

    @property
    def batch_size(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    def lengths(self) -> jax.Array:
        """int32 `[B]` sequence lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    def segment_ids(self) -> jax.Array:
        """int32 `[T_cap]`: the sequence of each row; `B` for slack rows."""
        return segment_ids(self.offsets, self.capacity)

    def positions(self) -> jax.Array:
        """int32 `[T_cap]`: each row's index inside its sequence (0 for slack)."""
        return positions_in_sequence(self.offsets, self.capacity)

    def valid_mask(self) -> jax.Array:
        """bool `[T_cap]`: True for real rows, False for slack."""
        return jnp.arange(self.capacity) < self.offsets[-1]

    def to_padded(self, fill_value=0) -> jax.Array:
        """Returns `[B, max_seq_len, ...]`, positions past each length filled."""
        return to_padded(self.values, self.offsets, self.max_seq_len, fill_value)

    def replace_values(self, values: jax.Array) -> Jagged:
        return dataclasses.replace(self, values=values)


def offsets_from_lengths(lengths) -> np.ndarray:
    """int32 `[B+1]` offsets from `[B]` lengths (host, numpy).

    Raises:
      JaggedError: a length is negative (its index is named).
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise JaggedError(f"lengths must be 1-D, got shape {lengths.shape}")
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        raise JaggedError(f"negative sequence length {int(lengths[bad[0]])} at index {int(bad[0])}")
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def from_lengths(values, lengths, *, max_seq_len: int, capacity: int | None = None) -> Jagged:
    """Builds a validated `Jagged` from packed `values` and per-sequence lengths.

    Args:
      values: `[T, ...]` packed rows, `T >= sum(lengths)`.
      lengths: `[B]` non-negative ints.
      max_seq_len: static bound; every length must be `<= max_seq_len`.
      capacity: static `T_cap`; `values` is zero-padded to it (default: `T`).

    Raises:
      JaggedError: negative length, length above `max_seq_len`, or more rows
        than `capacity`.
    """
    offsets = offsets_from_lengths(lengths)
    values = np.asarray(values)
    capacity = values.shape[0] if capacity is None else capacity
    if values.shape[0] < offsets[-1]:
        raise JaggedError(f"values has {values.shape[0]} rows but the lengths sum to {int(offsets[-1])}")
    if values.shape[0] > capacity:
        if offsets[-1] > capacity:
            raise JaggedError(f"capacity exceeded: {int(offsets[-1])} rows do not fit in capacity {capacity}")
        values = values[:capacity]
    pad = [(0, capacity - values.shape[0])] + [(0, 0)] * (values.ndim - 1)
    jagged = Jagged(jnp.asarray(np.pad(values, pad)), jnp.asarray(offsets), max_seq_len)
    validate(jagged)
    return jagged


Jagged.from_lengths = staticmethod(from_lengths)  # `Jagged.from_lengths(values, lengths, max_seq_len=...)`


def validate(jagged: Jagged) -> None:
    """Checks a concrete (non-traced) `Jagged` on the host.

    Raises:
      JaggedError: naming the first bad index: offsets not 1-D, `offsets[0] != 0`,
        offsets decreasing, `offsets[B] > T_cap`, or a length above `max_seq_len`.
    """
    jagged_layout.check_offsets(jagged.offsets, jagged.capacity, jagged.max_seq_len, error=JaggedError)

CAPACITY_MULTIPLE = 128


def capacity_buckets(batch_size: int, max_seq_len: int, fractions: Sequence[float] = (0.125, 0.25, 0.5, 0.75, 1.0)) -> tuple[int, ...]:
    """Sorted token capacities `ceil(B * max_seq_len * f)` rounded up to a multiple of 128.

    The largest bucket (fraction 1 must be among the fractions) holds any batch.

    Raises:
      ValueError: a non-positive size, a fraction outside (0, 1], or no fraction 1.
    """
    if batch_size < 1 or max_seq_len < 1:
        raise ValueError(f"batch_size and max_seq_len must be >= 1, got {batch_size}, {max_seq_len}")
    if 1.0 not in fractions or not all(0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"capacity fractions must be in (0, 1] and include 1, got {tuple(fractions)}")
    full = batch_size * max_seq_len
    return tuple(sorted({CAPACITY_MULTIPLE * math.ceil(math.ceil(full * f) / CAPACITY_MULTIPLE) for f in fractions}))


def pick_capacity(total: int, capacities: Sequence[int]) -> int:
    """The smallest capacity `>= total`.

    Raises:
      JaggedError: `total` exceeds every capacity.
    """
    k = int(np.searchsorted(np.asarray(capacities), total))
    if k == len(capacities):
        raise JaggedError(f"capacity exceeded: {total} history rows exceed the largest capacity {capacities[-1]}")
    return int(capacities[k])
