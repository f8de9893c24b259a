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
    "TokenBuckets",
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


def capacity_multiple(capacity: int) -> int:
    """The power of two (an int) a token capacity of `capacity` rows (an int) is a multiple of (`round_capacity`).

    `CAPACITY_MULTIPLE`, or the largest power of two not above `sqrt(capacity)` when that is
    larger (256 at 65,536 to 262,143 rows, 512 up to 1,048,575, ...).

    Why: XLA's GPU compiler sums a column reduction over many rows (the bias and norm-weight
    gradients, a sum over every token) in two passes (its tree-reduction rewriter): `k`
    partial sums of `n / k` rows each, `n / k` a divisor of `n` near `sqrt(n)`. When `n` has
    no such divisor (`166528 = 128 * 1301`, 1301 prime) it pads the operand first, and the
    pad keeps the first pass out of the fusion that computes the operand: the gradient is
    written, then read again by a reduction of its own. A multiple of this power of two always
    has the divisor (checked by compiling for an H200 at 260 capacities from 256 rows to 3.5
    million, `benchmarks/step.md`, "Capacities XLA can split").
    """
    return max(CAPACITY_MULTIPLE, 1 << (math.isqrt(max(capacity, 1)).bit_length() - 1))


def round_capacity(rows: float) -> int:
    """The smallest capacity `>= rows` (and `>= 1`) that is a multiple of its `capacity_multiple`.

    Rounds up by less than `max(CAPACITY_MULTIPLE, sqrt(capacity))` rows: above 16,384 rows
    under `1 / sqrt(capacity)` of the capacity (0.25% at `configs/gem_h200.py`'s 166,656).
    Non-decreasing in `rows`.

    Args:
      rows: the rows (tokens) a capacity must hold, a finite number (0 or less gives the smallest capacity).

    Returns:
      The capacity in rows, an int.

    Raises:
      ValueError, OverflowError: `rows` is NaN or infinite (from `math.ceil`).
    """
    needed = max(1, math.ceil(rows))
    multiple = CAPACITY_MULTIPLE
    while True:
        capacity = multiple * math.ceil(needed / multiple)
        if capacity_multiple(capacity) <= multiple:
            return capacity
        multiple = capacity_multiple(capacity)


@dataclasses.dataclass(frozen=True)
class TokenBuckets:
    """Token capacities that follow the real token count of a batch, not `B * max_seq_len`.

    A batch of n examples whose history lengths have mean `mean_length` and
    standard deviation `std_length` holds about `E = n * mean_length` rows,
    with standard deviation `sqrt(n) * std_length` (central limit theorem).
    Its capacities, each rounded up by `round_capacity` (to a multiple of `CAPACITY_MULTIPLE`, or
    of a larger power of two near the capacity's square root that XLA's reductions over it want), are

    - fine: `E * step**k` for the integers k that cover
      `E +- sigmas * sqrt(n) * std_length`; a batch in that range leaves less
      than `1 - 1/step` of its capacity as slack, plus the rounding (under
      `capacity_multiple(capacity) / capacity`);
    - coarse: halvings below the fine range down to `CAPACITY_MULTIPLE` rows
      (short last batches of an epoch), doublings above it, and the full
      `n * max_seq_len` last, so that every batch fits.

    Geometric bucket boundaries are those of Tensor2Tensor's length bucketing
    (`length_bucket_step`; Vaswani et al., "Tensor2Tensor for Neural Machine
    Translation", 2018), here over a batch's total rows around their expected value.

    Attributes:
      mean_length, std_length: of one example's history length, in rows
        (`from_lengths` estimates them from a sample).
      max_seq_len: bound on any history length.
      step: ratio of consecutive fine capacities, in (1, 2].
      sigmas: half-width of the fine range in standard deviations, > 0.

    Raises:
      ValueError: a moment that is negative, non-finite or above `max_seq_len`,
        or `step` / `sigmas` out of range (the field is named).
    """

    mean_length: float
    std_length: float
    max_seq_len: int
    step: float = 1.04
    sigmas: float = 4.0

    def __post_init__(self):
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, (int, np.integer)) or self.max_seq_len < 1:
            raise ValueError(f"TokenBuckets.max_seq_len must be a positive int, got {self.max_seq_len!r}")
        if not (math.isfinite(self.mean_length) and 0.0 <= self.mean_length <= self.max_seq_len):
            raise ValueError(f"TokenBuckets.mean_length must be in [0, max_seq_len={self.max_seq_len}], got {self.mean_length}")
        if not (math.isfinite(self.std_length) and self.std_length >= 0.0):
            raise ValueError(f"TokenBuckets.std_length must be finite and >= 0, got {self.std_length}")
        check_bucket_settings(self.step, self.sigmas)

    @classmethod
    def from_lengths(cls, lengths, max_seq_len: int, step: float = 1.04, sigmas: float = 4.0) -> TokenBuckets:
        """Buckets for examples whose history lengths are like `lengths` (int `[m]`, m >= 1).

        Raises:
          ValueError: `lengths` is empty or not 1-D, or the settings are invalid.
        """
        lengths = np.asarray(lengths, dtype=np.float64)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError(f"TokenBuckets.from_lengths needs a non-empty 1-D sample of lengths, got shape {lengths.shape}")
        return cls(float(lengths.mean()), float(lengths.std()), max_seq_len, step, sigmas)

    def capacities(self, batch_size: int) -> tuple[int, ...]:
        """Sorted capacities (rows, each a multiple of its `capacity_multiple`) of a batch of `batch_size` examples.

        Raises:
          ValueError: `batch_size < 1`.
        """
        rows, full = self._fine_rows(batch_size)
        while rows[0] > CAPACITY_MULTIPLE:
            rows.insert(0, rows[0] / 2)
        while rows[-1] < full:
            rows.append(rows[-1] * 2)
        return _rounded_capacities(rows, full)

    def fine_capacities(self, batch_size: int) -> tuple[int, ...]:
        """The fine part of `capacities(batch_size)`: those that hold the batches within `sigmas` standard deviations.

        Each capacity a run's batches take is a program compiled before its first step, so this is
        about how many programs a run's steady state costs (the coarse capacities serve rare batches).

        Raises:
          ValueError: `batch_size < 1`.
        """
        return _rounded_capacities(*self._fine_rows(batch_size))

    def _fine_rows(self, batch_size: int) -> tuple[list[float], int]:
        """Unrounded fine capacities (rows) of a batch of `batch_size` examples, and its full `batch_size * max_seq_len` rounded up."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        full = round_capacity(batch_size * self.max_seq_len)
        spread = self.sigmas * math.sqrt(batch_size) * self.std_length
        anchor = max(batch_size * self.mean_length, CAPACITY_MULTIPLE)
        low = max(anchor - spread, CAPACITY_MULTIPLE)
        high = min(anchor + spread, full)
        log_step = math.log(self.step)
        ks = range(math.floor(math.log(low / anchor) / log_step), math.ceil(math.log(high / anchor) / log_step) + 1)
        return [anchor * self.step**k for k in ks], full


def _rounded_capacities(rows, full: int) -> tuple[int, ...]:
    """`rows` rounded up by `round_capacity`, at most `full`, sorted and distinct."""
    return tuple(sorted({min(round_capacity(r), full) for r in rows}))


def check_bucket_settings(step: float, sigmas: float, names: tuple[str, str] = ("TokenBuckets.step", "TokenBuckets.sigmas")) -> None:
    """Checks `TokenBuckets` settings; `names` name the two settings in the error.

    Raises:
      ValueError: `step` is not a number in (1, 2], or `sigmas` is not a finite number > 0.
    """
    if isinstance(step, bool) or not (isinstance(step, (int, float)) and 1.0 < step <= 2.0):
        raise ValueError(f"{names[0]} must be in (1, 2], got {step!r}")
    if isinstance(sigmas, bool) or not (isinstance(sigmas, (int, float)) and math.isfinite(sigmas) and sigmas > 0.0):
        raise ValueError(f"{names[1]} must be finite and > 0, got {sigmas!r}")


def pick_capacity(total: int, capacities: Sequence[int]) -> int:
    """The smallest capacity `>= total`.

    Raises:
      JaggedError: `total` exceeds every capacity.
    """
    k = int(np.searchsorted(np.asarray(capacities), total))
    if k == len(capacities):
        raise JaggedError(f"capacity exceeded: {total} history rows exceed the largest capacity {capacities[-1]}")
    return int(capacities[k])
