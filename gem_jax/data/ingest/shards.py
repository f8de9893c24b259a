"""`ConvertedLog`: a converted event log, read per process from its shard files.

Process i of n reads shard files i, i + n, i + 2n, ... (`files[i::n]`), so
every user's record is read by exactly one process and no process reads another's
files; a conversion with fewer shard files than processes is refused (convert
again with `--shards` a multiple of the process count; equal shares need a
multiple).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from gem_jax.data.ingest.manifest import read_manifest
from gem_jax.data.ingest.records import RecordLayout
from gem_jax.data.ingest.schema import EventSchema
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.ingest.vocab import Vocab
from gem_jax.data.rows import DataFormatError


class ConvertedLog:
    """A process's share of a converted log: one record per user, random access by index.

    Record `i` (0 <= i < len) is a dict of numpy arrays, for a user with L
    events (sorted by time, then input order) and K tasks:

    - `user`: int32 `[]`, the user's row of `vocab/user.csv` (0 padding, 1 OOV);
    - `user_feature/<name>`: int32 `[m]` per user feature, rows of
      `vocab/user_feature.<name>.csv`, `m` the feature's `max_values`
      (manifest `features`), unused slots 0; a single-valued feature has m = 1;
    - `item`: int32 `[L]`, rows of `vocab/item.csv`; an item's features are row
      `item` of `item_features()[<name>]` (int32 `[item rows, m]`);
    - `time`: int64 `[L]`, the time column's integers, or Unix seconds for dates;
    - `action`: int32 `[L]`, rows of `vocab/action.csv` (only with an action column);
    - `labels`: float32 `[L, K]`, 0 or 1, tasks in manifest `tasks` order;
    - `weight`: float32 `[L]` (only with a weight column);
    - `split`: uint8 `[L]`, 0 train, 1 eval (manifest `split`).

    The byte layout is `gem_jax.data.ingest.records`; records are read through
    grain's `ArrayRecordDataSource` (so `source` can feed a grain `MapDataset`).

    Args:
      directory: the converted directory (`gem-data convert --out`).
      process_index, process_count: this process and how many read the log
        (`jax.process_index()`, `jax.process_count()` in a multi-host run).

    Raises:
      DataFormatError: not a converted directory, a shard file missing, or more
        processes than shard files (some process would get none).
      ValueError: `process_index` outside `[0, process_count)`.
    """

    def __init__(self, directory: str | os.PathLike, process_index: int = 0, process_count: int = 1):
        if not 0 <= process_index < process_count:
            raise ValueError(f"ConvertedLog: process_index must be in [0, {process_count}), got {process_index}")
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.layout = RecordLayout.from_json(self.manifest["record_layout"])
        self.schema = EventSchema.from_json(self.manifest["schema"])
        self.split = SplitRule.from_json(self.manifest["split"])
        self.shard_files = tuple(self.directory / name for name in self.manifest["shards"])
        if len(self.shard_files) < process_count:
            raise DataFormatError(
                f"{self.directory}: {len(self.shard_files)} shard file(s) for {process_count} processes leaves process(es) "
                f"{len(self.shard_files)}..{process_count - 1} without data; convert again with --shards a multiple of {process_count}"
            )
        missing = [str(f) for f in self.shard_files if not f.is_file()]
        if missing:
            raise DataFormatError(f"{self.directory}: shard file(s) missing: {', '.join(missing)}")
        self.process_index, self.process_count = process_index, process_count
        self.files = self.shard_files[process_index::process_count]
        self.source = grain.sources.ArrayRecordDataSource([str(f) for f in self.files])

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.layout.decode(self.source[index])

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for index in range(len(self)):
            yield self[index]

    def read_all(self, block: int = 1 << 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every record of this process's share, in index order, as three arrays (`RecordLayout.decode_many`).

        Records are read `block` at a time (grain reads each file's part in one call).

        Returns:
          `(users, events, starts)`: `layout.user_dtype` `[len]`; `layout.event_dtype`
          `[n]`, record i's events at `starts[i]:starts[i + 1]`; int64 `[len + 1]`.

        Raises:
          DataFormatError: a record whose size does not match its header (the records
            read named).
        """
        parts = []
        for first in range(0, len(self), block):
            keys = range(first, min(first + block, len(self)))
            try:
                parts.append(self.layout.decode_many(list(self.source.__getitems__(keys))))
            except ValueError as error:
                raise DataFormatError(f"{self.directory}: records {keys.start}..{keys.stop - 1} of this share: {error}") from None
        users, events, counts = (np.concatenate(column) for column in zip(*(parts or [self.layout.decode_many([])])))
        starts = np.zeros(len(self) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        return users, events, starts

    def lengths(self) -> np.ndarray:
        """int32 `[len]`: the number of events of each of this process's records, in index order (no record read)."""
        with np.load(self.directory / self.manifest["lengths"]) as saved:
            return np.concatenate([saved[f.name] for f in self.files]).astype(np.int32)

    def vocab(self, name: str) -> Vocab:
        """A vocabulary of the log: `user`, `item`, `action` or `<side>_feature.<name>`."""
        if name not in self.manifest["vocabularies"]:
            raise KeyError(f"{self.directory}: no vocabulary {name!r}; it has {sorted(self.manifest['vocabularies'])}")
        return Vocab.load(name, self.directory / self.manifest["vocabularies"][name]["file"])

    def item_features(self) -> dict[str, np.ndarray]:
        """int32 `[item rows, m]` per item feature (row 0 padding and row 1 OOV hold 0s)."""
        if not self.manifest["item_features"]:
            return {}
        with np.load(self.directory / self.manifest["item_features"]) as saved:
            return {name: saved[name] for name in saved.files}
