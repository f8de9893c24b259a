"""Synthetic batches with the real `Batch` structure, for benchmarks at any scale.

Every example is a pure function of (seed, stream, example index): a
counter-based hash (SplitMix64, Steele et al., "Fast splittable pseudorandom
number generators", OOPSLA 2014) turns those keys into its fields, so batches
are reproducible, need no stored data, and a shuffled, checkpointed grain
pipeline over example indices works as it does for real data.

- History lengths are lognormal, `floor(median * exp(sigma * z))` clipped to
  [0, max_seq_len]: a long tail like real behaviour logs (ml-latest-small's
  longest history is 38x its median). Some histories are empty.
- History items, actions, users and the user features "age", "gender" and
  "occupation" are uniform over their vocabularies; time buckets grow with the
  distance from the end of the history (older events, larger buckets), as in
  real data.
- Each item has a fixed logit `1.5 * N(0, 1)` and 15% of the genres (item
  feature "genres", `Pooling.MULTI_HOT`, up to `num_genres` values);
  task "click" ~ Bernoulli(sigmoid(logit of the candidate)), "convert" = click
  and a fair coin. Labels depend on the candidate only: a source for speed
  measurements, not a learning task.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gem_jax.batch import Batch, CategoricalFeature, FeatureSpec, HistoryField, Pooling, validate_ids
from gem_jax.data.collate import batch_indices, feature_ids, padded_offsets
from gem_jax.data.config import SyntheticConfig
from gem_jax.data.features import NUM_HALF_STAR_ACTIONS, multi_hot_ids, time_bucket
from gem_jax.jagged import Jagged

SYNTHETIC_USER_FEATURES = (("age", 8), ("gender", 3), ("occupation", 22))  # (name, vocabulary size) besides the user id
SYNTHETIC_TASKS = (("click", "Bernoulli(sigmoid(item logit))"), ("convert", "click and a fair coin"))
ITEM_LOGIT_SCALE = 1.5
GENRE_PROBABILITY = 0.15
TRAIN_STREAM, EVAL_STREAM = 0, 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _hash(*keys) -> np.ndarray:
    """uint64 hash of broadcast integer key arrays."""
    h = np.uint64(0)
    for key in keys:
        h = _splitmix(h ^ np.asarray(key).astype(np.uint64))
    return h


def _uniform(*keys) -> np.ndarray:
    """float64 in [0, 1) from keys."""
    return (_hash(*keys) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _ids(vocab_size: int, *keys) -> np.ndarray:
    """int32 ids uniform in 1..vocab_size-1 from keys."""
    return (1 + _hash(*keys) % np.uint64(vocab_size - 1)).astype(np.int32)


def _normal(*keys) -> np.ndarray:
    """Standard normal from keys (Box-Muller)."""
    u1 = _uniform(*keys, 0)
    u2 = _uniform(*keys, 1)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


def synthetic_spec(config: SyntheticConfig, max_seq_len: int, num_time_buckets: int) -> FeatureSpec:
    """The `FeatureSpec` of synthetic batches."""
    return FeatureSpec(
        num_items=config.num_items,
        num_actions=NUM_HALF_STAR_ACTIONS,
        num_time_buckets=num_time_buckets,
        tasks=tuple(name for name, _ in SYNTHETIC_TASKS),
        user_features=(CategoricalFeature("user", config.num_users),)
        + tuple(CategoricalFeature(name, size) for name, size in SYNTHETIC_USER_FEATURES),
        item_features=(CategoricalFeature("genres", config.num_genres + 1, config.num_genres, Pooling.MULTI_HOT),),
        max_seq_len=max_seq_len,
    )


def synthetic_lengths(seed: int, stream: int, indices: np.ndarray, config: SyntheticConfig, max_seq_len: int) -> np.ndarray:
    """int64 `[n]` history lengths of examples `indices`: lognormal, clipped to [0, max_seq_len]."""
    median = config.median_length_fraction * max_seq_len
    raw = np.floor(median * np.exp(config.length_sigma * _normal(seed, stream, indices, 0)))
    return np.clip(raw, 0, max_seq_len).astype(np.int64)


def item_logits(seed: int, items: np.ndarray) -> np.ndarray:
    """float64 `[n]` fixed per-item label logits."""
    return ITEM_LOGIT_SCALE * _normal(seed, 2, items)


class SyntheticBatchBuilder:
    """Builds the `Batch` of synthetic examples `indices` of one stream.

    Args:
      config: the synthetic source's shape.
      spec: `synthetic_spec(config, ...)`.
      batch_size: static B.
      seed: the data set seed.
      stream: `TRAIN_STREAM` or `EVAL_STREAM` (disjoint example sets).
    """

    def __init__(self, config: SyntheticConfig, spec: FeatureSpec, batch_size: int, seed: int, stream: int):
        self.config = config
        self.spec = spec
        self.batch_size = batch_size
        self.seed = seed
        self.stream = stream

    def __call__(self, indices: Sequence[int], batch_size: int | None = None) -> Batch:
        """Returns the `Batch` of examples `indices`, then padding examples up to the batch size.

        The history values are `[offsets[b], F]`: the real rows, no slack
        (`gem_jax.data.collate`).

        Args:
          indices: 0..b example indices (none: a batch of padding only).
          batch_size: b, the examples of the batch (default: B).

        Raises:
          ValueError: more than b indices.
        """
        b = self.batch_size if batch_size is None else batch_size
        idx = batch_indices(indices, b)
        n, spec, s, t = idx.shape[0], self.spec, self.seed, self.stream
        lengths = synthetic_lengths(s, t, idx, self.config, spec.max_seq_len)
        offsets = padded_offsets(lengths, b)
        total = int(offsets[n])

        example = np.repeat(idx, lengths)
        position = np.arange(total) - np.repeat(offsets[:n].astype(np.int64), lengths)
        values = np.zeros((total, len(HistoryField)), np.int32)
        values[:total, HistoryField.ITEM] = _ids(spec.num_items, s, t, example, position, 1)
        values[:total, HistoryField.ACTION] = _ids(spec.num_actions, s, t, example, position, 2)
        values[:total, HistoryField.TIME_BUCKET] = time_bucket(np.repeat(lengths, lengths) - 1 - position, spec.num_time_buckets)

        user_feature, *side = spec.user_features
        user_id = _ids(user_feature.vocab_size, s, t, idx, 3)
        user = {user_feature.name: feature_ids(user_feature, b, user_id[:, None])}
        for field, feature in enumerate(side, start=1):  # hash key 1, 2, 3: one stream per feature
            user[feature.name] = feature_ids(feature, b, _ids(feature.vocab_size, s, 4, user_id, field)[:, None])
        candidate = np.zeros(b, np.int32)
        candidate[:n] = _ids(spec.num_items, s, t, idx, 5)
        genres = spec.item_features[0]
        hot = _uniform(s, 6, candidate[:n, None], np.arange(genres.max_values)[None, :]) < GENRE_PROBABILITY
        click = _uniform(s, t, idx, 7) < 1.0 / (1.0 + np.exp(-item_logits(s, candidate[:n])))
        labels = np.zeros((b, spec.num_tasks), np.float32)
        labels[:n, 0] = click
        labels[:n, 1] = click & (_uniform(s, t, idx, 8) < 0.5)
        weights = np.zeros(b, np.float32)
        weights[:n] = 1.0
        batch = Batch(
            history=Jagged(values, offsets, spec.max_seq_len),
            user=user,
            candidate_item=candidate,
            candidate_features={genres.name: feature_ids(genres, b, multi_hot_ids(hot, genres.max_values))},
            labels=labels,
            weights=weights,
        )
        validate_ids(batch, spec)
        return batch


def synthetic_item_mean_labels(seed: int, num_items: int) -> np.ndarray:
    """float32 `[num_items, 2]`: the expected label of each task for each candidate item (row PAD_ID: 0)."""
    p = 1.0 / (1.0 + np.exp(-item_logits(seed, np.arange(num_items))))
    table = np.stack([p, 0.5 * p], axis=1).astype(np.float32)
    table[0] = 0.0
    return table
