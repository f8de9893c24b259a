"""Configuration of the data pipeline: which source, how to split and batch it."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import numpy as np

from gem_jax.checks import check_bool, check_float, check_int
from gem_jax.data.bbs import check_shard_split
from gem_jax.data.rows import OnBadRow
from gem_jax.jagged import check_bucket_settings


class Source(enum.Enum):
    """The data sets `load_dataset` knows.

    EVENTS is your own event log as `gem-data convert` wrote it: `DataConfig.path`
    names the converted directory (`gem_jax.data.sources.converted`).
    """

    ML_LATEST_SMALL = "ml_latest_small"
    ML_100K = "ml_100k"
    AMAZON_BEAUTY = "amazon_beauty"
    SYNTHETIC = "synthetic"
    EVENTS = "events"


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the synthetic source (used only with `Source.SYNTHETIC`).

    Attributes:
      num_items, num_users: vocabulary sizes including PAD_ID.
      num_genres: genres (item feature "genres": ids 1..num_genres, MULTI_HOT).
      num_train_examples, num_eval_examples: size of the (virtual) splits.
      median_length_fraction: median history length as a fraction of max_seq_len.
      length_sigma: sigma of the lognormal length distribution (the tail).
    """

    num_items: int = 100_000
    num_users: int = 10_000
    num_genres: int = 20
    num_train_examples: int = 1_000_000
    num_eval_examples: int = 10_000
    median_length_fraction: float = 0.1
    length_sigma: float = 1.0

    def __post_init__(self):
        for name in ("num_items", "num_users"):
            if getattr(self, name) < 2:
                raise ValueError(f"synthetic {name} must be >= 2 (PAD_ID plus one id), got {getattr(self, name)}")
        for name in ("num_genres", "num_train_examples", "num_eval_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"synthetic {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.median_length_fraction <= 1.0:
            raise ValueError(f"median_length_fraction must be in (0, 1], got {self.median_length_fraction}")
        if self.length_sigma < 0:
            raise ValueError(f"length_sigma must be >= 0, got {self.length_sigma}")


@dataclasses.dataclass(frozen=True)
class BBSConfig:
    """Base batch shuffling of the train batches (`gem_jax.data.bbs.balance_shards`).

    Each global batch is reordered so that the `num_shards` contiguous chunks
    that data parallelism gives the devices carry equal workload.

    Attributes:
      num_shards: D, the devices a global batch is split over; it must divide
        `batch_size` with an even quotient (or be 1: BBS is then off). None:
        all devices of the training mesh (the trainer fills it in with
        `Dataset.resolve_bbs`).
      minibatch_size: BBS minibatch size, a positive even int (GEM: 128).
      workload: the per-sample workload model. None: the model's training FLOPs
        (`gem_jax.model.flops.train_workload`; the trainer fills it in); any
        callable from int lengths `[n]` to float workloads `[n]`.
    """

    num_shards: int | None = None
    minibatch_size: int = 128
    workload: Callable[[np.ndarray], np.ndarray] | None = None

    def __post_init__(self):
        if self.num_shards is not None and (
            isinstance(self.num_shards, bool) or not isinstance(self.num_shards, int) or self.num_shards < 1
        ):
            raise ValueError(f"BBSConfig.num_shards must be a positive int or None, got {self.num_shards!r}")
        if isinstance(self.minibatch_size, bool) or not isinstance(self.minibatch_size, int) or self.minibatch_size < 2 or self.minibatch_size % 2:
            raise ValueError(f"BBSConfig.minibatch_size must be a positive even int, got {self.minibatch_size!r}")
        if self.workload is not None and not callable(self.workload):
            raise TypeError(f"BBSConfig.workload must be a callable from lengths to workloads (e.g. a Workload) or None, got {type(self.workload).__name__}")


class DataConfigError(ValueError):
    """A data setting the data set cannot take (the message names the setting and what to change)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Everything `load_dataset` needs.

    Attributes:
      source: which data set.
      path: its folder; None for the default (`gem_jax.data.paths.default_path`).
        `Source.EVENTS` has no default: the directory `gem-data convert --out` wrote.
      max_seq_len: history bound; longer histories keep the most recent events.
      eval_fraction: share of each user's latest events held out (`split_by_time`).
        Not used by `Source.EVENTS` (its split was chosen at conversion and is in
        the manifest) nor by `Source.SYNTHETIC`.
      batch_size: static B of every batch.
      seed: seeds the per-epoch shuffle (unless `train_iterator` gets its own)
        and, for sampled-candidate sources, the candidate sampling.
      on_bad_row: RAISE on the first malformed row, or SKIP and count. Not used
        by `Source.EVENTS` (`gem-data convert --on-bad-row` decided; the rows it
        skipped are in the manifest and the data set summary).
      num_time_buckets: time-bucket vocabulary size including PAD_ID.
      capacity_step: ratio of consecutive token capacities near a batch's
        expected rows, in (1, 2]; it bounds the slack of a batch in that range
        to under `1 - 1/capacity_step` (1.04: under 3.9%, plus the rounding of
        capacities, `gem_jax.jagged.round_capacity`). The data set's train length distribution sets
        the expected rows (`Dataset.token_buckets`, `gem_jax.jagged.TokenBuckets`);
        each device's rows take the smallest capacity that holds them
        (`gem_jax.parallel.placement.stack_batch`). Smaller steps mean less
        slack and more compiled shapes.
      capacity_sigmas: the fine capacities cover the expected rows of a batch
        +- this many standard deviations (> 0); rarer batches take coarse
        capacities (halvings below, doublings above, `B * max_seq_len` last).
      prefetch_batches: batches built ahead in a background thread (0: none).
      synthetic: shape of the synthetic source.
      bbs: base batch shuffling of the train batches; None: off.
      history_item_features: each history row also carries its event's item features
        (the candidate's side features: MovieLens genres, a converted log's
        `--item-feature` columns), which the model adds to the row's token
        (`FeatureSpec.history_item_features`). Not taken by `Source.SYNTHETIC`, whose
        features are not a function of the item. Changes results, so a restarted run
        keeps its value (`gem_jax.train.run_record`).
    """

    source: Source = Source.ML_LATEST_SMALL
    path: str | None = None
    max_seq_len: int = 200
    eval_fraction: float = 0.1
    batch_size: int = 256
    seed: int = 0
    on_bad_row: OnBadRow = OnBadRow.RAISE
    num_time_buckets: int = 32
    capacity_step: float = 1.04
    capacity_sigmas: float = 4.0
    prefetch_batches: int = 2
    synthetic: SyntheticConfig = SyntheticConfig()
    bbs: BBSConfig | None = None
    history_item_features: bool = False

    def __post_init__(self):
        if not isinstance(self.source, Source):
            raise TypeError(f"source must be a Source, got {self.source!r}")
        if not isinstance(self.on_bad_row, OnBadRow):
            raise TypeError(f"on_bad_row must be an OnBadRow, got {self.on_bad_row!r}")
        check_int(self, "max_seq_len", minimum=1)
        check_int(self, "batch_size", minimum=1)
        check_int(self, "seed", minimum=0)
        check_int(self, "num_time_buckets", minimum=2)
        check_int(self, "prefetch_batches", minimum=0)
        check_bool(self, "history_item_features")
        if self.path is not None and not str(self.path).strip():  # an unset shell variable would read the current directory
            raise DataConfigError("DataConfig.path is empty: name the data's folder, or leave it None for the source's default")
        if self.history_item_features and self.source is Source.SYNTHETIC:
            raise DataConfigError(
                "DataConfig.history_item_features: Source.SYNTHETIC draws each example's features at random, not from its "
                "items, so its history rows have none to carry; set it to False, or train on a data set with item features"
            )
        check_float(self, "eval_fraction")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.seed >= 2**32:
            raise ValueError(f"DataConfig.seed must be in [0, 2**32), got {self.seed}")
        check_bucket_settings(self.capacity_step, self.capacity_sigmas, ("DataConfig.capacity_step", "DataConfig.capacity_sigmas"))
        if self.bbs is not None:
            if not isinstance(self.bbs, BBSConfig):
                raise TypeError(f"bbs must be a BBSConfig or None, got {self.bbs!r}")
            if self.bbs.num_shards is not None:
                check_shard_split(self.batch_size, self.bbs.num_shards, "DataConfig.bbs")


def require_path(config: DataConfig) -> None:
    """Raises `DataConfigError` when `config` names no data to read: `Source.EVENTS` without a path."""
    if config.source is Source.EVENTS and config.path is None:
        raise DataConfigError(
            "Source.EVENTS reads your own event log as gem-data convert wrote it: set DataConfig.path to that "
            "directory (e.g. --set data.path=data/mylog)"
        )
