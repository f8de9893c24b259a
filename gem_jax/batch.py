"""The batch structure every data source produces and the model consumes.

A `Batch` holds B examples with static shapes: the jagged behaviour histories
(packed into a bucketed token capacity), the user and candidate features, two
binary labels and a per-example weight (0 for the padding examples that fill the
last batch of an epoch to the static B, so nothing is dropped and nothing is
counted twice).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.jagged import Jagged, from_lengths

PAD_ID = 0  # reserved id in every vocabulary: padding / unknown


class HistoryField(enum.IntEnum):
    """Columns of `Batch.history.values` (int32 `[T_cap, 3]`)."""

    ITEM = 0  # remapped item id, 1..num_items-1
    ACTION = 1  # action / rating bucket, 1..num_actions-1
    TIME_BUCKET = 2  # log-scaled age of the event relative to the target, 1..num_time_buckets-1


class UserField(enum.IntEnum):
    """Columns of `Batch.user` (int32 `[B, 4]`); PAD_ID where a data set lacks the feature."""

    USER = 0
    AGE = 1
    GENDER = 2
    OCCUPATION = 3


class Task(enum.IntEnum):
    """Columns of `Batch.labels` (float32 `[B, 2]`); the meaning is per data set (see README)."""

    PRIMARY = 0
    SECONDARY = 1


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """Vocabulary sizes (each includes PAD_ID = 0) and the history bound of a data set."""

    num_items: int
    num_users: int
    num_actions: int
    num_time_buckets: int
    num_genres: int  # width of the multi-hot candidate side features (>= 1)
    num_ages: int = 1
    num_genders: int = 1
    num_occupations: int = 1
    max_seq_len: int = 200

    def user_vocab_sizes(self) -> tuple[int, int, int, int]:
        """Vocabulary size of each `UserField` column, in order."""
        return (self.num_users, self.num_ages, self.num_genders, self.num_occupations)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One static-shape batch of B examples.

    Attributes:
      history: `Jagged` with int32 values `[T_cap, 3]` (`HistoryField` columns) and
        offsets `[B+1]`: each example's events before its target, oldest first,
        at most `max_seq_len` (the most recent kept).
      user: int32 `[B, 4]` (`UserField` columns).
      candidate_item: int32 `[B]` the item whose outcome is predicted.
      candidate_genres: float32 `[B, num_genres]` multi-hot side features.
      labels: float32 `[B, 2]` in {0, 1} (`Task` columns).
      weights: float32 `[B]`: 1 for real examples, 0 for padding examples.
    """

    history: Jagged
    user: jax.Array
    candidate_item: jax.Array
    candidate_genres: jax.Array
    labels: jax.Array
    weights: jax.Array

    @property
    def batch_size(self) -> int:
        return self.candidate_item.shape[0]


def random_batch(spec: FeatureSpec, rng: np.random.Generator, lengths, capacity: int, *, slack_value: int = 0) -> Batch:
    """A `Batch` of random in-vocabulary ids and labels, for trying a model (and for tests).

    Ids are uniform over each vocabulary without the padding id 0 (a vocabulary of the padding
    id alone, such as `FeatureSpec`'s default `num_ages=1`, gives `PAD_ID` everywhere), genres
    multi-hot with probability 0.4, labels fair coins, every weight 1.

    Args:
      spec: the vocabularies.
      rng: numpy generator (its draws, in order: history items, actions, time buckets, user
        fields, candidate items, genres, labels; none for a padding-only vocabulary).
      lengths: int `[B]` history length of each example (each <= `spec.max_seq_len`).
      capacity: token rows `T_cap` of the history (>= sum(lengths)).
      slack_value: id written into every column of the slack rows past the last history.

    Returns:
      A `Batch` of B examples (jax arrays).

    Raises:
      ValueError: a vocabulary size below 1 (it must hold the padding id), or from
        `gem_jax.jagged.from_lengths` (lengths over capacity or max_seq_len).
    """
    lengths = np.asarray(lengths)
    b, t = len(lengths), int(lengths.sum())

    def ids(name: str, vocab: int, size: int) -> np.ndarray:
        if vocab < 1:
            raise ValueError(f"random_batch: the {name} vocabulary has size {vocab}; it holds at least the padding id {PAD_ID}")
        return rng.integers(PAD_ID + 1, vocab, size) if vocab > 1 else np.full(size, PAD_ID)

    history_vocabs = {"item": spec.num_items, "action": spec.num_actions, "time bucket": spec.num_time_buckets}
    values = np.stack([ids(name, vocab, t) for name, vocab in history_vocabs.items()], 1)
    history = from_lengths(values, lengths, max_seq_len=spec.max_seq_len, capacity=capacity)
    history = history.replace_values(history.values.at[t:].set(slack_value))
    user = [ids(f"user {field.name.lower()}", vocab, b) for field, vocab in zip(UserField, spec.user_vocab_sizes())]
    return Batch(
        history=history,
        user=jnp.asarray(np.stack(user, 1), jnp.int32),
        candidate_item=jnp.asarray(ids("item", spec.num_items, b), jnp.int32),
        candidate_genres=jnp.asarray(rng.random((b, spec.num_genres)) < 0.4, jnp.float32),
        labels=jnp.asarray(rng.random((b, 2)) < 0.5, jnp.float32),
        weights=jnp.ones((b,), jnp.float32),
    )


def validate_ids(batch: Batch, spec: FeatureSpec, *, where: str = "batch") -> None:
    """Checks on the host that every id is inside its vocabulary.

    Out-of-range ids would otherwise be clamped or read as NaN by the gather.

    Raises:
      ValueError: naming the feature, the example (or history row) and the id.
    """
    hist = np.asarray(batch.history.values)[: int(np.asarray(batch.history.offsets)[-1])]
    checks = [
        ("history item", hist[:, HistoryField.ITEM], spec.num_items),
        ("history action", hist[:, HistoryField.ACTION], spec.num_actions),
        ("history time bucket", hist[:, HistoryField.TIME_BUCKET], spec.num_time_buckets),
        ("candidate item", np.asarray(batch.candidate_item), spec.num_items),
    ]
    user = np.asarray(batch.user)
    for field, size in zip(UserField, spec.user_vocab_sizes()):
        checks.append((f"user {field.name.lower()}", user[:, field], size))
    for name, ids, size in checks:
        bad = np.flatnonzero((ids < 0) | (ids >= size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{where}: {name} id {int(ids[i])} at index {i} is outside the vocabulary [0, {size})")


@dataclasses.dataclass(frozen=True)
class BatchShard:
    """The per-device chunks of every global batch that one process builds.

    Data parallelism cuts a global batch of B examples into D contiguous chunks of
    B/D examples, chunk d for the device at position d of the batch sharding
    (`gem_jax.parallel.placement`). In a multi-process run each process builds only
    the chunks of its own devices.

    Attributes:
      num_chunks: D, the devices a global batch is split over.
      chunks: the chunk indices this process builds, ascending, each in [0, D).

    Raises:
      ValueError: D < 1, or `chunks` empty, unsorted, repeated or outside [0, D).
    """

    num_chunks: int
    chunks: tuple[int, ...]

    def __post_init__(self):
        chunks = tuple(int(c) for c in self.chunks)
        object.__setattr__(self, "chunks", chunks)
        if isinstance(self.num_chunks, bool) or not isinstance(self.num_chunks, (int, np.integer)) or self.num_chunks < 1:
            raise ValueError(f"BatchShard.num_chunks must be a positive int, got {self.num_chunks!r}")
        if not chunks or list(chunks) != sorted(set(chunks)) or chunks[0] < 0 or chunks[-1] >= self.num_chunks:
            raise ValueError(f"BatchShard.chunks must be distinct ascending indices in [0, {self.num_chunks}), got {chunks}")

    @classmethod
    def whole(cls, num_chunks: int) -> BatchShard:
        """Every chunk: the shard of a single-process run."""
        return cls(num_chunks, tuple(range(num_chunks)))


@dataclasses.dataclass(frozen=True)
class LocalBatch:
    """One process's part of a global batch, and the global facts every process shares.

    Every process knows the example indices and history lengths of each whole
    global batch (they come from the shuffle seed and the data set's metadata, not
    from reading the examples), so all of them choose the same static token
    capacity and count the same real examples without communicating.

    Attributes:
      batch: the host `Batch` of `shard.chunks`, chunk after chunk:
        `len(shard.chunks) * B / D` examples; its real examples come first.
      shard: which chunks `batch` holds.
      lengths: int64 `[B]`: the history rows of every example of the global
        batch, in global order; 0 for padding examples.
      num_real: real examples of the global batch; they hold positions
        `0 .. num_real - 1`, the padding examples (weight 0) the rest.
    """

    batch: Batch
    shard: BatchShard
    lengths: np.ndarray
    num_real: int

    @property
    def global_batch_size(self) -> int:
        """B, the examples of the global batch."""
        return int(self.lengths.shape[0])

    @property
    def real(self) -> np.ndarray:
        """bool `[B]`: which examples of the global batch are real."""
        return np.arange(self.global_batch_size) < self.num_real

    def chunk_rows(self) -> np.ndarray:
        """int64 `[D]`: history rows of each chunk of the global batch."""
        return self.lengths.reshape(self.shard.num_chunks, -1).sum(axis=1)
