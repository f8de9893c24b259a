"""The common event log every reader returns.

A reader turns its files into raw per-event arrays plus side tables keyed by the
publisher's ids; `build_event_log` remaps users and items to dense ids 1..n
(0 is PAD_ID) and sorts the events by (user, timestamp, item, source line), so
each user's events are contiguous and in time order, with ties at one
timestamp broken by item id and then by position in the file.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gem_jax.batch import PAD_ID, CategoricalFeature, Pooling
from gem_jax.data.features import multi_hot_ids
from gem_jax.data.rows import SkippedRows

# MovieLens 100K's user features; the other built-in sources declare them PAD only
# (`absent_features`), so every built-in source has the same model layout.
DEMOGRAPHICS = ("age", "gender", "occupation")


@dataclasses.dataclass(frozen=True)
class FeatureTable:
    """One side feature of every user (or item): int32 ids `[rows, max_values]`, PAD_ID-padded.

    Attributes:
      feature: name, vocabulary size, values per row, pooling.
      ids: row r holds the ids of user (item) r; rows are aligned with the publisher's
        sorted vocabulary in `build_event_log`'s input and with the dense ids (row
        PAD_ID all PAD) in an `EventLog`.
      names: the source's value of each id 1..vocab_size-1, where known (else empty).

    Raises:
      ValueError: `ids` not `[rows, feature.max_values]`, an id outside the vocabulary,
        or `names` of another length than the vocabulary without PAD.
    """

    feature: CategoricalFeature
    ids: np.ndarray
    names: tuple[str, ...] = ()

    def __post_init__(self):
        ids = np.asarray(self.ids, dtype=np.int32)
        object.__setattr__(self, "ids", ids)
        if ids.ndim != 2 or ids.shape[1] != self.feature.max_values:
            raise ValueError(f"feature {self.feature.name!r}: ids have shape {ids.shape}, expected [rows, {self.feature.max_values}]")
        if ids.size and (ids.min() < 0 or ids.max() >= self.feature.vocab_size):
            raise ValueError(f"feature {self.feature.name!r}: ids outside [0, {self.feature.vocab_size})")
        if self.names and len(self.names) != self.feature.vocab_size - 1:
            raise ValueError(f"feature {self.feature.name!r}: {len(self.names)} names for {self.feature.vocab_size - 1} ids")

    @classmethod
    def from_multi_hot(cls, name: str, hot: np.ndarray, names: tuple[str, ...] = (), pooling: Pooling = Pooling.MULTI_HOT) -> FeatureTable:
        """A multi-valued feature from 0/1 rows `[rows, G]` (column names `names`): column j is
        id j + 1, `max_values` is G (any row may set every column); each row's ids ascending,
        then PAD."""
        hot = np.asarray(hot) != 0
        width = hot.shape[1]
        return cls(CategoricalFeature(name, width + 1, width, pooling), multi_hot_ids(hot, width), tuple(names))

    def with_pad_row(self) -> FeatureTable:
        """This table with a row of PAD_ID in front (row r + 1 for publisher row r, as dense ids)."""
        return FeatureTable(self.feature, np.concatenate([np.full((1, self.ids.shape[1]), PAD_ID, np.int32), self.ids]), self.names)


def absent_features(names: tuple[str, ...], rows: int) -> tuple[FeatureTable, ...]:
    """Features a source lacks, PAD only (vocabulary size 1) for each of `rows` users or items."""
    return tuple(FeatureTable(CategoricalFeature(name, 1), np.zeros((rows, 1), np.int32)) for name in names)


@dataclasses.dataclass(frozen=True)
class EventLog:
    """Events of one data set, sorted by (user, timestamp, item, line).

    Attributes:
      name: data set name, for messages.
      user: int32 `[N]` dense user ids, 1..num_users-1.
      item: int32 `[N]` dense item ids, 1..num_items-1.
      action: int32 `[N]` action ids, 1..num_actions-1 (half-star rating, or 1
        for an implicit interaction).
      rating: float32 `[N]` star rating; NaN where the source has none.
      timestamp: int64 `[N]` seconds since the epoch, or the event's position in
        its user's sequence where the source has no times.
      line: int64 `[N]` 1-based line of the event in its source file.
      user_offsets: int64 `[num_users + 1]`: user u's events are
        `[user_offsets[u], user_offsets[u + 1])`.
      user_features: side features of every user (ids `[num_users, max_values]`,
        row PAD_ID all PAD; PAD_ID where unknown), without the user id itself.
      item_features: side features of every item (`[num_items, max_values]`).
      num_actions: action vocabulary size, PAD_ID included.
      raw_user_ids, raw_item_ids: int64 publisher ids of each dense id (-1 at PAD_ID).
      skipped: rows left out under `OnBadRow.SKIP`, per file and kind.
      notes: other facts a user should see (e.g. items without side features).
    """

    name: str
    user: np.ndarray
    item: np.ndarray
    action: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    line: np.ndarray
    user_offsets: np.ndarray
    user_features: tuple[FeatureTable, ...]
    item_features: tuple[FeatureTable, ...]
    num_actions: int
    raw_user_ids: np.ndarray
    raw_item_ids: np.ndarray
    skipped: tuple[SkippedRows, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def num_events(self) -> int:
        return int(self.user.shape[0])

    @property
    def num_users(self) -> int:
        """User vocabulary size, PAD_ID included."""
        return int(self.raw_user_ids.shape[0])

    @property
    def num_items(self) -> int:
        """Item vocabulary size, PAD_ID included."""
        return int(self.raw_item_ids.shape[0])


def _remap(raw_vocab: np.ndarray, raw_ids: np.ndarray, what: str) -> np.ndarray:
    """Dense ids 1..n of `raw_ids` in the sorted unique `raw_vocab`."""
    pos = np.searchsorted(raw_vocab, raw_ids)
    pos_clipped = np.minimum(pos, max(raw_vocab.shape[0] - 1, 0))
    missing = np.flatnonzero((pos >= raw_vocab.shape[0]) | (raw_vocab[pos_clipped] != raw_ids))
    if missing.size:
        raise ValueError(f"{what} id {int(raw_ids[missing[0]])} is not in the {what} vocabulary")
    return (pos + 1).astype(np.int32)


def build_event_log(
    *,
    name: str,
    raw_user: np.ndarray,
    raw_item: np.ndarray,
    action: np.ndarray,
    rating: np.ndarray,
    timestamp: np.ndarray,
    line: np.ndarray,
    user_vocab: np.ndarray,
    item_vocab: np.ndarray,
    user_features: tuple[FeatureTable, ...],
    item_features: tuple[FeatureTable, ...],
    num_actions: int,
    skipped: tuple[SkippedRows, ...] = (),
    notes: tuple[str, ...] = (),
) -> EventLog:
    """Remaps publisher ids to 1..n (PAD_ID = 0 reserved) and sorts the events.

    Args:
      raw_user, raw_item: int `[N]` publisher ids of each event.
      action: int `[N]` action ids in 1..num_actions-1.
      rating: float `[N]` (NaN where absent).
      timestamp: int `[N]`.
      line: int `[N]` source line of each event (the last tie-break).
      user_vocab, item_vocab: int `[U]`, `[I]` sorted unique publisher ids; dense
        id k+1 is `vocab[k]`. Every event's ids must be in them.
      user_features: tables of `U` rows aligned with `user_vocab`.
      item_features: tables of `I` rows aligned with `item_vocab`.

    Returns:
      The sorted `EventLog`; dense ids follow the publisher ids' order.

    Raises:
      ValueError: an event id missing from its vocabulary, an unsorted or
        repeated vocabulary, or misaligned side tables.
    """
    user_vocab = np.asarray(user_vocab, dtype=np.int64)
    item_vocab = np.asarray(item_vocab, dtype=np.int64)
    for what, vocab in (("user", user_vocab), ("item", item_vocab)):
        if vocab.ndim != 1 or np.any(np.diff(vocab) <= 0):
            raise ValueError(f"{name}: the {what} vocabulary must be 1-D, sorted and without repeats")
    for what, tables, vocab in (("user", user_features, user_vocab), ("item", item_features, item_vocab)):
        for table in tables:
            if table.ids.shape[0] != vocab.shape[0]:
                raise ValueError(f"{name}: {what} feature {table.feature.name!r} has {table.ids.shape[0]} rows, the {what} vocabulary {vocab.shape[0]}")

    user = _remap(user_vocab, np.asarray(raw_user, dtype=np.int64), "user")
    item = _remap(item_vocab, np.asarray(raw_item, dtype=np.int64), "item")
    timestamp = np.asarray(timestamp, dtype=np.int64)
    line = np.asarray(line, dtype=np.int64)
    order = np.lexsort((line, item, timestamp, user))
    user = user[order]
    num_users = user_vocab.shape[0] + 1
    return EventLog(
        name=name,
        user=user,
        item=item[order],
        action=np.asarray(action, dtype=np.int32)[order],
        rating=np.asarray(rating, dtype=np.float32)[order],
        timestamp=timestamp[order],
        line=line[order],
        user_offsets=np.searchsorted(user, np.arange(num_users + 1)).astype(np.int64),
        user_features=tuple(t.with_pad_row() for t in user_features),
        item_features=tuple(t.with_pad_row() for t in item_features),
        num_actions=num_actions,
        raw_user_ids=np.concatenate([[-1], user_vocab]),
        raw_item_ids=np.concatenate([[-1], item_vocab]),
        skipped=tuple(skipped),
        notes=tuple(notes),
    )
