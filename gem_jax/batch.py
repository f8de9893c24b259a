"""The batch structure every data source produces and the model consumes.

A `FeatureSpec` is a data set's schema: its vocabularies, the user features and the
candidate item's side features (`CategoricalFeature`, any number of each), the names
of its binary tasks and the history bound. A `Batch` holds B examples in that layout,
with static shapes: the jagged behaviour histories (packed into a bucketed token
capacity), one id array per feature, one label per task and a per-example weight (0
for the padding examples that fill the last batch of an epoch to the static B, so
nothing is dropped and nothing is counted twice).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.jagged import Jagged, from_lengths

PAD_ID = 0  # reserved id in every vocabulary: padding / unknown
NAME_PATTERN = re.compile(r"[A-Za-z0-9_]+")  # feature and task names: they name metrics (`auc_<task>`) and parameters


class HistoryField(enum.IntEnum):
    """The first columns of `Batch.history.values` (int32 `[T_cap, FeatureSpec.history_width]`).

    A spec with `history_item_features` adds, after these three, each history
    event's item features (`FeatureSpec.history_feature_columns`).
    """

    ITEM = 0  # remapped item id, 1..num_items-1
    ACTION = 1  # action / rating bucket, 1..num_actions-1
    TIME_BUCKET = 2  # log-scaled age of the event relative to the target, 1..num_time_buckets-1


class Pooling(enum.Enum):
    """How the model turns a feature's ids `[B, max_values]` into one token `[B, d]`.

    MEAN: the mean of the embedding-table rows of the non-pad ids (a repeated id counts
      once per value); a row of PAD ids only gets PAD's own (learned) row. With
      `max_values` 1 this is the id's row. The table is an embedding table (sparse
      optimizer, shardable), so any vocabulary size fits.
    MULTI_HOT: the ids as a set, a multi-hot vector over the vocabulary without PAD
      divided by its count, through a dense layer with bias (dense optimizer). The
      layer and the multi-hot are `vocabulary x d` and `B x vocabulary`: for small
      vocabularies (genres, categories).
    """

    MEAN = "mean"
    MULTI_HOT = "multi_hot"


@dataclasses.dataclass(frozen=True)
class CategoricalFeature:
    """A categorical feature of the user or of the candidate item.

    Attributes:
      name: letters, digits and `_`; it names the feature's table (`embed/user/<name>`,
        `embed/item_features/<name>`) and its batch entry.
      vocab_size: ids `[0, vocab_size)`, PAD_ID = 0 included (>= 1; 1: PAD only).
      max_values: ids per example (>= 1): a multi-valued feature (> 1) pads each row with
        PAD_ID up to `max_values`.
      pooling: how the model pools the ids (`Pooling`); MULTI_HOT needs vocab_size >= 2.

    Raises:
      ValueError: a field outside the ranges above (feature named).
    """

    name: str
    vocab_size: int
    max_values: int = 1
    pooling: Pooling = Pooling.MEAN

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
            raise ValueError(f"feature name {self.name!r} must be letters, digits and '_'")
        for field, minimum in (("vocab_size", 2 if self.pooling is Pooling.MULTI_HOT else 1), ("max_values", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"feature {self.name!r}: {field} must be an int >= {minimum}, got {value!r}")
        if not isinstance(self.pooling, Pooling):
            raise ValueError(f"feature {self.name!r}: pooling must be a Pooling, got {self.pooling!r}")


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """A data set's schema: vocabulary sizes (each includes PAD_ID = 0), features, tasks, history bound.

    Attributes:
      num_items, num_actions, num_time_buckets: vocabularies of the history columns
        (`HistoryField`); the item vocabulary is also the candidate's.
      tasks: names of the binary tasks, in `Batch.labels` column order (letters,
        digits, `_`; they name the metrics: `auc_<task>`, `ne_<task>`).
      user_features: one token each; the user id itself is a feature (named "user" by
        the built-in sources).
      item_features: the candidate item's side features, one token each.
      max_seq_len: the longest history.
      history_item_features: each history row also carries its event's item features
        (the same features, vocabularies and tables as the candidate's), as columns
        after the `HistoryField` ones: `max_values` columns per feature, in
        `item_features` order (`history_feature_columns`), PAD_ID where an item has
        fewer values. The model adds their pooled embeddings to the row's token, as
        sequence models feed item side information into the history (Zhou et al.,
        DIN, 2018; Zhai et al., HSTU, 2024). False: the three `HistoryField` columns.

    Raises:
      ValueError: no task, a repeated or malformed task name, a feature name repeated
        on one side, or a vocabulary below 1 (history) / 2 (items).
    """

    num_items: int
    num_actions: int
    num_time_buckets: int
    tasks: tuple[str, ...]
    user_features: tuple[CategoricalFeature, ...] = ()
    item_features: tuple[CategoricalFeature, ...] = ()
    max_seq_len: int = 200
    history_item_features: bool = False

    def __post_init__(self):
        for field in ("tasks", "user_features", "item_features"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        if not self.tasks:
            raise ValueError("FeatureSpec.tasks is empty: a data set has at least one task")
        for task in self.tasks:
            if not isinstance(task, str) or not NAME_PATTERN.fullmatch(task):
                raise ValueError(f"task name {task!r} must be letters, digits and '_'")
        for field, names in (
            ("tasks", self.tasks),
            ("user_features", [f.name for f in self.user_features]),
            ("item_features", [f.name for f in self.item_features]),
        ):
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"FeatureSpec.{field} repeats {repeated}")
        for field in ("num_items", "num_actions", "num_time_buckets", "max_seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"FeatureSpec.{field} must be an int >= 1, got {value!r}")
        if not isinstance(self.history_item_features, bool):
            raise ValueError(f"FeatureSpec.history_item_features must be a bool, got {self.history_item_features!r}")

    @property
    def history_feature_columns(self) -> dict[str, slice]:
        """The history values' columns of each item feature, by name (empty without `history_item_features`)."""
        if not self.history_item_features:
            return {}
        columns, start = {}, len(HistoryField)
        for feature in self.item_features:
            columns[feature.name] = slice(start, start + feature.max_values)
            start += feature.max_values
        return columns

    @property
    def history_width(self) -> int:
        """Columns of `Batch.history.values`: the `HistoryField` ones, then the item features' (`history_feature_columns`)."""
        return len(HistoryField) + sum(c.stop - c.start for c in self.history_feature_columns.values())

    @property
    def num_tasks(self) -> int:
        """K, the labels per example."""
        return len(self.tasks)

    @property
    def num_feature_tokens(self) -> int:
        """Feature tokens of an example: one per user feature, the candidate item, one per item feature."""
        return len(self.user_features) + 1 + len(self.item_features)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One static-shape batch of B examples in the layout of a `FeatureSpec`.

    Attributes:
      history: `Jagged` with int32 values `[T_cap, spec.history_width]` (`HistoryField`
        columns, then the events' item features with `spec.history_item_features`) and
        offsets `[B+1]`: each example's events before its target, oldest first,
        at most `max_seq_len` (the most recent kept).
      user: int32 `[B, max_values]` per user feature, by name (`spec.user_features`).
      candidate_item: int32 `[B]` the item whose outcome is predicted.
      candidate_features: int32 `[B, max_values]` per item feature of the candidate,
        by name (`spec.item_features`).
      labels: float32 `[B, K]` in {0, 1}, one column per task (`spec.tasks` order).
      weights: float32 `[B]` >= 0: each example's weight in the loss, 1 for a real
        example unless its data set weighs them (an event log's weight column,
        `gem_jax.data.sources.converted`), 0 for padding examples.
    """

    history: Jagged
    user: dict[str, jax.Array]
    candidate_item: jax.Array
    candidate_features: dict[str, jax.Array]
    labels: jax.Array
    weights: jax.Array

    @property
    def batch_size(self) -> int:
        return self.candidate_item.shape[0]


_CORE_FIELDS = ("history.offsets", "candidate_item", "labels", "weights")  # the fields B is voted among
_FEATURE_FIELDS = ("user", "candidate_features")  # the dicts of feature arrays, in Batch's order
_LAYOUT_HINT = (
    "history values are (item, action, time bucket) id columns, then with history_item_features the events' item "
    "features, max_values columns each; features [B, max_values], labels [B, tasks]; see gem_jax.Batch"
)


def check_layout(batch: Batch, spec: FeatureSpec, *, where: str = "batch") -> None:
    """Checks every field's shape (and the feature names) against `spec`; works on traced arrays.

    B is the example count most of the four core fields agree on (history.offsets' B + 1 rows,
    candidate_item, labels, weights; history.offsets' on a tie; a field without a leading axis
    gives none), so the fields named are those that disagree with the rest, and features are
    checked against it.

    Raises:
      ValueError: naming, in one message, every wrong field: one that is not an array (a feature
        field that is not a dict of them), a missing or unknown feature, a field of the wrong shape
        (its shape and the expected one), or no example (B = 0, with the count each core field
        gives).
    """
    fields = _layout_fields(batch)
    arrays = {name: x for name, x in fields.items() if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")}
    problems = [f"Batch.{name} is a {type(x).__name__}, not a dict of feature name to array" for name in _FEATURE_FIELDS
                if not isinstance(x := getattr(batch, name), Mapping)]
    problems += [f"Batch.{name} is a {type(x).__name__}, not an array (numpy or jax)" for name, x in fields.items() if name not in arrays]
    problems += _feature_set_problems(batch, spec)
    counts = {name: _example_count(name, arrays.get(name)) for name in _CORE_FIELDS}
    votes = [c for c in counts.values() if c is not None and c >= 0]
    b = max(votes, key=lambda c: (votes.count(c), c == counts["history.offsets"]), default=0)
    shapes = _shape_problems(arrays, spec, b) if b >= 1 else []
    if b < 1:
        shown = ", ".join(f"{name} {'none (not an array)' if c is None else 'none (no leading axis)' if c < 0 else c}" for name, c in counts.items())
        problems.append(f"a batch holds at least one example; the example counts its fields give: {shown}")
    if problems or shapes:
        raise ValueError(f"{where}: " + "; ".join(problems + shapes) + (f" ({_LAYOUT_HINT})" if shapes else ""))


def _example_count(name: str, x) -> int | None:
    """The examples core field `name` (array `x`, or None when it is not one) gives: its rows (history.offsets'
    less one), -1 without a leading axis, None for no array."""
    if x is None:
        return None
    return x.shape[0] - (name == "history.offsets") if x.ndim else -1


def _layout_fields(batch: Batch) -> dict[str, object]:
    """Every field of `batch` by its name in errors (`history.offsets`, `user['age']`, ...), in `Batch`'s order."""
    fields = {"history.offsets": batch.history.offsets, "history.values": batch.history.values, "candidate_item": batch.candidate_item}
    for name in _FEATURE_FIELDS:  # one that is not a dict is named by check_layout
        features = getattr(batch, name)
        fields |= {f"{name}[{k!r}]": v for k, v in features.items()} if isinstance(features, Mapping) else {}
    return fields | {"labels": batch.labels, "weights": batch.weights}


def _feature_set_problems(batch: Batch, spec: FeatureSpec) -> list[str]:
    """A line per feature dict of `batch` (user, candidate_features) whose names are not the spec's, naming the missing and unknown ones."""
    problems = []
    for field, features in zip(_FEATURE_FIELDS, (spec.user_features, spec.item_features)):
        if not isinstance(getattr(batch, field), Mapping):
            continue  # named by check_layout
        given, wanted = set(getattr(batch, field)), {f.name for f in features}
        if given != wanted:
            problems.append(
                f"Batch.{field} holds features {sorted(given)}, the spec {sorted(wanted)} "
                f"(missing {sorted(wanted - given)}, unknown {sorted(given - wanted)})"
            )
    return problems


def _shape_problems(arrays: dict[str, object], spec: FeatureSpec, b: int) -> list[str]:
    """A line per array of `arrays` (`_layout_fields`' names) whose shape is not the one `spec` gives for B = `b`,
    naming both (`T` for the history's token rows, any number); a feature the spec lacks, or `arrays` lacks, is skipped."""
    expected = {
        "history.offsets": (b + 1,),
        "history.values": (None, spec.history_width),
        "candidate_item": (b,),
        **{f"user[{f.name!r}]": (b, f.max_values) for f in spec.user_features},
        **{f"candidate_features[{f.name!r}]": (b, f.max_values) for f in spec.item_features},
        "labels": (b, spec.num_tasks),
        "weights": (b,),
    }
    problems = []
    for name, x in arrays.items():
        want, got = expected.get(name), tuple(x.shape)
        if want is not None and (len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got))):
            problems.append(f"Batch.{name} has shape {got}, expected {tuple('T' if w is None else w for w in want)}")
    return problems


def _random_ids(rng: np.random.Generator, feature: CategoricalFeature, b: int) -> np.ndarray:
    """int32 `[b, max_values]`: uniform non-pad ids (PAD where the vocabulary is PAD only); a
    multi-valued row keeps each value with probability 0.4, the rest PAD."""
    shape = (b, feature.max_values)
    ids = rng.integers(1, feature.vocab_size, shape) if feature.vocab_size > 1 else np.full(shape, PAD_ID)
    if feature.max_values > 1:
        ids = np.where(rng.random(shape) < 0.4, ids, PAD_ID)
    return ids.astype(np.int32)


def random_batch(spec: FeatureSpec, rng: np.random.Generator, lengths, capacity: int, *, slack_value: int = 0) -> Batch:
    """A `Batch` of random in-vocabulary ids and labels, for trying a model (and for tests).

    Ids are uniform over each vocabulary without the padding id 0 (all PAD for a
    vocabulary of PAD alone); a multi-valued feature keeps each of its `max_values`
    values with probability 0.4. Labels are fair coins, every weight 1.

    Args:
      spec: the schema.
      rng: numpy generator (its draws, in order: history items, actions, time buckets,
        user features, candidate items, item features, labels, then the history rows'
        item features with `spec.history_item_features`, drawn like the candidate's).
      lengths: int `[B]` history length of each example (each <= `spec.max_seq_len`).
      capacity: token rows `T_cap` of the history (>= sum(lengths)).
      slack_value: id written into every column of the slack rows past the last history.

    Returns:
      A `Batch` of B examples (jax arrays).

    Raises:
      ValueError: from `gem_jax.jagged.from_lengths` (lengths over capacity or max_seq_len).
    """
    lengths = np.asarray(lengths)
    b, t = len(lengths), int(lengths.sum())
    values = np.stack([rng.integers(1, n, t) if n > 1 else np.zeros(t, np.int64) for n in (spec.num_items, spec.num_actions, spec.num_time_buckets)], 1)
    user = {f.name: jnp.asarray(_random_ids(rng, f, b)) for f in spec.user_features}
    candidate = rng.integers(1, spec.num_items, b) if spec.num_items > 1 else np.zeros(b, np.int64)
    candidate_features = {f.name: jnp.asarray(_random_ids(rng, f, b)) for f in spec.item_features}
    labels = jnp.asarray(rng.random((b, spec.num_tasks)) < 0.5, jnp.float32)
    columns = spec.history_feature_columns
    values = np.concatenate([values, *(_random_ids(rng, f, t) for f in spec.item_features if f.name in columns)], axis=1)
    history = from_lengths(values, lengths, max_seq_len=spec.max_seq_len, capacity=capacity)
    return Batch(
        history=history.replace_values(history.values.at[t:].set(slack_value)),
        user=user,
        candidate_item=jnp.asarray(candidate, jnp.int32),
        candidate_features=candidate_features,
        labels=labels,
        weights=jnp.ones((b,), jnp.float32),
    )


def validate_ids(batch: Batch, spec: FeatureSpec, *, where: str = "batch") -> None:
    """Checks on the host that the layout fits `spec` and every id is inside its vocabulary.

    Out-of-range ids would otherwise be clamped or read as NaN by the gather.

    Raises:
      ValueError: a layout `check_layout` refuses, ids of a non-integer dtype, or an id outside
        its vocabulary (the feature, the example or history row, and the id named).
    """
    check_layout(batch, spec, where=where)
    hist = np.asarray(batch.history.values)[: int(np.asarray(batch.history.offsets)[-1])]
    row, example = "history row", "example"  # what the first index of a check's ids counts
    checks = [
        ("history item", hist[:, HistoryField.ITEM], spec.num_items, row),
        ("history action", hist[:, HistoryField.ACTION], spec.num_actions, row),
        ("history time bucket", hist[:, HistoryField.TIME_BUCKET], spec.num_time_buckets, row),
        ("candidate item", np.asarray(batch.candidate_item), spec.num_items, example),
    ]
    checks += [(f"user feature {f.name!r}", np.asarray(batch.user[f.name]), f.vocab_size, example) for f in spec.user_features]
    checks += [(f"candidate feature {f.name!r}", np.asarray(batch.candidate_features[f.name]), f.vocab_size, example) for f in spec.item_features]
    columns = spec.history_feature_columns
    checks += [(f"history item feature {f.name!r}", hist[:, columns[f.name]], f.vocab_size, row) for f in spec.item_features if f.name in columns]
    for name, ids, size, counted in checks:
        if not np.issubdtype(ids.dtype, np.integer):  # a float id would be truncated (1.9 read as 1, NaN as some id)
            raise ValueError(f"{where}: {name} ids are {ids.dtype}; ids must have an integer dtype (int32)")
        bad = np.argwhere((ids < 0) | (ids >= size))
        if bad.size:
            at = tuple(int(i) for i in bad[0])
            place = f"index {at[0]}" if len(at) == 1 else f"{counted} {at[0]}, value {at[1]}"
            raise ValueError(f"{where}: {name} id {int(ids[at])} at {place} is outside the vocabulary [0, {size})")


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
