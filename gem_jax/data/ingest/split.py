"""Train / eval splits of a converted log, recorded per event.

- `time:Q` with 0 < Q < 1: a global cutoff at the Q quantile of all event
  times (the time of the event at rank floor(Q N) of N, sorted by time);
  events at or after the cutoff are eval, so ties at the cutoff all go to eval.
- `time:DATE` (ISO 8601; UTC unless it ends in `Z` or a `+HH:MM` offset) or
  `time:T` (an integer >= 1, in the time column's units): events at or after
  that time are eval.
- `last:N`: each user's last N events (by time) are eval; a user with N events
  or fewer keeps all of them in train (no eval target without a history).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math
import re
from collections.abc import Callable, Iterable

import numpy as np

from gem_jax.data.ingest.schema import SchemaError

TRAIN, EVAL = 0, 1
_BINS = 1 << 20
_SELECT_IN_MEMORY = 1 << 22


class SplitKind(enum.Enum):
    """How events are split: at a quantile of all times, at a fixed time, or each user's last N events."""

    TIME_QUANTILE = "time_quantile"
    TIME_CUTOFF = "time_cutoff"
    LAST = "last"


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """A split (module docstring). `value`: the quantile, the cutoff time (int64), or N."""

    kind: SplitKind
    value: float | int

    @classmethod
    def parse(cls, text: str) -> SplitRule:
        """`time:0.9`, `time:2024-01-01`, `time:1700000000` or `last:1`.

        Raises:
          SchemaError: anything else (the accepted forms named).
        """
        how, _, value = text.partition(":")
        usage = (
            f"--split {text!r}: expected time:Q (0 < Q < 1), time:DATE (ISO 8601, UTC unless it ends in Z or +-HH:MM), "
            "time:T (an integer >= 1) or last:N (N >= 1)"
        )
        if how == "last" and re.fullmatch(r"[0-9]+", value) and int(value) >= 1:
            return cls(SplitKind.LAST, int(value))
        if how != "time":
            raise SchemaError(usage)
        if re.fullmatch(r"[0-9]+", value) and int(value) >= 1:
            return cls(SplitKind.TIME_CUTOFF, int(value))
        if re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}([T ][0-9:.]+)?(Z|[+-][0-9]{2}:?[0-9]{2})?", value):
            try:
                moment = datetime.datetime.fromisoformat(value)
            except ValueError:
                raise SchemaError(usage) from None
            if moment.tzinfo is None:  # as the time column reads a date without an offset: UTC
                moment = moment.replace(tzinfo=datetime.timezone.utc)
            return cls(SplitKind.TIME_CUTOFF, math.floor(moment.timestamp()))  # whole seconds, floored as the column's times
        try:
            q = float(value)
        except ValueError:
            raise SchemaError(usage) from None
        if not 0.0 < q < 1.0:
            raise SchemaError(usage)
        return cls(SplitKind.TIME_QUANTILE, q)

    def describe(self) -> str:
        return {SplitKind.TIME_QUANTILE: "time quantile {}", SplitKind.TIME_CUTOFF: "time >= {}", SplitKind.LAST: "each user's last {} event(s)"}[self.kind].format(self.value)

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "value": self.value}

    @classmethod
    def from_json(cls, data: dict) -> SplitRule:
        return cls(SplitKind(data["kind"]), data["value"])


def time_quantile(times: Callable[[], Iterable[np.ndarray]], q: float, count: int, low: int, high: int) -> int:
    """The time at rank `min(floor(q count), count - 1)` of all times, exactly, in bounded memory.

    Args:
      times: returns a fresh iterator over the int64 time arrays (called a few
        times: histograms of 2**20 bins narrow the range until the rank's bin
        holds few enough values to select in memory).
      q: the quantile, in (0, 1).
      count: the number of times, >= 1.
      low, high: the smallest and largest time.
    """
    rank = min(int(np.floor(q * count)), count - 1)
    while True:
        width = -(-(high - low + 1) // _BINS)
        hist = np.zeros(_BINS, dtype=np.int64)
        for chunk in times():
            inside = chunk[(chunk >= low) & (chunk <= high)]
            hist += np.bincount((inside - low) // width, minlength=_BINS)[:_BINS]
        cumulative = np.cumsum(hist)
        b = int(np.searchsorted(cumulative, rank, side="right"))
        rank -= int(cumulative[b - 1]) if b else 0
        low, high = low + b * width, min(high, low + (b + 1) * width - 1)
        if width == 1:
            return low
        if hist[b] <= _SELECT_IN_MEMORY:
            values = np.concatenate([chunk[(chunk >= low) & (chunk <= high)] for chunk in times()])
            return int(np.partition(values, rank)[rank])


def resolve_cutoff(rule: SplitRule, times: Callable[[], Iterable[np.ndarray]], count: int, low: int, high: int) -> int | None:
    """The cutoff time of a time split (`time_quantile` for `time:Q`, the given time for
    `time:T`), or None for `last:N`; arguments as `time_quantile`'s."""
    if rule.kind is SplitKind.TIME_QUANTILE:
        return time_quantile(times, rule.value, count, low, high)
    if rule.kind is SplitKind.TIME_CUTOFF:
        return int(rule.value)
    return None


def eval_flags(rule: SplitRule, cutoff: int | None, starts: np.ndarray, times: np.ndarray) -> np.ndarray:
    """uint8 `[n]` split flags (`TRAIN` 0, `EVAL` 1) of events sorted by (user, time).

    Args:
      rule: the split.
      cutoff: the resolved cutoff time of a time split (None for `last:N`).
      starts: int64 `[u + 1]`, user k's events are `starts[k]:starts[k + 1]`.
      times: int64 `[n]`, the sorted events' times.
    """
    if rule.kind is not SplitKind.LAST:
        return (times >= cutoff).astype(np.uint8)
    lengths = np.diff(starts)
    user = np.repeat(np.arange(lengths.size), lengths)
    from_end = starts[1:][user] - 1 - np.arange(times.size)
    return ((from_end < rule.value) & (lengths[user] > rule.value)).astype(np.uint8)
