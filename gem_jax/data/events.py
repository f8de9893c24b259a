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

from gem_jax.batch import PAD_ID
from gem_jax.data.rows import SkippedRows

NUM_USER_FEATURES = 3  # age, gender, occupation ids (UserField.AGE..OCCUPATION)


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
      item_genres: uint8 `[num_items, num_genres]` multi-hot (row PAD_ID is 0).
      user_features: int32 `[num_users, 3]` age, gender, occupation ids (PAD_ID
        where unknown or absent from the source).
      num_actions, num_ages, num_genders, num_occupations: vocabulary sizes,
        each including PAD_ID.
      genre_names: `num_genres` column names of `item_genres`.
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
    item_genres: np.ndarray
    user_features: np.ndarray
    num_actions: int
    num_ages: int
    num_genders: int
    num_occupations: int
    genre_names: tuple[str, ...]
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

    @property
    def num_genres(self) -> int:
        return int(self.item_genres.shape[1])


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
    item_genres: np.ndarray,
    user_features: np.ndarray | None,
    num_actions: int,
    num_ages: int = 1,
    num_genders: int = 1,
    num_occupations: int = 1,
    genre_names: tuple[str, ...],
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
      item_genres: `[I, G]` 0/1 rows aligned with `item_vocab`.
      user_features: int `[U, 3]` rows aligned with `user_vocab`, or None (all PAD_ID).
      genre_names: `G` names.

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
    item_genres = np.asarray(item_genres, dtype=np.uint8)
    if item_genres.shape != (item_vocab.shape[0], len(genre_names)):
        raise ValueError(
            f"{name}: item_genres has shape {item_genres.shape}, expected {(item_vocab.shape[0], len(genre_names))}"
        )
    if user_features is None:
        user_features = np.zeros((user_vocab.shape[0], NUM_USER_FEATURES), np.int32)
    user_features = np.asarray(user_features, dtype=np.int32)
    if user_features.shape != (user_vocab.shape[0], NUM_USER_FEATURES):
        raise ValueError(f"{name}: user_features has shape {user_features.shape}, expected {(user_vocab.shape[0], 3)}")

    user = _remap(user_vocab, np.asarray(raw_user, dtype=np.int64), "user")
    item = _remap(item_vocab, np.asarray(raw_item, dtype=np.int64), "item")
    timestamp = np.asarray(timestamp, dtype=np.int64)
    line = np.asarray(line, dtype=np.int64)
    order = np.lexsort((line, item, timestamp, user))
    user = user[order]
    num_users = user_vocab.shape[0] + 1
    pad_row = lambda table: np.concatenate([np.full((1,) + table.shape[1:], PAD_ID, table.dtype), table])
    return EventLog(
        name=name,
        user=user,
        item=item[order],
        action=np.asarray(action, dtype=np.int32)[order],
        rating=np.asarray(rating, dtype=np.float32)[order],
        timestamp=timestamp[order],
        line=line[order],
        user_offsets=np.searchsorted(user, np.arange(num_users + 1)).astype(np.int64),
        item_genres=pad_row(item_genres),
        user_features=pad_row(user_features),
        num_actions=num_actions,
        num_ages=num_ages,
        num_genders=num_genders,
        num_occupations=num_occupations,
        genre_names=tuple(genre_names),
        raw_user_ids=np.concatenate([[-1], user_vocab]),
        raw_item_ids=np.concatenate([[-1], item_vocab]),
        skipped=tuple(skipped),
        notes=tuple(notes),
    )
