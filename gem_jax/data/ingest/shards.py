"""`ConvertedLog`: a converted event log, read per process from its shard files.

Process i of n reads shard files i, i + n, i + 2n, ... (`files[i::n]`), so
every user's record is read by exactly one process and no process reads another's
files; a conversion with fewer shard files than processes is refused (convert
again with `--shards` a multiple of the process count; equal shares need a
multiple).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from gem_jax.data.ingest.manifest import read_manifest
from gem_jax.data.ingest.records import RecordLayout
from gem_jax.data.ingest.schema import EventSchema
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.ingest.vocab import Vocab
from gem_jax.data.rows import DataFormatError


class RecordReader:
    """Batched random access to the records of several shard files, numbered over the files in order.

    Each file is opened on its first read (a process opens only the files it reads),
    and each `read` reads each file's records in one call of array_record's reader,
    single-threaded: no thread pool per call, which on a few busy cores costs more
    than the reads (grain's `ArrayRecordDataSource.__getitems__` starts one per call).
    The records read last are kept, up to `cache_bytes` (least recently used dropped
    first): a user's record serves every example of theirs, so on a log whose
    records fit, each is read from its file once. Picklable (the open files and the
    kept records are not: a copy opens its own); thread-safe.

    Args:
      files: the shard files.
      counts: records per file (int `[F]`), as the conversion's index gives them.
      cache_bytes: the most record bytes kept (0: none).

    Raises:
      ValueError: not one count per file, or `cache_bytes < 0`.
    """

    OPTIONS = "readahead_buffer_size:0,max_parallelism:1"
    CACHE_BYTES = 1 << 30

    def __init__(self, files: Sequence[Path], counts: Sequence[int], cache_bytes: int = CACHE_BYTES):
        if len(files) != len(counts):
            raise ValueError(f"RecordReader: {len(files)} files but {len(counts)} record counts")
        if cache_bytes < 0:
            raise ValueError(f"RecordReader: cache_bytes must be >= 0, got {cache_bytes}")
        self.files = tuple(Path(f) for f in files)
        self.first = np.zeros(len(files) + 1, np.int64)  # file f holds records first[f]:first[f + 1]
        np.cumsum(np.asarray(counts, np.int64), out=self.first[1:])
        self.cache_bytes = cache_bytes
        self.__setstate__(self.__getstate__())

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getstate__(self) -> dict:
        return {"files": self.files, "first": self.first, "cache_bytes": self.cache_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._readers: dict[int, ArrayRecordReader] = {}
        self._kept: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._kept_bytes = 0
        self._lock = threading.Lock()

    def opened(self) -> tuple[Path, ...]:
        """The files opened so far, in file order."""
        return tuple(self.files[f] for f in sorted(self._readers))

    def read(self, records: np.ndarray) -> list[bytes]:
        """The bytes of records `records` (int `[u]`, in `[0, len)`), in that order.

        Raises:
          IndexError: a record outside `[0, len)`.
          DataFormatError: a shard file that cannot be read (damaged after conversion), named.
        """
        records = np.asarray(records, np.int64)
        if records.size and (records.min() < 0 or records.max() >= len(self)):
            raise IndexError(f"record out of range [0, {len(self)}): {records.min()}..{records.max()}")
        keys = records.tolist()
        with self._lock:
            out = [self._kept.get(key) for key in keys]
            for key in keys:
                if key in self._kept:
                    self._kept.move_to_end(key)
            missing = np.array([k for k, raw in enumerate(out) if raw is None], np.int64)
            file_of = np.searchsorted(self.first, records[missing], side="right") - 1
            for f in np.unique(file_of).tolist():
                at = missing[file_of == f]
                try:
                    if f not in self._readers:
                        self._readers[f] = ArrayRecordReader(str(self.files[f]), self.OPTIONS)
                    raws = self._readers[f].read((records[at] - self.first[f]).tolist())
                except RuntimeError as error:  # array_record's "Corrupted Riegeli/records file", a truncated file
                    raise _damaged(f"{self.files[f]}: the shard file", error) from None
                for k, raw in zip(at.tolist(), raws):
                    out[k] = raw
                    self._keep(keys[k], raw)
        return out

    def _keep(self, key: int, raw: bytes) -> None:
        if len(raw) > self.cache_bytes or key in self._kept:
            return
        self._kept[key] = raw
        self._kept_bytes += len(raw)
        while self._kept_bytes > self.cache_bytes:
            self._kept_bytes -= len(self._kept.popitem(last=False)[1])


def _damaged(what: str, error: RuntimeError) -> DataFormatError:
    """The error for `what` (the shard file, or records of it) that array_record cannot read: damaged after conversion."""
    return DataFormatError(
        f"{what} cannot be read ({str(error).splitlines()[0][:300]}): a shard was damaged after conversion; convert the log "
        "again into a new --out (or with --overwrite)"
    )


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
      DataFormatError: not a converted directory (or one of an older format), a shard
        file missing, or more processes than shard files (some process would get none).
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
          DataFormatError: a record whose size does not match its header, or a shard file
            that cannot be read (the records read named).
        """
        parts = []
        for first in range(0, len(self), block):
            keys = range(first, min(first + block, len(self)))
            try:
                parts.append(self.layout.decode_many(list(self.source.__getitems__(keys))))
            except ValueError as error:
                raise DataFormatError(f"{self.directory}: records {keys.start}..{keys.stop - 1} of this share: {error}") from None
            except RuntimeError as error:  # array_record's "Corrupted Riegeli/records file"
                raise _damaged(f"{self.directory}: records {keys.start}..{keys.stop - 1} of this share, in its shard files,", error) from None
        users, events, counts = (np.concatenate(column) for column in zip(*(parts or [self.layout.decode_many([])])))
        starts = np.zeros(len(self) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        return users, events, starts

    def record_reader(self) -> RecordReader:
        """A `RecordReader` of this process's records, numbered as here (`RecordReader` opens files on demand)."""
        with np.load(self.directory / self.manifest["lengths"]) as saved:
            return RecordReader(self.files, [saved[f.name].shape[0] for f in self.files])

    def lengths(self) -> np.ndarray:
        """int32 `[len]`: the number of events of each of this process's records, in index order (no record read)."""
        return self._per_record("lengths")

    def train_lengths(self) -> np.ndarray:
        """int32 `[len]`: the train events of each of this process's records, in index order (no record read):
        a record's first that many events are train (split 0), the rest eval."""
        return self._per_record("train_events")

    def _per_record(self, key: str) -> np.ndarray:
        with np.load(self.directory / self.manifest[key]) as saved:
            return np.concatenate([saved[f.name] for f in self.files]).astype(np.int32)

    def item_train_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """`(events, positives)`: int64 `[item rows]` train events of each item and int64 `[item rows, K]`
        their positive labels per task (the whole log's, whatever the process)."""
        with np.load(self.directory / self.manifest["item_train_labels"]) as saved:
            return saved["events"], saved["positives"]

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
