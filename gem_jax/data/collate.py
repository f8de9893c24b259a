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



def batch_indices(indices: Sequence[int], batch_size: int) -> np.ndarray:
    """The example indices of a batch of `batch_size` examples as int64 `[n]`, n <= batch_size.

    Raises:
      ValueError: more than `batch_size` indices.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.shape[0] > batch_size:
        raise ValueError(f"a batch takes at most {batch_size} examples, got {idx.shape[0]}")
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


def log_spec(log: EventLog, tasks: tuple[str, ...], *, num_time_buckets: int, max_seq_len: int) -> FeatureSpec:
    """The `FeatureSpec` of batches built from `log`: the user id (feature "user") and the log's side features."""
    return FeatureSpec(
        num_items=log.num_items,
        num_actions=log.num_actions,
        num_time_buckets=num_time_buckets,
        tasks=tasks,
        user_features=(CategoricalFeature("user", log.num_users),) + tuple(t.feature for t in log.user_features),
        item_features=tuple(t.feature for t in log.item_features),
        max_seq_len=max_seq_len,
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
        if int(examples.history_length.max(initial=0)) > spec.max_seq_len:
            raise JaggedError(f"an example history is longer than max_seq_len {spec.max_seq_len}")
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
        idx = batch_indices(indices, b)
        n = idx.shape[0]
        if n and (idx.min() < 0 or idx.max() >= len(self.examples)):
            raise ValueError(f"example index out of range [0, {len(self.examples)}): {idx.min()}..{idx.max()}")
        log, ex = self.log, self.examples
        target = ex.target_event[idx]
        lengths = ex.history_length[idx].astype(np.int64)
        offsets = padded_offsets(lengths, b)
        total = int(offsets[n])

        rows = np.repeat(target - lengths - offsets[:n], lengths) + np.arange(total)
        values = np.zeros((total, len(HistoryField)), np.int32)
        values[:total, HistoryField.ITEM] = log.item[rows]
        values[:total, HistoryField.ACTION] = log.action[rows]
        age = np.repeat(log.timestamp[target], lengths) - log.timestamp[rows]
        values[:total, HistoryField.TIME_BUCKET] = time_bucket(age, self.spec.num_time_buckets)

        user_id = log.user[target]
        user = {"user": feature_ids(self.spec.user_features[0], b, user_id[:, None])}
        user |= {t.feature.name: feature_ids(t.feature, b, t.ids[user_id]) for t in log.user_features}
        candidate = np.full(b, PAD_ID, np.int32)
        candidate[:n] = ex.candidate[idx]
        features = {t.feature.name: feature_ids(t.feature, b, t.ids[candidate[:n]]) for t in log.item_features}
        labels = np.zeros((b, self.spec.num_tasks), np.float32)
        labels[:n] = ex.labels[idx]
        weights = np.zeros(b, np.float32)
        weights[:n] = 1.0
        batch = Batch(
            history=Jagged(values, offsets, self.spec.max_seq_len),
            user=user,
            candidate_item=candidate,
            candidate_features=features,
            labels=labels,
            weights=weights,
        )
        validate_ids(batch, self.spec)
        return batch
