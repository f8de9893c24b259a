"""The byte layout of one converted record: one user and their whole event sequence.

A record is, little-endian and packed (no alignment padding):

1. `num_events`: uint32, L;
2. the user part (`RecordLayout.user_dtype`): `user` int32 (the user's row of
   `vocab/user.csv`), then one int32 `[m]` per user feature (rows of that
   feature's vocabulary, `m` its `max_values`, unused slots 0);
3. L events (`RecordLayout.event_dtype`), sorted by (time, input order):
   `item` int32 (row of `vocab/item.csv`), `time` int64, `action` int32 (only
   with an action column), `labels` float32 `[K]` (0/1, one per task),
   `weight` float32 (only with a weight column), `split` uint8 (0 train, 1 eval).

The manifest stores the field lists (`record_layout`), so any reader can
rebuild the dtypes; `RecordLayout.decode` returns the numpy dict
`ConvertedLog` yields.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_HEADER = np.dtype("<u4")


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """The fields of a record (module docstring).

    Attributes:
      num_tasks: K, labels per event.
      has_action, has_weight: whether events carry `action` / `weight`.
      user_features: `(name, max_values)` per user feature, in schema order.
    """

    num_tasks: int
    has_action: bool
    has_weight: bool
    user_features: tuple[tuple[str, int], ...] = ()

    @property
    def event_dtype(self) -> np.dtype:
        """One event of a record: item row int32, time int64 (the time column's integers, or Unix seconds for dates), action int32 when the
        schema has one, labels float32 `[K]`, weight float32 when it has one, split flag uint8 (0 train, 1 eval)."""
        fields = [("item", "<i4"), ("time", "<i8")]
        fields += [("action", "<i4")] if self.has_action else []
        fields += [("labels", "<f4", (self.num_tasks,))]
        fields += [("weight", "<f4")] if self.has_weight else []
        return np.dtype(fields + [("split", "u1")])

    @property
    def user_dtype(self) -> np.dtype:
        """A record's user: user row int32 and each user feature's rows int32 `[max_values]` (0: padding)."""
        return np.dtype([("user", "<i4")] + [(f"user_feature/{name}", "<i4", (m,)) for name, m in self.user_features])

    def records(self, users: np.ndarray, events: np.ndarray, starts: np.ndarray):
        """Yields the record bytes of each user.

        Args:
          users: `user_dtype` `[u]`.
          events: `event_dtype` `[n]`, sorted by (user, time).
          starts: int64 `[u + 1]`, user k's events `starts[k]:starts[k + 1]`.
        """
        head = np.zeros(users.size, dtype=[("num_events", _HEADER), ("user", self.user_dtype)])
        head["num_events"] = np.diff(starts)
        head["user"] = users
        head_bytes, event_bytes = memoryview(head.tobytes()), memoryview(events.tobytes())
        h, e = head.dtype.itemsize, self.event_dtype.itemsize
        bounds = (np.asarray(starts, dtype=np.int64) * e).tolist()
        for k in range(users.size):
            yield b"".join((head_bytes[k * h : (k + 1) * h], event_bytes[bounds[k] : bounds[k + 1]]))

    def decode(self, raw: bytes) -> dict[str, np.ndarray]:
        """The fields of one record: `user` int32 `[]`, `user_feature/<name>` int32 `[m]`,
        `item` int32 `[L]`, `time` int64 `[L]`, `action` int32 `[L]`, `labels` float32 `[L, K]`,
        `weight` float32 `[L]`, `split` uint8 `[L]` (action / weight only when the layout has them)."""
        n = int(np.frombuffer(raw, _HEADER, 1)[0])
        user = np.frombuffer(raw, self.user_dtype, 1, _HEADER.itemsize)[0]
        events = np.frombuffer(raw, self.event_dtype, n, _HEADER.itemsize + self.user_dtype.itemsize)
        out = {name: np.array(user[name]) for name in self.user_dtype.names}
        out.update({name: np.ascontiguousarray(events[name]) for name in self.event_dtype.names})
        return out

    def decode_many(self, raws: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Several records at once, without a Python step per event.

        Args:
          raws: the bytes of u records.

        Returns:
          `(users, events, counts)`: `user_dtype` `[u]`, the records' events one
          after the other as `event_dtype` `[n]`, and uint32 `[u]` events per record.

        Raises:
          ValueError: a record shorter than its header, or whose size does not
            match its event count.
        """
        head = _HEADER.itemsize + self.user_dtype.itemsize
        sizes = np.fromiter(map(len, raws), np.int64, len(raws))
        short = np.flatnonzero(sizes < head)
        if short.size:
            raise ValueError(f"record {int(short[0])} holds {int(sizes[short[0]])} bytes, fewer than its {head}-byte header")
        views = [memoryview(raw) for raw in raws]
        heads = np.frombuffer(b"".join([view[:head] for view in views]), dtype=[("num_events", _HEADER), ("user", self.user_dtype)])
        counts = heads["num_events"]
        bad = np.flatnonzero(sizes != head + counts.astype(np.int64) * self.event_dtype.itemsize)
        if bad.size:
            raise ValueError(f"record {int(bad[0])} holds {int(sizes[bad[0]])} bytes, its header says {int(counts[bad[0]])} events")
        events = np.frombuffer(b"".join([view[head:] for view in views]), self.event_dtype)
        return np.ascontiguousarray(heads["user"]), events, np.ascontiguousarray(counts)

    def to_json(self) -> dict:
        return {
            "user_fields": [[name, str(self.user_dtype[name].base), list(self.user_dtype[name].shape)] for name in self.user_dtype.names],
            "event_fields": [[name, str(self.event_dtype[name].base), list(self.event_dtype[name].shape)] for name in self.event_dtype.names],
            "num_tasks": self.num_tasks,
            "has_action": self.has_action,
            "has_weight": self.has_weight,
            "user_features": [list(f) for f in self.user_features],
        }

    @classmethod
    def from_json(cls, data: dict) -> RecordLayout:
        return cls(data["num_tasks"], data["has_action"], data["has_weight"], tuple((name, m) for name, m in data["user_features"]))
