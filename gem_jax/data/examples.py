"""Examples as index arrays into a sorted `EventLog`.

An example predicts the outcome of one target event of a user from the user's
history strictly before it (in the log's sort order), at most `max_seq_len`
events, the most recent kept. The history of an example with target event t
and history length h is the log rows `[t - h, t)`; a user's first event has an
empty history (h = 0) and stays an example. Events that share the target's
timestamp but sort before it (smaller item id, then earlier line) belong to
its history, with age 0. Nothing is copied per example: a
batch gathers its rows from the log (`gem_jax.data.collate`).

Two ways to define candidates and labels:
- `rating_examples` (MovieLens): the candidate is the rated item; one label per
  rating threshold (ml-latest-small: >= 4 and >= 4.5; 100K: >= 4 and >= 5).
- `next_item_examples` (implicit data such as Amazon Beauty): the candidate is
  the true next item half of the time and a seeded sampled item otherwise;
  two labels: "the candidate is the next item", "the candidate is among the
  user's next `window` items".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gem_jax.data.events import EventLog
from gem_jax.data.split import Split


@dataclasses.dataclass(frozen=True)
class Examples:
    """E examples over an `EventLog`.

    Attributes:
      target_event: int64 `[E]` log index of each example's target event.
      history_length: int32 `[E]` events of history, rows `[target - h, target)`.
      candidate: int32 `[E]` candidate item id.
      labels: float32 `[E, K]` in {0, 1}, one column per task.
    """

    target_event: np.ndarray
    history_length: np.ndarray
    candidate: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.target_event.shape[0])


def item_mean_labels(examples: Examples, num_items: int) -> np.ndarray:
    """float32 `[num_items, K]`: mean label per candidate item; the overall mean where unseen."""
    counts = np.bincount(examples.candidate, minlength=num_items)
    num_tasks = examples.labels.shape[1]
    table = np.empty((num_items, num_tasks), np.float32)
    for k in range(num_tasks):
        sums = np.bincount(examples.candidate, weights=examples.labels[:, k], minlength=num_items)
        overall = examples.labels[:, k].mean() if len(examples) else 0.0
        table[:, k] = np.where(counts > 0, sums / np.maximum(counts, 1), overall)
    return table


def history_lengths(log: EventLog, targets: np.ndarray, max_seq_len: int) -> np.ndarray:
    """int32 `[E]`: events of the target's user before it, capped at `max_seq_len`."""
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    before = targets - log.user_offsets[log.user[targets]]
    return np.minimum(before, max_seq_len).astype(np.int32)


def rating_examples(log: EventLog, targets: np.ndarray, *, max_seq_len: int, thresholds: tuple[float, ...]) -> Examples:
    """Examples whose candidate is the target's item and whose labels threshold its rating.

    Args:
      log: a sorted `EventLog` with ratings.
      targets: int64 `[E]` target event indices.
      max_seq_len: history bound.
      thresholds: label k is `rating >= thresholds[k]`.

    Raises:
      ValueError: a target without a rating (NaN).
    """
    targets = np.asarray(targets, dtype=np.int64)
    rating = log.rating[targets]
    if np.isnan(rating).any():
        raise ValueError(f"{log.name}: rating examples need ratings; event {int(targets[np.isnan(rating)][0])} has none")
    labels = np.stack([rating >= threshold for threshold in thresholds], axis=1)
    return Examples(
        target_event=targets,
        history_length=history_lengths(log, targets, max_seq_len),
        candidate=log.item[targets],
        labels=labels.astype(np.float32),
    )


def next_item_examples(
    log: EventLog,
    split: Split,
    targets: np.ndarray,
    *,
    max_seq_len: int,
    seed: int | tuple[int, ...],
    window: int = 5,
    positive_fraction: float = 0.5,
    near_future_fraction: float = 0.5,
) -> Examples:
    """Sampled-candidate next-item examples for implicit feedback.

    For target event t of a user, the candidate is `item[t]` with probability
    `positive_fraction`; otherwise, with probability `near_future_fraction`, an
    item drawn uniformly from the user's events (t, t + window) (when there are
    any), else an item drawn uniformly from the whole catalogue. Labels come
    from the items actually at those positions: label 0 = candidate == item[t];
    label 1 = candidate in item[t : t + window]. Near-future negatives make label 1
    differ from label 0 (about a quarter of the train examples are positives of
    label 1 alone). The future window of a
    train target stops at the user's first eval event (`Split.horizon`), so
    held-out events never shape a training label. A user's last events have no
    near future, so their label 1 mostly equals label 0. This follows the
    sampled-negative protocol of implicit-feedback recommenders (Rendle et al.,
    BPR 2009; SASRec 2018), made deterministic by `seed`.

    Args:
      log: a sorted `EventLog`.
      split: the split `targets` come from.
      targets: int64 `[E]` target event indices.
      max_seq_len: history bound.
      seed: seed (or seed tuple) of the candidate sampling (same seed, same examples).
      window: length of label 1's window, >= 1.
      positive_fraction, near_future_fraction: sampling probabilities in [0, 1].

    Raises:
      ValueError: a bad `window` or probability.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    for name, p in (("positive_fraction", positive_fraction), ("near_future_fraction", near_future_fraction)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p}")
    targets = np.asarray(targets, dtype=np.int64)
    rng = np.random.default_rng(seed)
    end = np.minimum(split.horizon(log.user[targets], targets), targets + window)  # window [t, end)
    num_future = end - targets - 1
    uniform = rng.integers(1, log.num_items, size=targets.shape[0])
    near_offset = 1 + np.floor(rng.random(targets.shape[0]) * np.maximum(num_future, 1)).astype(np.int64)
    near = log.item[np.minimum(targets + near_offset, log.num_events - 1)]
    use_near = (rng.random(targets.shape[0]) < near_future_fraction) & (num_future > 0)
    positive = rng.random(targets.shape[0]) < positive_fraction
    candidate = np.where(positive, log.item[targets], np.where(use_near, near, uniform)).astype(np.int32)

    in_window = np.zeros(targets.shape[0], bool)
    for k in range(window):
        rows = np.minimum(targets + k, log.num_events - 1)
        in_window |= (targets + k < end) & (log.item[rows] == candidate)
    labels = np.stack([candidate == log.item[targets], in_window], axis=1)
    return Examples(
        target_event=targets,
        history_length=history_lengths(log, targets, max_seq_len),
        candidate=candidate,
        labels=labels.astype(np.float32),
    )
