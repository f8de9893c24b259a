"""The shard files of a conversion, written a window of files at a time so that memory stays bounded.

An `ArrayRecordWriter` holds its file's chunk index until it is closed, about
`INDEX_BYTES_PER_RECORD` bytes per record at one record per chunk (measured
with array_record 0.8: 2M records of 150 bytes over 16 writers held 347 MiB).
Writing every user's record into 16 files open to the end would hold memory in
proportion to the number of users. `ShardWriters` instead deals records in turn
over a window of `width` files, and once the window holds its share of records
closes those files and opens the next window: the memory for indexes is at most
one window's, whatever the number of users, and a log with more users is
written to more files. Which file a record lands in follows from its position
in the conversion's user order alone (`file_of`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

WRITER_OPTIONS = "group_size:1,uncompressed"  # one record per chunk: random access reads one record; ids and times barely compress
INDEX_BYTES_PER_RECORD = 256  # an open writer's chunk index, per record written (measured ~180 B; rounded up)
WINDOW_FILES = 16  # files written at once, by default


class ShardWriters:
    """Writes `num_records` records, in order, to `part-SSSSS-of-NNNNN.array_record` files.

    Args:
      directory: where the files go (exists).
      num_records: records to be written (the conversion's users), >= 1.
      index_bytes: memory the open files' chunk indexes may hold (bytes).
      num_files: exactly this many files, all open at once (the `--shards`
        option; then `index_bytes` is not a bound), or None: windows of
        `WINDOW_FILES` files, as many as `index_bytes` requires.

    Attributes:
      names: the file names, in order.
      per_window: records written to a window of files before it is closed.
      width: files in a window.
    """

    def __init__(self, directory: Path, num_records: int, index_bytes: int, num_files: int | None = None):
        if num_records < 1 or (num_files is not None and num_files < 1):
            raise ValueError(f"num_records and num_files must be >= 1, got {num_records}, {num_files}")
        self.directory = directory
        self.num_records = num_records
        if num_files is not None:
            self.width, self.per_window, windows = num_files, num_records, 1
        else:
            self.width = min(WINDOW_FILES, num_records)
            self.per_window = max(self.width, index_bytes // INDEX_BYTES_PER_RECORD)
            windows = math.ceil(num_records / self.per_window)
        total = self.width * windows
        self.names = [f"part-{s:05d}-of-{total:05d}.array_record" for s in range(total)]
        self._lengths: list[list[np.ndarray]] = [[] for _ in range(total)]
        self._train: list[list[np.ndarray]] = [[] for _ in range(total)]
        self._open: dict[int, ArrayRecordWriter] = {}
        self._written = 0

    @property
    def index_bytes(self) -> int:
        """The most memory the open files' chunk indexes hold (bytes, estimated)."""
        return min(self.per_window, self.num_records) * INDEX_BYTES_PER_RECORD

    def file_of(self, positions: np.ndarray) -> np.ndarray:
        """int64 file index of the records at int64 `positions` `[n]` of the write order."""
        window, within = np.divmod(positions, self.per_window)
        return window * self.width + within % self.width

    def write(self, records: Iterable[bytes], lengths: np.ndarray, train_events: np.ndarray) -> None:
        """Writes the next `len(lengths)` records (int32 `lengths` and `train_events` `[n]`: each
        record's events and train events, kept for the conversion's index)."""
        files = self.file_of(self._written + np.arange(len(lengths)))
        for file, record in zip(files.tolist(), records):
            writer = self._open.get(file)
            if writer is None:
                self._close_window_before(file)
                writer = self._open[file] = ArrayRecordWriter(str(self.directory / self.names[file]), WRITER_OPTIONS)
            writer.write(record)
        for file in np.unique(files).tolist():
            self._lengths[file].append(lengths[files == file])
            self._train[file].append(train_events[files == file])
        self._written += len(lengths)

    def _close_window_before(self, file: int) -> None:
        for done in [f for f in self._open if f // self.width < file // self.width]:
            self._open.pop(done).close()

    def close(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Closes every file (files no record went to are written empty). Returns per file name its
        records' lengths and train events (int32 `[records]`).

        Raises:
          ValueError: fewer or more records were written than `num_records` (the file names
            and windows were planned for that many).
        """
        if self._written != self.num_records:
            raise ValueError(f"{self._written} records were written, {self.num_records} were planned")
        for file in range(len(self.names)):
            if file not in self._open and not self._lengths[file]:
                ArrayRecordWriter(str(self.directory / self.names[file]), WRITER_OPTIONS).close()
        for writer in self._open.values():
            writer.close()
        self._open.clear()
        joined = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int32)  # noqa: E731
        return ({name: joined(parts) for name, parts in zip(self.names, self._lengths)},
                {name: joined(parts) for name, parts in zip(self.names, self._train)})
