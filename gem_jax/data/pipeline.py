"""`load_dataset`: the one entry point from a `DataConfig` to grain batch iterators.

For a file-backed source: read the event log, split it by time per user,
build the train and eval examples (index arrays), and wrap them in grain
datasets:

    train: ShuffledBatchIndices(E_train, B, seed, epochs)[.map_with_index(BalancedBatchOrder)].map(batch_builder)
    eval:  ShuffledBatchIndices(E_eval, B, None, 1).map(batch_builder)

Shuffling is a seeded permutation per epoch; each epoch is batched on its own,
and its last, partial batch is filled with weight-0 padding examples, so every
example is seen once per epoch and nothing is dropped. With `DataConfig.bbs`,
base batch shuffling reorders each full train batch so that the contiguous
per-device chunks of data parallelism carry equal workload
(`gem_jax.data.bbs.balance_shards`); it is a pure function of the batch index,
so the stream does not depend on the number of grain workers. The train iterator is
grain's `DatasetIterator`: its `get_state()` / `set_state()` restore the exact
position, so a resumed run yields exactly the remaining batches.

Your own event log (`Source.EVENTS`, a directory `gem-data convert` wrote) is
read by `gem_jax.data.sources.converted`: every event is an example of its
split, with the user's earlier events as history; the examples and their
lengths come from the conversion's index, and each batch reads only its
examples' records; the same `Dataset` follows.

In a multi-process run each process iterates `local_train_iterator(shard)` and
`local_eval_batches(shard)`: the same global batches, of which it builds only its
devices' chunks (`gem_jax.data.shard`).

Tasks per source (`FeatureSpec.tasks`, the label columns in order):
- ml-latest-small: like (rating >= 4), love (rating >= 4.5).
- ml-100k: like (rating >= 4), love (rating == 5).
- amazon-beauty: next_item (the candidate is the next item), in_next_5 (the
  candidate is among the next 5 items; sampled candidates, `next_item_examples`).
- synthetic: click, convert (see `gem_jax.data.sources.synthetic`).
- events: the tasks of the conversion (`--label`), in its order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grain
import numpy as np

from gem_jax.data.sources.amazon_beauty import read_amazon_beauty
from gem_jax.batch import Batch, BatchShard, FeatureSpec, LocalBatch
from gem_jax.data.bbs import BalancedBatchOrder, check_shard_split
from gem_jax.data.collate import BatchBuilder, log_spec
from gem_jax.jagged import TokenBuckets
from gem_jax.data.config import BBSConfig, DataConfig, DataConfigError, Source, SyntheticConfig, require_path
from gem_jax.data.events import EventLog
from gem_jax.data.examples import Examples, item_mean_labels, next_item_examples, rating_examples
from gem_jax.data.sources.movielens_100k import read_ml_100k
from gem_jax.data.ingest.split import EVAL, TRAIN
from gem_jax.data.sources.converted import (
    ConvertedBatchBuilder,
    converted_examples,
    converted_fingerprint,
    converted_notes,
    converted_skipped,
    converted_spec,
    read_converted_index,
)
from gem_jax.data.sources.movielens_small import read_ml_latest_small
from gem_jax.data.paths import fingerprint, resolve_path
from gem_jax.data.rows import OnBadRow, SkippedRows
from gem_jax.data.sampling import ShuffledBatchIndices
from gem_jax.data.shard import LocalBatchBuilder
from gem_jax.data.split import Split, split_by_time
from gem_jax.data.sources.synthetic import (
    EVAL_STREAM,
    TRAIN_STREAM,
    SYNTHETIC_TASKS,
    SyntheticBatchBuilder,
    synthetic_item_mean_labels,
    synthetic_lengths,
    synthetic_spec,
)

__all__ = ["BBSConfig", "DataConfig", "Dataset", "DatasetInfo", "OnBadRow", "Source", "SyntheticConfig", "load_dataset"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What a loaded data set holds, for logs and reports.

    Attributes:
      name: data set name.
      task_names: the tasks, in label column order (`FeatureSpec.tasks`).
      label_names: the meaning of each task's label.
      num_events, num_users, num_items: events and distinct users / items
        (without PAD_ID); 0 events for the synthetic source.
      num_train_examples, num_eval_examples: examples per split.
      train_positive_rate, eval_positive_rate: mean label of each task.
      skipped: rows left out under `OnBadRow.SKIP`.
      notes: other facts from the reader.
      source: the `Source` it was read from, by name.
      path: the folder read ("" for the synthetic source).
      fingerprint: sha256 of the files read (of the generator's settings for the
        synthetic source): two loads with equal fingerprints hold the same data.
    """

    name: str
    task_names: tuple[str, ...]
    label_names: tuple[str, ...]
    num_events: int
    num_users: int
    num_items: int
    num_train_examples: int
    num_eval_examples: int
    train_positive_rate: tuple[float, ...]
    eval_positive_rate: tuple[float, ...]
    skipped: tuple[SkippedRows, ...] = ()
    notes: tuple[str, ...] = ()
    source: str = ""
    path: str = ""
    fingerprint: str = ""

    def identity(self) -> dict:
        """What a run records to tell this data set from another (`gem_jax.train.run_record`)."""
        return {
            "source": self.source,
            "path": self.path,
            "fingerprint": self.fingerprint,
            "num_events": self.num_events,
            "num_train_examples": self.num_train_examples,
            "num_eval_examples": self.num_eval_examples,
            "skipped_rows": sum(s.count for s in self.skipped),
        }

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [
            f"{self.name}: {self.num_events} events, {self.num_users} users, {self.num_items} items; "
            f"{self.num_train_examples} train / {self.num_eval_examples} eval examples",
        ]
        for k, (task, label) in enumerate(zip(self.task_names, self.label_names)):
            lines.append(
                f"  {task} label: {label} "
                f"(positive rate train {self.train_positive_rate[k]:.3f}, eval {self.eval_positive_rate[k]:.3f})"
            )
        lines += [f"  {s}" for s in self.skipped] + [f"  {n}" for n in self.notes]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A split data set with batch iterators of static B (`token_buckets` gives the static token capacities).

    Attributes:
      spec: the layout of every batch: vocabularies, features, tasks, `max_seq_len`.
      info: counts and label meanings.
      batch_size: static B.
      token_buckets: the token capacities a batch, or one device's part of
        it, can be placed in (`gem_jax.parallel.placement.stack_batch`), from
        the train length distribution; the batches themselves hold no slack.
      seed: default shuffle seed of `train_iterator`.
      prefetch_batches: batches built ahead in a background thread.
      train_batch: `(indices, batch_size=None) -> Batch` of a list of train
        example indices, padded to `batch_size` examples (default B).
      eval_batch: the same for eval example indices.
      item_mean_labels: float32 `[num_items, K]`: mean train label of each
        candidate item (the train mean where an item is never a train
        candidate); the item-popularity baseline scores `[candidate_item]`.
      train_lengths: maps int64 train example indices `[n]` to their history
        lengths `[n]` (what `train_batch` packs; BBS weighs examples by it).
      eval_lengths: the same for eval example indices.
      bbs: base batch shuffling of the train batches (`DataConfig.bbs`); None: off.
    """

    spec: FeatureSpec
    info: DatasetInfo
    batch_size: int
    token_buckets: TokenBuckets
    seed: int
    prefetch_batches: int
    train_batch: Callable[..., Batch]
    eval_batch: Callable[..., Batch]
    item_mean_labels: np.ndarray
    train_lengths: Callable[[np.ndarray], np.ndarray]
    eval_lengths: Callable[[np.ndarray], np.ndarray]
    bbs: BBSConfig | None = None

    @property
    def task_names(self) -> tuple[str, ...]:
        """The tasks' names in label column order (`spec.tasks`); meanings in `info.label_names`."""
        return self.spec.tasks

    @property
    def steps_per_epoch(self) -> int:
        """Train batches per epoch (the last one padded)."""
        return -(-self.info.num_train_examples // self.batch_size)

    @property
    def num_eval_batches(self) -> int:
        """Eval batches (the last one padded)."""
        return -(-self.info.num_eval_examples // self.batch_size)

    def _read_options(self) -> grain.ReadOptions:
        threads = 1 if self.prefetch_batches else 0
        return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=self.prefetch_batches)

    def resolve_bbs(self, *, num_shards: int, workload: Callable[[np.ndarray], np.ndarray]) -> Dataset:
        """This data set with the BBS settings its config left open filled in.

        The trainer calls it with its mesh's device count and the model's
        training workload (`gem_jax.model.flops.train_workload`); `BBSConfig.num_shards`
        and `BBSConfig.workload` that are None take these values, explicit
        ones are kept. Without BBS, returns `self`.

        Args:
          num_shards: D, the devices each global batch is split over.
          workload: the per-sample workload model.

        Raises:
          ValueError: an explicit `num_shards` differs from `num_shards` (the
            chunks BBS balances would not be the devices' chunks), or B does
            not split into D even chunks.
        """
        if self.bbs is None:
            return self
        if self.bbs.num_shards is not None and self.bbs.num_shards != num_shards:
            raise ValueError(
                f"DataConfig.bbs.num_shards is {self.bbs.num_shards} but batches are split over {num_shards} devices; "
                "set it to None or to the device count"
            )
        check_shard_split(self.batch_size, num_shards, "DataConfig.bbs")
        bbs = dataclasses.replace(self.bbs, num_shards=num_shards, workload=workload if self.bbs.workload is None else self.bbs.workload)
        return dataclasses.replace(self, bbs=bbs)

    def train_indices(self, seed: int | None = None, num_epochs: int | None = None) -> grain.MapDataset:
        """grain `MapDataset` of the example indices (int64 `[<= B]`) of each train batch.

        Epoch after epoch, each shuffled; with BBS on, each full batch is
        reordered by `BalancedBatchOrder` (seeded with the shuffle seed and the
        batch index), a permutation of the plain batch.

        Args:
          seed: shuffle seed (default `self.seed`).
          num_epochs: None repeats forever.

        Raises:
          ValueError: BBS is on with `num_shards` or `workload` still None
            (call `resolve_bbs` first).
        """
        seed = self.seed if seed is None else seed
        batches = ShuffledBatchIndices(self.info.num_train_examples, self.batch_size, seed, num_epochs)
        bbs = self.bbs
        if bbs is None:
            return batches
        if bbs.num_shards is None or bbs.workload is None:
            unset = "num_shards" if bbs.num_shards is None else "workload"
            raise ValueError(f"DataConfig.bbs.{unset} is None: call Dataset.resolve_bbs(num_shards=..., workload=...) first")
        if bbs.num_shards == 1:
            return batches
        order = BalancedBatchOrder(
            lengths=self.train_lengths,
            workload=bbs.workload,
            num_shards=bbs.num_shards,
            batch_size=self.batch_size,
            minibatch_size=bbs.minibatch_size,
            seed=seed,
        )
        return batches.map_with_index(order)

    def prefetch_train_order(self, batch: int, seed: int | None = None) -> None:
        """Starts computing, in a thread, the shuffled example order of the epoch of train batch `batch`
        (a permutation of every train example, ~5 s at 100M; `gem_jax.data.sampling.prefetch_epoch_order`),
        which `train_indices` and the train iterators then share.

        Args:
          batch: the index of the first train batch the run will read (its first step).
          seed: shuffle seed (default `self.seed`).
        """
        seed = self.seed if seed is None else seed
        ShuffledBatchIndices(self.info.num_train_examples, self.batch_size, seed).prefetch(batch)

    def train_dataset(self, seed: int | None = None, num_epochs: int | None = None) -> grain.MapDataset:
        """grain `MapDataset` of train `Batch`es: `train_indices(seed, num_epochs)` built into batches.

        Args:
          seed: shuffle seed (default `self.seed`).
          num_epochs: None repeats forever.
        """
        return self.train_indices(seed, num_epochs).map(self.train_batch)

    def train_iterator(self, seed: int | None = None, num_epochs: int | None = None) -> grain.DatasetIterator:
        """Checkpointable iterator over train `Batch`es (numpy leaves).

        `it.get_state()` is a small dict; `set_state(state)` on a fresh
        iterator of the same data set, seed and epochs continues with exactly
        the batches the saved one had not yet returned.
        """
        return iter(self.train_dataset(seed, num_epochs).to_iter_dataset(self._read_options()))

    def local_train_iterator(self, shard: BatchShard, seed: int | None = None, num_epochs: int | None = None) -> grain.DatasetIterator:
        """Checkpointable iterator over this process's parts of the train batches (`LocalBatch`es).

        The global batches are `train_indices(seed, num_epochs)`'s, the same on
        every process; each element holds only the examples of `shard.chunks`
        (`gem_jax.data.shard.LocalBatchBuilder`). With `BatchShard.whole(D)` its
        `batch` is `train_iterator`'s batch. Every process yields the same number
        of elements (`steps_per_epoch` per epoch, from the global example count).
        `get_state()` / `set_state()` work as for `train_iterator`.

        Raises:
          ValueError: as `train_indices`; `shard.num_chunks` does not divide B.
        """
        local = LocalBatchBuilder(self.train_batch, self.train_lengths, self.batch_size, shard)
        return iter(self.train_indices(seed, num_epochs).map(local).to_iter_dataset(self._read_options()))

    def eval_indices(self) -> grain.MapDataset:
        """grain `MapDataset` of the example indices (int64 `[<= B]`) of each eval batch, in `eval_batches()`'s order."""
        return ShuffledBatchIndices(self.info.num_eval_examples, self.batch_size, None, 1)

    def eval_batches(self) -> Iterator[Batch]:
        """Every eval example exactly once, in a fixed order; the last batch padded."""
        return iter(self.eval_indices().map(self.eval_batch).to_iter_dataset(self._read_options()))

    def local_eval_batches(self, shard: BatchShard) -> Iterator[LocalBatch]:
        """This process's parts of `eval_batches()`: `num_eval_batches` `LocalBatch`es on every process.

        Raises:
          ValueError: `shard.num_chunks` does not divide B.
        """
        local = LocalBatchBuilder(self.eval_batch, self.eval_lengths, self.batch_size, shard)
        return iter(self.eval_indices().map(local).to_iter_dataset(self._read_options()))

    def item_mean_label(self, task: int = 0) -> np.ndarray:
        """float32 `[num_items]`: the item-popularity baseline score of each candidate item for task column `task`."""
        return self.item_mean_labels[:, task]


def _rating_builder(thresholds: tuple[float, ...]):
    def build(log: EventLog, split: Split, targets: np.ndarray, config: DataConfig) -> Examples:
        return rating_examples(log, targets, max_seq_len=config.max_seq_len, thresholds=thresholds)

    return build


def _next_item_builder(log: EventLog, split: Split, targets: np.ndarray, config: DataConfig, stream: int) -> Examples:
    return next_item_examples(log, split, targets, max_seq_len=config.max_seq_len, seed=(config.seed, stream))


@dataclasses.dataclass(frozen=True)
class _FileSource:
    reader: Callable[[str | os.PathLike, OnBadRow], EventLog]
    build_train: Callable[[EventLog, Split, np.ndarray, DataConfig], Examples]
    build_eval: Callable[[EventLog, Split, np.ndarray, DataConfig], Examples]
    tasks: tuple[tuple[str, str], ...]  # (name, meaning) of each label column the builders make


_ML_SMALL_LABELS = _rating_builder((4.0, 4.5))
_ML_100K_LABELS = _rating_builder((4.0, 5.0))
_FILE_SOURCES = {
    Source.ML_LATEST_SMALL: _FileSource(
        read_ml_latest_small, _ML_SMALL_LABELS, _ML_SMALL_LABELS, (("like", "rating >= 4"), ("love", "rating >= 4.5"))
    ),
    Source.ML_100K: _FileSource(read_ml_100k, _ML_100K_LABELS, _ML_100K_LABELS, (("like", "rating >= 4"), ("love", "rating == 5"))),
    Source.AMAZON_BEAUTY: _FileSource(
        read_amazon_beauty,
        functools.partial(_next_item_builder, stream=0),
        functools.partial(_next_item_builder, stream=1),
        (("next_item", "candidate is the next item"), ("in_next_5", "candidate is among the next 5 items")),
    ),
}


def source_tasks(source: Source) -> tuple[str, ...]:
    """The task names of a built-in source, in label column order.

    Raises:
      ValueError: `Source.EVENTS`, whose tasks are its conversion's (`FeatureSpec.tasks`).
    """
    if source is Source.EVENTS:
        raise ValueError("Source.EVENTS has no fixed tasks: they are those of its conversion (the data set's FeatureSpec.tasks)")
    if source is Source.SYNTHETIC:
        return tuple(name for name, _ in SYNTHETIC_TASKS)
    return tuple(name for name, _ in _FILE_SOURCES[source].tasks)


def _mean_rate(examples: Examples) -> tuple[float, ...]:
    if not len(examples):
        return (0.0,) * examples.labels.shape[1]
    return tuple(float(rate) for rate in examples.labels.mean(axis=0))


LENGTH_SAMPLE = 1 << 17  # train examples whose lengths set the token buckets


def token_buckets(config: DataConfig, train_lengths: Callable[[np.ndarray], np.ndarray], num_train_examples: int) -> TokenBuckets:
    """The `TokenBuckets` of the lengths of up to `LENGTH_SAMPLE` train examples spread evenly over the split.

    Args:
      config: `max_seq_len`, `capacity_step` and `capacity_sigmas` are used.
      train_lengths: int64 train example indices `[m]` -> their history lengths `[m]` (rows).
      num_train_examples: size of the train split.

    Raises:
      ValueError: `num_train_examples` is 0 (see `TokenBuckets.from_lengths`).
    """
    sample = np.unique(np.linspace(0, num_train_examples - 1, min(num_train_examples, LENGTH_SAMPLE)).astype(np.int64))
    return TokenBuckets.from_lengths(train_lengths(sample), config.max_seq_len, config.capacity_step, config.capacity_sigmas)


def describe_capacities(buckets: TokenBuckets, per_device: int) -> str:
    """One line on the token capacities a run's step compiles for: how many fine ones, their rows, and the setting.

    Args:
      buckets: the data set's `token_buckets`.
      per_device: examples of a batch on each device (`DataConfig.batch_size` / devices).

    Raises:
      ValueError: `per_device < 1`.
    """
    fine = buckets.fine_capacities(per_device)
    rows = f"{len(fine)} token capacities of {fine[0]:,} to {fine[-1]:,} rows" if len(fine) > 1 else f"1 token capacity of {fine[0]:,} rows"
    return (
        f"{rows} per device hold a batch within {buckets.sigmas:g} standard deviations of its expected "
        f"{per_device * buckets.mean_length:,.0f} rows; the train and eval steps are compiled for each capacity the run's batches take "
        f"(DataConfig.capacity_step={buckets.step:g}: a larger step compiles fewer shapes and leaves more slack)"
    )


def _load_file_source(config: DataConfig) -> Dataset:
    source = _FILE_SOURCES[config.source]
    path = resolve_path(config.source, config.path)
    log = source.reader(path, config.on_bad_row)
    for skipped in log.skipped:
        logger.warning("%s", skipped)
    split = split_by_time(log, config.eval_fraction)
    train = source.build_train(log, split, split.train_targets, config)
    evals = source.build_eval(log, split, split.eval_targets, config)
    if not len(train) or not len(evals):
        raise ValueError(f"{log.name}: the split left {len(train)} train and {len(evals)} eval examples; both must be > 0")
    spec = log_spec(
        log, tuple(name for name, _ in source.tasks), num_time_buckets=config.num_time_buckets, max_seq_len=config.max_seq_len,
        history_item_features=config.history_item_features,
    )
    info = DatasetInfo(
        name=log.name,
        task_names=spec.tasks,
        label_names=tuple(meaning for _, meaning in source.tasks),
        num_events=log.num_events,
        num_users=int(np.count_nonzero(np.diff(log.user_offsets))),
        num_items=int(np.unique(log.item).shape[0]),
        num_train_examples=len(train),
        num_eval_examples=len(evals),
        train_positive_rate=_mean_rate(train),
        eval_positive_rate=_mean_rate(evals),
        skipped=log.skipped,
        notes=log.notes,
        source=config.source.name,
        path=str(path.resolve()),
        fingerprint=fingerprint(path),
    )
    return _examples_dataset(
        config,
        spec,
        info,
        train.history_length,
        evals.history_length,
        item_mean_labels(train, spec.num_items),
        BatchBuilder(log, train, spec, config.batch_size),
        BatchBuilder(log, evals, spec, config.batch_size),
    )


def _load_converted(config: DataConfig) -> Dataset:
    require_path(config)
    path = Path(config.path)
    index = read_converted_index(path)
    train, evals = converted_examples(index, config.max_seq_len)
    spec = converted_spec(
        index, num_time_buckets=config.num_time_buckets, max_seq_len=config.max_seq_len, history_item_features=config.history_item_features
    )
    manifest = index.manifest
    info = DatasetInfo(
        name=path.resolve().name,
        task_names=spec.tasks,
        label_names=tuple(task["rule"] for task in manifest["tasks"]),
        num_events=index.num_events,
        num_users=manifest["counts"]["users"],
        num_items=manifest["counts"]["items"],
        num_train_examples=len(train),
        num_eval_examples=len(evals),
        train_positive_rate=tuple(float(p) for p in index.item_train_positives.sum(axis=0) / len(train)),
        eval_positive_rate=tuple(float(task["eval_positive_rate"]) for task in manifest["tasks"]),
        skipped=converted_skipped(manifest),
        notes=converted_notes(manifest),
        source=config.source.name,
        path=str(path.resolve()),
        fingerprint=converted_fingerprint(manifest),
    )
    return _examples_dataset(
        config,
        spec,
        info,
        train.history_length,
        evals.history_length,
        index.item_mean_labels(),
        ConvertedBatchBuilder(index, train, spec, config.batch_size, TRAIN),
        ConvertedBatchBuilder(index, evals, spec, config.batch_size, EVAL),
    )


def _examples_dataset(
    config: DataConfig,
    spec: FeatureSpec,
    info: DatasetInfo,
    train_lengths: np.ndarray,
    eval_lengths: np.ndarray,
    item_means: np.ndarray,
    train_batch: Callable[..., Batch],
    eval_batch: Callable[..., Batch],
) -> Dataset:
    """The `Dataset` of a source whose examples are index arrays built by `train_batch` / `eval_batch`.

    Args:
      train_lengths, eval_lengths: int32 `[E]` history length of each example of the split.
      item_means: float32 `[num_items, K]` the item-mean-label baseline (`Dataset.item_mean_labels`).

    Raises:
      DataConfigError: `history_item_features` on a data set without item features.
    """
    if spec.history_item_features:
        if not spec.item_features:
            raise DataConfigError(
                f"{config.path or info.path or info.name}: data.history_item_features is set, but the data set has no item features for its history "
                "rows to carry; set it to False, or convert the log with --item-table and --item-feature"
            )
        names = ", ".join(f.name for f in spec.item_features)
        info = dataclasses.replace(info, notes=info.notes + (f"history rows carry each event's item features: {names} (data.history_item_features)",))
    lengths = functools.partial(np.take, train_lengths)
    return Dataset(
        spec=spec,
        info=info,
        batch_size=config.batch_size,
        token_buckets=token_buckets(config, lengths, len(train_lengths)),
        seed=config.seed,
        prefetch_batches=config.prefetch_batches,
        train_batch=train_batch,
        eval_batch=eval_batch,
        item_mean_labels=item_means,
        train_lengths=lengths,
        eval_lengths=functools.partial(np.take, eval_lengths),
        bbs=config.bbs,
    )


def _load_synthetic(config: DataConfig) -> Dataset:
    syn = config.synthetic
    spec = synthetic_spec(syn, config.max_seq_len, config.num_time_buckets)
    table = synthetic_item_mean_labels(config.seed, syn.num_items)
    expected = tuple(float(rate) for rate in table[1:].mean(axis=0))
    info = DatasetInfo(
        name="synthetic",
        task_names=spec.tasks,
        label_names=tuple(meaning for _, meaning in SYNTHETIC_TASKS),
        num_events=0,
        num_users=syn.num_users - 1,
        num_items=syn.num_items - 1,
        num_train_examples=syn.num_train_examples,
        num_eval_examples=syn.num_eval_examples,
        train_positive_rate=expected,
        eval_positive_rate=expected,
        source=config.source.name,
        fingerprint=hashlib.sha256(json.dumps([dataclasses.asdict(syn), config.seed, config.max_seq_len]).encode()).hexdigest(),
    )
    build = functools.partial(SyntheticBatchBuilder, syn, spec, config.batch_size, config.seed)
    lengths = functools.partial(synthetic_lengths, config.seed, config=syn, max_seq_len=config.max_seq_len)
    train_lengths = functools.partial(lengths, TRAIN_STREAM)
    return Dataset(
        spec=spec,
        info=info,
        batch_size=config.batch_size,
        token_buckets=token_buckets(config, train_lengths, syn.num_train_examples),
        seed=config.seed,
        prefetch_batches=config.prefetch_batches,
        train_batch=build(TRAIN_STREAM),
        eval_batch=build(EVAL_STREAM),
        item_mean_labels=table,
        train_lengths=train_lengths,
        eval_lengths=functools.partial(lengths, EVAL_STREAM),
        bbs=config.bbs,
    )


def load_dataset(config: DataConfig) -> Dataset:
    """Loads, splits and wraps a data set for training and evaluation.

    Args:
      config: the `DataConfig`.

    Returns:
      A `Dataset`: `spec`, `info`, `train_iterator(seed, num_epochs)`,
      `eval_batches()`, `item_mean_label(task)`.

    Raises:
      BadRowError: a malformed row under `OnBadRow.RAISE` (file and line named).
      DataFormatError: an unusable file, or for `Source.EVENTS` a directory that
        is not a finished conversion.
      FileNotFoundError: a missing file or folder.
      ValueError: a split without train or eval examples; `Source.EVENTS` without
        `DataConfig.path`, or with names the model cannot take.
    """
    if config.source is Source.SYNTHETIC:
        return _load_synthetic(config)
    if config.source is Source.EVENTS:
        return _load_converted(config)
    return _load_file_source(config)
