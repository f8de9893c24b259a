"""Gather examples into `Batch`es of B examples whose history holds exactly its real rows.

A batch always has its static number of examples (B, or one process's share of
B, `gem_jax.data.shard`): a short list, or none, is completed with padding
examples (weight 0, empty history, PAD_ID everywhere). The packed history has
no slack rows (`T_cap` = the real rows): the static, bucketed capacities a
jitted step sees are chosen once, per device, when the batch is placed
(`gem_jax.parallel.placement.stack_batch` with the data set's
`gem_jax.jagged.TokenBuckets`), so rows are packed into a capacity only once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gem_jax.batch import PAD_ID, Batch, CategoricalFeature, FeatureSpec, HistoryField, validate_ids
from gem_jax.data.events import EventLog
from gem_jax.data.examples import Examples
from gem_jax.data.features import time_bucket
from gem_jax.jagged import Jagged, JaggedError



def batch_indices(indices: Sequence[int], batch_size: int, num_examples: int | None = None) -> np.ndarray:
    """The example indices of a batch of `batch_size` examples as int64 `[n]`, n <= batch_size.

    Raises:
      ValueError: more than `batch_size` indices, or (with `num_examples`) an index
        outside `[0, num_examples)`.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.shape[0] > batch_size:
        raise ValueError(f"a batch takes at most {batch_size} examples, got {idx.shape[0]}")
    if num_examples is not None and idx.size and (idx.min() < 0 or idx.max() >= num_examples):
        raise ValueError(f"example index out of range [0, {num_examples}): {idx.min()}..{idx.max()}")
    return idx


def padded_offsets(lengths: np.ndarray, batch_size: int) -> np.ndarray:
    """int32 offsets `[batch_size + 1]` of the histories `lengths` `[n]`, then empty padding examples."""
    n = len(lengths)
    offsets = np.zeros(batch_size + 1, np.int32)
    np.cumsum(lengths, out=offsets[1 : n + 1])
    offsets[n + 1 :] = offsets[n]
    return offsets


def feature_ids(feature: CategoricalFeature, batch_size: int, ids: np.ndarray) -> np.ndarray:
    """int32 `[batch_size, max_values]`: `ids` `[n, max_values]` of the real examples, then PAD rows."""
    out = np.full((batch_size, feature.max_values), PAD_ID, np.int32)
    out[: ids.shape[0]] = ids
    return out


def check_history_lengths(history_length: np.ndarray, spec: FeatureSpec) -> None:
    """Raises `JaggedError` when an example's history (int `[E]` lengths) is longer than `spec.max_seq_len`."""
    if int(history_length.max(initial=0)) > spec.max_seq_len:
        raise JaggedError(f"an example history is longer than max_seq_len {spec.max_seq_len}")


def log_spec(
    log: EventLog, tasks: tuple[str, ...], *, num_time_buckets: int, max_seq_len: int, history_item_features: bool = False
) -> FeatureSpec:
    """The `FeatureSpec` of batches built from `log`: the user id (feature "user") and the log's side features
    (with `history_item_features`, the item features in the history rows too)."""
    return FeatureSpec(
        num_items=log.num_items,
        num_actions=log.num_actions,
        num_time_buckets=num_time_buckets,
        tasks=tasks,
        user_features=(CategoricalFeature("user", log.num_users),) + tuple(t.feature for t in log.user_features),
        item_features=tuple(t.feature for t in log.item_features),
        max_seq_len=max_seq_len,
        history_item_features=history_item_features,
    )


class BatchBuilder:
    """Builds a `Batch` from a list of example indices (grain's `batch_fn`).

    Each call gathers the examples' history rows from the event log with
    vectorised numpy indexing (no per-example Python work), computes time
    buckets relative to each target, pads to B examples, and validates the
    ids against `spec`.

    Args:
      log: the sorted `EventLog`.
      examples: the examples indexed by the calls.
      spec: `log_spec(log, ...)`: the layout (ids are validated against it).
      batch_size: static B.
    """

    def __init__(self, log: EventLog, examples: Examples, spec: FeatureSpec, batch_size: int):
        check_history_lengths(examples.history_length, spec)
        self.log = log
        self.examples = examples
        self.spec = spec
        self.batch_size = batch_size

    def __call__(self, indices: Sequence[int], batch_size: int | None = None) -> Batch:
        """Returns the `Batch` of examples `indices`, then padding examples up to the batch size.

        The history values are `[offsets[b], F]`: the real rows, no slack.

        Args:
          indices: 0..b example indices (none: a batch of padding only, as one
            process's part of an epoch's last batch can be).
          batch_size: b, the examples of the batch (default: B).

        Raises:
          ValueError: more than b indices, or an index out of range.
        """
        b = self.batch_size if batch_size is None else batch_size
        idx = batch_indices(indices, b, len(self.examples))
        log, ex = self.log, self.examples
        target = ex.target_event[idx]
        user_id = log.user[target]
        candidate = ex.candidate[idx]
        return assemble_batch(
            self.spec,
            b,
            item=log.item,
            action=log.action,
            timestamp=log.timestamp,
            target=target,
            lengths=ex.history_length[idx],
            user={"user": user_id[:, None]} | {t.feature.name: t.ids[user_id] for t in log.user_features},
            candidate=candidate,
            item_features={t.feature.name: t.ids for t in log.item_features},
            labels=ex.labels[idx],
            weights=np.ones(idx.shape[0], np.float32),
        )


def assemble_batch(
    spec: FeatureSpec,
    batch_size: int,
    *,
    item: np.ndarray,
    action: np.ndarray,
    timestamp: np.ndarray,
    target: np.ndarray,
    lengths: np.ndarray,
    user: dict[str, np.ndarray],
    candidate: np.ndarray,
    item_features: dict[str, np.ndarray],
    labels: np.ndarray,
    weights: np.ndarray,
) -> Batch:
    """The validated `Batch` of n examples, then `batch_size - n` padding examples.

    Example i's history is the events `[target[i] - lengths[i], target[i])` of the
    event columns, oldest first, each with its time bucket relative to the target;
    the history values are `[sum(lengths), F]`: the real rows, no slack.

    Args:
      spec: the layout (ids are validated against it).
      batch_size: b >= n.
      item, action: int32 `[N]` event columns; timestamp: int64 `[N]`, non-decreasing
        within each history and up to its target.
      target: int64 `[n]` event index of each example's target.
      lengths: int `[n]` history length of each example (<= target, within its user).
      user: int32 `[n, max_values]` per user feature of `spec`, by name.
      candidate: int32 `[n]` candidate items.
      item_features: int32 `[items, max_values]` per item feature of `spec`, by name: each
        item's ids (row `i` item `i`'s), for the candidates and the history rows.
      labels: float32 `[n, K]`.
      weights: float32 `[n]` loss weights of the real examples (padding examples get 0).

    Raises:
      ValueError: an id outside its vocabulary, or a field of the wrong layout
        (`gem_jax.batch.validate_ids`).
    """
    b, n = batch_size, target.shape[0]
    lengths = np.asarray(lengths, np.int64)
    offsets = padded_offsets(lengths, b)
    total = int(offsets[n])
    rows = np.repeat(target - lengths - offsets[:n], lengths) + np.arange(total)
    values = np.zeros((total, spec.history_width), np.int32)
    values[:, HistoryField.ITEM] = item[rows]
    values[:, HistoryField.ACTION] = action[rows]
    age = np.repeat(timestamp[target], lengths) - timestamp[rows]
    values[:, HistoryField.TIME_BUCKET] = time_bucket(age, spec.num_time_buckets)
    for name, columns in spec.history_feature_columns.items():
        values[:, columns] = item_features[name][values[:, HistoryField.ITEM]]

    padded_candidate = np.full(b, PAD_ID, np.int32)
    padded_candidate[:n] = candidate
    padded_labels = np.zeros((b, spec.num_tasks), np.float32)
    padded_labels[:n] = labels
    padded_weights = np.zeros(b, np.float32)
    padded_weights[:n] = weights
    batch = Batch(
        history=Jagged(values, offsets, spec.max_seq_len),
        user={f.name: feature_ids(f, b, user[f.name]) for f in spec.user_features},
        candidate_item=padded_candidate,
        candidate_features={f.name: feature_ids(f, b, item_features[f.name][candidate]) for f in spec.item_features},
        labels=padded_labels,
        weights=padded_weights,
    )
    validate_ids(batch, spec)
    return batch
