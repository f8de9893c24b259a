"""`gem-data convert`: an event log -> vocabularies + per-user sequences in sharded ArrayRecord files.

Two streaming passes over the input, in memory bounded by `ConvertOptions.memory_mb`:

1. Every input file is read in record batches (`readers.stream_rows`), its
   values checked, its item ids, actions and feature values counted (in a
   second thread, one batch behind), and its rows appended, by a hash of the user id,
   to one of B bucket files (Arrow IPC, in a scratch folder of the output).
   B = 4 x ceil(events x 320 bytes / (memory - a fixed share)) (or 1 when one
   bucket fits), events estimated from Parquet row counts or the CSV size over
   its mean line length (`memory_plan`, `bucket_count`). The inputs' sha256 are
   computed in a background thread meanwhile.
2. The users are counted bucket by bucket (a user's events are all in one
   bucket), the vocabularies built (`vocab.Vocab.build`: min count, max size, OOV),
   the split resolved (a time quantile exactly, from histograms of the bucket
   times), then the buckets are read back in groups of consecutive buckets
   (`bucket_groups`) whose events fit the memory left once the vocabularies
   are held, each group's ids mapped to rows (its users among its buckets'
   kept users only: the user vocabulary is not hashed whole), its events sorted by (user,
   time, input order), the events equal in every column read to an earlier one counted
   (`duplicate_rows`; they are kept, and the manifest names the first one's file and
   line or row) and written as one record per user (`records.RecordLayout`) to the
   shards, dealt in turn.

Memory: besides a group's events, the vocabularies (distinct ids and counts,
and the hash tables of their lookups) and the item feature table (rows x max
values) are held; they grow with the number of distinct ids, not with the
number of events, and the groups shrink to leave them room. Grouping the
buckets by their measured sizes after pass 1 keeps a group within the budget
when a few heavy users make some buckets several times the mean. One user's
events must fit in the budget: a bucket larger than it (a user with more events
than the budget holds) is a group of its own, and the conversion says so.

The output directory (written as `OUT.partial`, moved to `OUT` when complete)::

    manifest.json            everything below, the schema and the settings
    vocab/user.csv           row,id,count (row 0 padding, row 1 OOV; `vocab` module)
    vocab/item.csv
    vocab/action.csv         with an action column
    vocab/<side>_feature.<name>.csv
    item_features.npz        int32 [item rows, max values] per item feature
    lengths.npz              int32 [records] of each shard (its file name): events per record
    train_events.npz         int32 [records] of each shard: train events per record (a user's
                             first that many events are train, the rest eval: every split
                             rule is a cutoff in the user's time order)
    item_train_labels.npz    `events` int64 [item rows]: train events of each item;
                             `positives` int64 [item rows, K]: their positive labels per task
    shards/part-SSSSS-of-NNNNN.array_record

With `lengths.npz` and `train_events.npz` every process knows every example (its
record, position and split) and its history length without reading a record, and
`item_train_labels.npz` gives the item-mean-label baseline.

Re-running on the same inputs and settings is a no-op (decided by size and
modification time, or by sha256 when those moved; `manifest.check_unchanged`).
A changed input or setting is refused with what changed unless `overwrite`,
which converts again and replaces the directory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gem_jax.data.ingest import manifest as manifest_lib
from gem_jax.data.ingest.readers import (
    BadRows, ColumnKind, Format, InputFile, event_kinds, expand_inputs, prefetched, require_columns, row_location, stream_rows,
)
from gem_jax.data.ingest.records import RecordLayout
from gem_jax.data.ingest.shard_writer import ShardWriters
from gem_jax.data.ingest.schema import EventSchema, FeatureColumn, Side, label_values
from gem_jax.data.ingest.split import SplitRule, eval_flags, resolve_cutoff
from gem_jax.data.ingest.stats import length_summary
from gem_jax.data.ingest.vocab import FIRST_ID_ROW, CountAccumulator, Vocab
from gem_jax.data.rows import BadRowKind, DataFormatError, OnBadRow

_BYTES_PER_EVENT = 320  # memory while sorting one bucket, per event (ids, rows, sort orders, records)
_BASE_MB = 320  # the interpreter, numpy, pyarrow, its CSV reader (about 100 MiB of its own), the writers
_READ_AHEAD_BLOCKS = 8  # batches in flight (read ahead, parsed, partitioned), in CSV blocks
_BUCKETS_PER_GROUP = 4  # pass 1 writes this many more buckets than the budget needs; pass 2 groups them by size
_INDEX_SHARE = 4  # the open shard files' chunk indexes may hold up to 1/4 of the sorting memory (`ShardWriters`)
_LOOKUP_COPIES = 4  # a vocabulary's memory while it is looked up whole: its ids and counts, and pyarrow's hash table of the ids
DEFAULT_MEMORY_MB = 2048  # `--memory-mb`'s default
_ROW_BITS = 40  # a bucket row's `source`: its input file's index << 40 | its line or row number there (< 2^40; `readers.stream_rows`)


def _block_mb(memory_mb: int) -> int:
    """CSV MiB parsed per batch under a `memory_mb` budget: 1 to 16."""
    return max(1, min(16, memory_mb // 128))


def _minimum_memory_mb() -> int:
    """The smallest `--memory-mb` that `memory_plan` accepts: its fixed share
    (which grows with the block size, itself set by the budget) plus 64 MiB."""
    memory_mb = _BASE_MB + _READ_AHEAD_BLOCKS + 64
    while memory_mb < _BASE_MB + _READ_AHEAD_BLOCKS * _block_mb(memory_mb) + 64:
        memory_mb = _BASE_MB + _READ_AHEAD_BLOCKS * _block_mb(memory_mb) + 64
    return memory_mb


def memory_plan(memory_mb: int) -> tuple[int, int]:
    """`(block_size, bucket_bytes)` under a `memory_mb` budget: CSV bytes parsed per batch (1 to 16 MiB) and the
    memory left for sorting one bucket once the fixed share (interpreter, read-ahead) is taken.

    Raises:
      ValueError: `memory_mb` below that fixed share plus 64 MiB (the minimum named, as `--memory-mb`).
    """
    block_mb = _block_mb(memory_mb)
    fixed = _BASE_MB + _READ_AHEAD_BLOCKS * block_mb
    if memory_mb < fixed + 64:
        raise ValueError(f"--memory-mb must be at least {_minimum_memory_mb()} (MiB), got {memory_mb}")
    return block_mb << 20, (memory_mb - fixed) << 20


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """How to convert (the `gem-data convert` flags other than the schema).

    Attributes:
      split: the train / eval split.
      min_count: user and item ids seen fewer times go to the OOV row.
      max_vocab: at most this many user ids and item ids are kept each (the
        most frequent), or None.
      shards: number of shard files, all written at once; None: windows of 16
        files (fewer when there are fewer users), as many windows as the
        memory for their indexes needs (`ShardWriters`).
      memory_mb: the memory budget (MiB) that sets the bucket count, the size
        of pass 2's bucket groups and how many shard files are open at once.
      on_bad_row: `OnBadRow.RAISE` (default) or `SKIP` (count and drop).
      vocab_from: a converted directory whose vocabularies to reuse (ids
        unseen there go to OOV and are counted), or None to build them.
      buckets: the bucket count of pass 1, or None to derive it from the
        input size and `memory_mb`; pass 2 groups them by the memory budget
        either way.
    """

    split: SplitRule
    min_count: int = 1
    max_vocab: int | None = None
    shards: int | None = None
    memory_mb: int = DEFAULT_MEMORY_MB
    on_bad_row: OnBadRow = OnBadRow.RAISE
    vocab_from: str | None = None
    buckets: int | None = None

    def __post_init__(self):
        for flag, value in (("--min-count", self.min_count), ("--max-vocab", self.max_vocab), ("--shards", self.shards)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        memory_plan(self.memory_mb)

    def settings(self, schema: EventSchema) -> dict:
        """What the output depends on (compared by `manifest.check_unchanged`)."""
        return {
            "schema": schema.to_json(),
            "split": self.split.to_json(),
            "min_count": self.min_count,
            "max_vocab": self.max_vocab,
            "shards": self.shards,
            "on_bad_row": self.on_bad_row.value,
            "vocab_from": str(Path(self.vocab_from).resolve()) if self.vocab_from else None,
        }


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """`out`: the converted directory; `manifest`: its manifest; `status`: "converted" or why nothing was done."""

    out: Path
    manifest: dict
    status: str


def _vocab_name(feature: FeatureColumn) -> str:
    return f"{feature.side.value}_feature.{feature.name}"


def vocab_names(schema: EventSchema) -> list[str]:
    """The vocabularies a conversion under `schema` builds (or reuses): user, item, action, one per feature."""
    return ["user", "item", *(["action"] if schema.action else []), *(_vocab_name(f) for f in schema.features)]


def check_vocab_from(directory: str | os.PathLike, names: list[str]) -> None:
    """`--vocab-from directory` is a converted directory holding the vocabulary files `names` (`vocab/<name>.csv`).

    Raises:
      DataFormatError: it does not exist, is not a converted directory, or lacks one of the files (named).
    """
    where = f"--vocab-from {directory}"
    path = Path(directory)
    if not path.exists():
        raise DataFormatError(f"{where}: no such directory; name a directory gem-data convert wrote")
    if not path.is_dir():
        raise DataFormatError(f"{where}: not a directory; name a directory gem-data convert wrote")
    if not (path / manifest_lib.MANIFEST).is_file():
        raise DataFormatError(f"{where}: not a converted directory (no {manifest_lib.MANIFEST}); name a directory gem-data convert wrote")
    missing = [f"vocab/{name}.csv" for name in names if not (path / "vocab" / f"{name}.csv").is_file()]
    if missing:
        raise DataFormatError(
            f"{where}: lacks {', '.join(missing)}: this conversion's columns need a vocabulary the reused one has none of "
            "(convert it with the same --action and feature columns, or leave --vocab-from out)"
        )


def bucket_of(ids: pa.Array, num_buckets: int) -> np.ndarray:
    """int64 `[n]` bucket of each non-empty string id: a multiplicative hash of its UTF-8 bytes, mod B.

    The same id gets the same bucket in every process and run (pass distinct
    ids: each value is hashed).
    """
    if num_buckets == 1:
        return np.zeros(len(ids), dtype=np.int64)
    ids = pc.cast(ids, pa.large_string())
    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int64, count=len(ids) + 1, offset=ids.offset * 8)
    data = np.frombuffer(ids.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    lengths = np.diff(offsets)
    position = np.arange(data.size, dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lengths)
    multipliers = (np.arange(1, 65, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    with np.errstate(over="ignore"):
        mixed = np.add.reduceat(data.astype(np.uint64) * multipliers[position % 64], offsets[:-1] - offsets[0]) + lengths.astype(np.uint64)
        mixed ^= mixed >> np.uint64(31)
        mixed *= np.uint64(0xBF58476D1CE4E5B9)
        mixed ^= mixed >> np.uint64(29)
    return (mixed % np.uint64(num_buckets)).astype(np.int64)


def _estimated_events(files: Sequence[InputFile]) -> int:
    """Events in the inputs: Parquet row counts; for CSV, the size over the mean line length of
    its first MiB (compressed files counted at 4x their size)."""
    total = 0
    for file in files:
        if file.format is Format.PARQUET:
            total += pq.ParquetFile(str(file.path)).metadata.num_rows
            continue
        with pa.input_stream(str(file.path), compression="detect") as stream:
            head = stream.read(1 << 20)
        line = max(1.0, len(head) / max(1, head.count(b"\n")))
        total += math.ceil(os.path.getsize(file.path) * (4 if file.path.name.endswith((".gz", ".bz2")) else 1) / line)
    return total


def bucket_count(files: Sequence[InputFile], bucket_bytes: int) -> int:
    """Pass 1's bucket count B: 1 when the inputs' (estimated) events fit `bucket_bytes` to sort, else
    `_BUCKETS_PER_GROUP` times the buckets they need (at most 4096), for pass 2 to group by their sizes."""
    needed = math.ceil(_estimated_events(files) * _BYTES_PER_EVENT / bucket_bytes)
    return 1 if needed <= 1 else min(4096, _BUCKETS_PER_GROUP * needed)


def max_sorted_events(sort_bytes: int) -> int:
    """The events (at least 1) a bucket group may hold for pass 2 to sort them within `sort_bytes`."""
    return max(1, sort_bytes // _BYTES_PER_EVENT)


def _rule_columns(schema: EventSchema) -> list[str]:
    """The number columns that rule labels read (`like=rating>=4`), once each."""
    kinds = event_kinds(schema)
    return list(dict.fromkeys(rule.column for rule in schema.labels if kinds[rule.column] is ColumnKind.NUMBER))


def bucket_schema(schema: EventSchema) -> pa.Schema:
    """The columns of the bucket files (`Buckets`, `bucket_rows`) under `schema`: `user`, `item` (string), `time`
    (int64), `action`, `label/<task>` (uint8), `weight` (float32) and `feature/<name>` for the event columns it
    names; then what those do not keep, for telling duplicate events (`duplicate_rows`): `value/<column>` (float64),
    the values rule labels read (a 0/1 label keeps its column's value), and `source` (int64: the row's input file
    index << 40 | its line or row number there, `readers.stream_rows`)."""
    fields = [pa.field("user", pa.string()), pa.field("item", pa.string()), pa.field("time", pa.int64())]
    fields += [pa.field("action", pa.string())] if schema.action else []
    fields += [pa.field(f"label/{rule.name}", pa.uint8()) for rule in schema.labels]
    fields += [pa.field("weight", pa.float32())] if schema.weight else []
    fields += [pa.field(f"feature/{f.name}", pa.list_(pa.string()) if f.multi else pa.string()) for f in schema.event_features]
    fields += [pa.field(f"value/{column}", pa.float64()) for column in _rule_columns(schema)]
    return pa.schema(fields + [pa.field("source", pa.int64())])


def bucket_rows(schema: EventSchema, columns: dict[str, object], rows: np.ndarray, file_number: int) -> pa.Table:
    """A batch of `readers.stream_rows` (`columns`, `rows`) of input file `file_number` as bucket rows (`bucket_schema`)."""
    arrays = {"user": columns[schema.user], "item": columns[schema.item], "time": pa.array(columns[schema.time])}
    if schema.action:
        arrays["action"] = columns[schema.action]
    for rule in schema.labels:
        arrays[f"label/{rule.name}"] = pa.array(label_values(rule, columns[rule.column]).astype(np.uint8))
    if schema.weight:
        arrays["weight"] = pa.array(columns[schema.weight].astype(np.float32))
    for feature in schema.event_features:
        arrays[f"feature/{feature.name}"] = columns[feature.name]
    for column in _rule_columns(schema):
        arrays[f"value/{column}"] = pa.array(columns[column])
    arrays["source"] = pa.array(rows | (file_number << _ROW_BITS))
    return pa.table(arrays, schema=bucket_schema(schema))


def positive_labels(table: pa.Table, schema: EventSchema) -> np.ndarray:
    """int64 `[tasks]`: how many of bucket rows `table` have each task's label (of `schema`) 1."""
    return np.array([table[f"label/{rule.name}"].to_numpy().sum() for rule in schema.labels], dtype=np.int64)


class Buckets:
    """B Arrow IPC files of bucket rows (`bucket_schema`), partitioned by a hash of the user id (`bucket_of`)."""

    def __init__(self, directory: Path, count: int, schema: pa.Schema):
        directory.mkdir(parents=True)
        self.paths = [directory / f"bucket-{b:05d}.arrow" for b in range(count)]
        self.schema = schema
        self.events = np.zeros(count, dtype=np.int64)  # rows written to each bucket
        self._writers = [pa.ipc.new_file(str(p), schema) for p in self.paths]

    def write(self, table: pa.Table) -> None:
        """Appends each row of `table` to its user's bucket."""
        if len(self.paths) == 1:
            self._writers[0].write_table(table)
            self.events[0] += table.num_rows
            return
        users = pc.dictionary_encode(table["user"].combine_chunks())  # each distinct user hashed once
        bucket = bucket_of(users.dictionary, len(self.paths))[users.indices.to_numpy(zero_copy_only=False)]
        order = np.argsort(bucket, kind="stable")
        sizes = np.bincount(bucket, minlength=len(self.paths))
        self.events += sizes
        ends = np.cumsum(sizes)
        table = table.take(pa.array(order))
        start = 0
        for b, end in enumerate(ends):
            if end > start:
                self._writers[b].write_table(table.slice(start, end - start))
            start = end

    def close(self) -> None:
        for writer in self._writers:
            writer.close()

    def read(self, b: int, columns: list[str] | None = None) -> pa.Table:
        with pa.memory_map(str(self.paths[b])) as source:
            return pa.ipc.open_file(source).read_all().select(columns) if columns else pa.ipc.open_file(source).read_all()

    def read_group(self, group: range) -> pa.Table:
        """The rows of buckets `group` (consecutive), bucket after bucket."""
        return pa.concat_tables([self.read(b) for b in group])


def bucket_groups(events: np.ndarray, max_events: int) -> list[range]:
    """Consecutive buckets grouped greedily so that each group holds at most `max_events`
    events (int64 `events` `[B]` per bucket); a bucket above `max_events` is a group alone.
    Empty buckets join their neighbours. Every bucket is in exactly one group, in order."""
    groups, start, held = [], 0, 0
    for b, n in enumerate(events.tolist()):
        if held and held + n > max_events:
            groups.append(range(start, b))
            start, held = b, 0
        held += n
    if len(events):
        groups.append(range(start, len(events)))
    return groups


def stable_order(major: np.ndarray, minor: np.ndarray) -> np.ndarray:
    """int64 `[n]`: `np.lexsort((minor, major))` (by `major`, then `minor`, ties in input order) for
    integer arrays `[n]`, 3 to 5x faster on bucket-sized inputs.

    When the ranges fit, one unstable sort of the key `major * span(minor) + minor` and a
    second sort of only the positions whose keys tie; else `np.lexsort`.
    """
    if major.size == 0:
        return np.zeros(0, dtype=np.int64)
    low, span = int(minor.min()), int(minor.max()) - int(minor.min()) + 1
    if int(major.min()) < 0 or (int(major.max()) + 1) * span >= 1 << 62:
        return np.lexsort((minor, major))
    key = major.astype(np.int64) * span + (minor.astype(np.int64) - low)
    order = np.argsort(key)
    sorted_key = key[order]
    tie = sorted_key[1:] == sorted_key[:-1]
    if tie.any():
        tied = np.flatnonzero(np.r_[tie, False] | np.r_[False, tie])
        run = np.cumsum(np.r_[True, ~tie])[tied]
        order[tied] = order[tied][np.lexsort((order[tied], run))]
    return order


def _value_codes(values) -> np.ndarray:
    """int64 `[n]` codes >= 0, equal exactly where the values are, of an Arrow array of numbers, of strings
    (dictionary codes; null is a value of its own) or of lists of strings (the codes of the lists of codes)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_list(values.type):
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(pc.fill_null(pc.list_value_length(values), 0).to_numpy(zero_copy_only=False), out=offsets[1:])
        flat = pc.cast(pa.array(_value_codes(pc.list_flatten(values))), pa.string())
        values = pc.binary_join(pa.LargeListArray.from_arrays(pa.array(offsets), flat), " ")
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return pc.dictionary_encode(values, null_encoding="encode").indices.to_numpy(zero_copy_only=False).astype(np.int64)
    numbers = values.to_numpy(zero_copy_only=False)
    if pa.types.is_unsigned_integer(values.type):
        return numbers.astype(np.int64)
    return np.unique(numbers, return_inverse=True)[1].astype(np.int64)  # floats: -0.0 and 0.0 are equal


def duplicate_rows(table: pa.Table, users: np.ndarray, times: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a bucket group equal in every column read to an earlier row, and the first row each equals.

    Equal rows have one user and one time, so `order` (`stable_order(users, times)`: by user,
    time, input order) makes them neighbours. Only the rows that tie on (user, time) with
    another are compared, a column at a time (the item first), each column's exact codes
    (`_value_codes`) splitting the groups of rows equal so far and dropping the rows left
    alone. A group without ties costs two comparisons per event.

    Args:
      table: the group's bucket rows (`Buckets`), in input order within each user.
      users: int `[n]` each row's user code; times: int64 `[n]`; order: int64 `[n]`.

    Returns:
      `(copies, originals)`: int64 `[d]` rows of `table`: each row equal to an earlier one,
      and the first row (in input order) it equals.
    """
    tie = np.ones(max(0, order.size - 1), dtype=bool)
    for column in (users, times):  # one sorted copy at a time
        column = column[order]
        tie &= column[1:] == column[:-1]
    if not tie.any():
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    tied = np.r_[tie, False] | np.r_[False, tie]
    rows = order[tied]
    group = np.cumsum(np.r_[True, ~tie][tied])  # the (user, time) runs, each in input order
    del tie, tied
    for name in sorted((c for c in table.column_names if c not in ("user", "time", "source")), key=lambda c: c != "item"):
        if rows.size == 0:
            break
        key = _value_codes(table[name].take(pa.array(rows)))
        by = stable_order(group, key)  # stable: each group stays in input order
        rows, group, key = rows[by], group[by], key[by]
        del by
        group = np.cumsum(np.r_[True, (group[1:] != group[:-1]) | (key[1:] != key[:-1])])
        del key
        kept = np.bincount(group)[group] > 1
        rows, group = rows[kept], group[kept]
    if rows.size == 0:
        return rows, rows
    first = np.r_[True, group[1:] != group[:-1]]
    originals = rows[np.maximum.accumulate(np.where(first, np.arange(rows.size), 0))]
    return rows[~first], originals[~first]


def _user_counts(buckets: Buckets) -> pa.Table:
    """`id` (string), `count` (int64): every user's events, counted bucket by bucket (a user is in one
    bucket, so the buckets' counts are disjoint: no merge of the whole user set is ever hashed)."""
    parts = []
    for b in range(len(buckets.paths)):
        counts = pc.value_counts(buckets.read(b, ["user"])["user"].combine_chunks())
        parts.append(pa.table({"id": counts.field("values"), "count": pc.cast(counts.field("counts"), pa.int64())}))
    return pa.concat_tables(parts).combine_chunks()


def _kept_ids_by_bucket(vocab: Vocab, num_buckets: int, chunk: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """`(order, starts)`: indices of `vocab.ids` (int64 `[n]`) sorted by their bucket (`bucket_of`),
    bucket b's at `order[starts[b]:starts[b + 1]]` (`starts` int64 `[B + 1]`); hashed a chunk at a time."""
    buckets = np.concatenate([bucket_of(vocab.ids.slice(k, chunk), num_buckets) for k in range(0, len(vocab.ids), chunk)] or [np.zeros(0, np.int64)])
    order = np.argsort(buckets, kind="stable")
    return order, np.searchsorted(buckets[order], np.arange(num_buckets + 1))


def _feature_rows(vocab: Vocab, values, width: int) -> np.ndarray:
    """int32 `[n, width]` rows of a string (one value) or list<string> array (unused slots 0)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not pa.types.is_list(values.type):
        return vocab.lookup(values)[:, None]
    out = np.zeros((len(values), width), dtype=np.int32)
    flat = pc.list_flatten(values)
    parent = pc.list_parent_indices(values).to_numpy(zero_copy_only=False)
    starts = np.searchsorted(parent, np.arange(len(values)))
    out[parent, np.arange(parent.size) - starts[parent]] = vocab.lookup(flat)
    return out


def _max_values(values) -> int:
    if not pa.types.is_list(values.type):
        return 1
    return int(pc.max(pc.list_value_length(values)).as_py() or 0)


def _last_per_group(starts: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group (events `starts[k]:starts[k+1]`, in time order) the rows `[m]` of its last event
    with a value, and whether its events with a value disagree; int32 `[g, m]`, bool `[g]`."""
    has = rows.any(axis=1)
    index = np.where(has, np.arange(rows.shape[0]), -1)
    group = np.repeat(np.arange(starts.size - 1), np.diff(starts))
    last = np.full(starts.size - 1, -1, dtype=np.int64)
    np.maximum.at(last, group, index)
    chosen = np.where((last >= 0)[:, None], rows[np.maximum(last, 0)], 0)
    differs = has & (rows != chosen[group]).any(axis=1)
    conflict = np.bincount(group[differs], minlength=starts.size - 1) > 0
    return chosen.astype(np.int32), conflict


class DuplicateEvents:
    """The events of a log equal in every column read to an earlier one, counted bucket group by bucket group
    (`duplicate_rows`), and the earliest of them in input order."""

    def __init__(self):
        self.count = 0
        self._first: tuple[int, int] | None = None  # (source, its original's source) of the earliest duplicate

    def add(self, table: pa.Table, users: np.ndarray, times: np.ndarray, order: np.ndarray) -> None:
        """Counts the duplicates among a bucket group's rows (`duplicate_rows`'s arguments)."""
        copies, originals = duplicate_rows(table, users, times, order)
        if copies.size == 0:
            return
        self.count += copies.size
        sources = table["source"].take(pa.array(copies)).to_numpy()
        k = int(np.argmin(sources))
        if self._first is None or sources[k] < self._first[0]:
            self._first = (int(sources[k]), table["source"][int(originals[k])].as_py())

    def first(self, files: Sequence[InputFile]) -> dict | None:
        """The manifest's `first_duplicate_event` of a log read from `files` (in `bucket_rows`' file numbering):
        `{"file", "location", "copy_of"}` of the earliest duplicate and the row it repeats ("line N", or
        "FILE, line N" in another file), or None when there is none."""
        if self._first is None:
            return None

        def place(source: int) -> tuple[InputFile, str]:
            file = files[source >> _ROW_BITS]
            return file, row_location(file, source & ((1 << _ROW_BITS) - 1))

        (file, location), (original_file, original_location) = (place(source) for source in self._first)
        return {"file": str(file), "location": location, "copy_of": original_location if original_file == file else f"{original_file}, {original_location}"}


def group_order(table: pa.Table) -> tuple[pa.DictionaryArray, np.ndarray, np.ndarray]:
    """A bucket group's (`Buckets.read_group`) users dictionary-encoded, its times (int64 `[n]`) and the order
    (int64 `[n]`) that sorts its rows by (user code, time), ties in input order (`stable_order`)."""
    users = pc.dictionary_encode(table["user"]).combine_chunks()
    times = table["time"].to_numpy()
    return users, times, stable_order(users.indices.to_numpy(), times)


def count_duplicates(buckets: Buckets, max_events: int) -> DuplicateEvents:
    """The duplicate events of the rows in `buckets`, read in groups of at most `max_events` events (`bucket_groups`),
    each group sorted as pass 2 sorts it (`group_order`)."""
    duplicates = DuplicateEvents()
    for group in bucket_groups(buckets.events, max_events):
        table = buckets.read_group(group)
        users, times, order = group_order(table)
        duplicates.add(table, users.indices.to_numpy(), times, order)
    return duplicates


def _read_table(schema: EventSchema, side: Side, bad: BadRows, block_size: int) -> tuple[pa.Array, dict[str, pa.Array]]:
    """A side table: its key ids (duplicates reported as bad rows, the first kept) and feature columns."""
    files = list(expand_inputs([schema.table(side)], schema.delimiter))
    features = schema.side_features(side)
    key = schema.key(side)
    kinds = {key: ColumnKind.ID} | {f.name: ColumnKind.MULTI_CATEGORY if f.multi else ColumnKind.CATEGORY for f in features}
    parts = [pa.table(columns) for _, columns, _ in stream_rows(files, kinds, bad, separator=schema.multi_separator, block_size=block_size)]
    table = pa.concat_tables(parts) if parts else pa.table({c: pa.array([], pa.string()) for c in kinds})
    codes = pc.dictionary_encode(table[key]).combine_chunks()
    _, first = np.unique(codes.indices.to_numpy(), return_index=True)
    if first.size < table.num_rows:
        duplicate = np.ones(table.num_rows, dtype=bool)
        duplicate[first] = False
        ids = table[key]
        bad.many(str(schema.table(side)), duplicate, lambda i: f"{key} {ids[i].as_py()!r}", BadRowKind.DUPLICATE_ID, lambda i: f"the {side.value} table must hold each id once")
        table = table.take(pa.array(np.sort(first)))
    return table[key].combine_chunks(), {f.name: table[f.name].combine_chunks() for f in features}


def convert(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    schema: EventSchema,
    options: ConvertOptions,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> ConvertResult:
    """Converts an event log (module docstring).

    Args:
      inputs: event files, directories or globs (`readers.expand_inputs`).
      out: the output directory.
      schema: which column is what.
      options: split, vocabulary, shard, memory and bad-row settings.
      overwrite: convert again when `out` holds a conversion of other inputs
        or settings (else refused). A non-empty `out` without a manifest is
        always refused.
      log: receives progress lines.

    Returns:
      The result; `status` says whether anything was done and why not.

    Raises:
      BadRowError: a malformed row under `OnBadRow.RAISE` (file, line or row group and row, column, value).
      DataFormatError: a missing or mistyped column, files that disagree, an
        output directory holding something else (without `overwrite`), no
        events left.
    """
    out = Path(out)
    files = list(expand_inputs(inputs, schema.delimiter))
    table_files = {side: list(expand_inputs([schema.table(side)], schema.delimiter)) for side in Side if schema.table(side)}
    all_paths = [str(f.path) for f in files] + [str(f.path) for side in table_files for f in table_files[side]]
    settings = options.settings(schema)
    older = manifest_lib.older_version(out)
    if older is not None:
        log(f"converting again: {out} holds a conversion of format version {older}, this gem-data writes version {manifest_lib.VERSION}")
    elif (out / manifest_lib.MANIFEST).exists():
        previous = manifest_lib.read_manifest(out)
        unchanged, reason = manifest_lib.check_unchanged(previous, settings, all_paths)
        if unchanged:
            return ConvertResult(out, previous, f"unchanged ({reason}): nothing to do")
        if not overwrite:
            raise DataFormatError(f"{out} holds a conversion of other inputs or settings: {reason}; pass --overwrite to convert again")
        log(f"converting again: {reason}")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataFormatError(f"{out} exists and is not a converted log (no {manifest_lib.MANIFEST}); choose another --out: only a converted log is ever replaced")

    if options.vocab_from is not None:  # a wrong path fails now, not after pass 1
        check_vocab_from(options.vocab_from, vocab_names(schema))
    require_columns(files, list(event_kinds(schema)))  # a misspelt column fails now, not after a pass over the log
    for side, side_files in table_files.items():
        require_columns(side_files, [schema.key(side)] + [f.name for f in schema.side_features(side)])
    started = time.perf_counter()
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hashing = concurrent.futures.ThreadPoolExecutor(1)
    hashes = {p: hashing.submit(manifest_lib.sha256_of, p) for p in all_paths}
    try:
        manifest = _convert(files, table_files, work, schema, options, log)
        manifest["settings"] = settings
        manifest["inputs"] = [manifest_lib.file_identity(p) | {"sha256": hashes[p].result()} for p in all_paths]
        manifest["seconds"] = round(time.perf_counter() - started, 2)
        shutil.rmtree(work / "buckets")
        manifest_lib.write_manifest(work, manifest)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        hashing.shutdown(cancel_futures=True)
    return ConvertResult(out, manifest_lib.read_manifest(out), "converted")


def _convert(files, table_files, work: Path, schema: EventSchema, options: ConvertOptions, log) -> dict:
    if not schema.labels:
        raise DataFormatError("at least one --label is needed to convert (a task to train)")
    bad = BadRows(options.on_bad_row)
    kinds = event_kinds(schema)
    event_features = schema.event_features
    block_size, bucket_bytes = memory_plan(options.memory_mb)
    num_buckets = options.buckets or bucket_count(files, bucket_bytes)
    counters = {"item": CountAccumulator()}  # users are counted per bucket after pass 1 (`_user_counts`)
    if schema.action:
        counters["action"] = CountAccumulator()
    for feature in event_features:
        counters[_vocab_name(feature)] = CountAccumulator()
    max_values = {f.name: 1 for f in schema.features}
    positives = np.zeros(len(schema.labels), dtype=np.int64)
    events, t_low, t_high = 0, np.iinfo(np.int64).max, np.iinfo(np.int64).min

    # Pass 1: check, count, partition by user.
    buckets = Buckets(work / "buckets", num_buckets, bucket_schema(schema))
    file_index = {file: k for k, file in enumerate(files)}
    counted_columns = [(schema.item, counters["item"])] + ([(schema.action, counters["action"])] if schema.action else [])
    counted_columns += [(f.name, counters[_vocab_name(f)]) for f in event_features]

    def count(columns):
        for name, counter in counted_columns:
            counter.add(columns[name])

    log(f"reading {len(files)} file(s) into {num_buckets} bucket(s)")
    with concurrent.futures.ThreadPoolExecutor(1) as counting_pool:  # ids, actions and features are counted beside the bucketing, one merge at a time
        counting = None
        for file, columns, rows in prefetched(stream_rows(files, kinds, bad, separator=schema.multi_separator, block_size=block_size)):
            n = len(columns[schema.time])
            if n == 0:
                continue
            if counting is not None:
                counting.result()  # one batch in flight: memory stays bounded
            counting = counting_pool.submit(count, columns)
            table = bucket_rows(schema, columns, rows, file_index[file])
            positives += positive_labels(table, schema)
            for feature in event_features:
                max_values[feature.name] = max(max_values[feature.name], _max_values(columns[feature.name]))
            events += n
            t_low, t_high = min(t_low, int(columns[schema.time].min())), max(t_high, int(columns[schema.time].max()))
            buckets.write(table)
        if counting is not None:
            counting.result()
    buckets.close()
    if events == 0:
        raise DataFormatError(f"no events left in {', '.join(map(str, files))}" + (f" ({bad.total} bad row(s) skipped)" if bad.total else ""))
    log(f"read {events} events in pass 1")

    # Side tables.
    tables = {}
    for side in table_files:
        keys, feature_columns = _read_table(schema, side, bad, block_size)
        for feature in schema.side_features(side):
            counter = counters[_vocab_name(feature)] = CountAccumulator()
            counter.add(feature_columns[feature.name])
            max_values[feature.name] = max(1, _max_values(feature_columns[feature.name]))
        tables[side] = (keys, feature_columns)

    # Vocabularies.
    user_counts = _user_counts(buckets)
    distinct_users = user_counts.num_rows
    vocabs: dict[str, Vocab] = {}
    reused = Path(options.vocab_from) if options.vocab_from else None
    unseen: dict[str, int] = {}
    for name in ["user", *counters]:
        counts = user_counts if name == "user" else counters[name].table()
        if reused is not None:
            vocabs[name] = Vocab.load(name, reused / "vocab" / f"{name}.csv")
            known = pc.is_in(counts["id"], value_set=vocabs[name].ids)
            unseen[name] = int(pc.sum(pc.filter(counts["count"], pc.invert(known))).as_py() or 0)
            total = int(pc.sum(counts["count"]).as_py() or 0)
            if name == "item" and total and unseen[name] == total:  # new users are expected in eval logs; no known item is a wrong column
                example = counts["id"][0].as_py()
                raise DataFormatError(
                    f"--vocab-from {reused}: none of this log's {total} item occurrences (e.g. {example!r}) is in its item vocabulary "
                    f"({reused / 'vocab' / 'item.csv'}), so every item would be OOV: is --item the column that conversion read as the item?"
                )
        elif name in ("user", "item"):
            vocabs[name] = Vocab.build(name, counts, options.min_count, options.max_vocab)
        else:
            vocabs[name] = Vocab.build(name, counts)
    del counters, user_counts, counts
    pa.default_memory_pool().release_unused()  # pass 1's merges freed: return their pages before pass 2 sizes its groups

    # Split.
    cutoff = resolve_cutoff(options.split, lambda: (buckets.read(b, ["time"])["time"].to_numpy() for b in range(num_buckets)), events, t_low, t_high)

    layout = RecordLayout(
        num_tasks=len(schema.labels),
        has_action=schema.action is not None,
        has_weight=schema.weight is not None,
        user_features=tuple((f.name, max_values[f.name]) for f in schema.side_features(Side.USER)),
    )
    item_features = schema.side_features(Side.ITEM)
    item_rows = vocabs["item"].num_rows
    item_table = {f.name: np.zeros((item_rows, max_values[f.name]), dtype=np.int32) for f in item_features}
    item_time = np.full(item_rows, np.iinfo(np.int64).min)
    item_conflict = {f.name: np.zeros(item_rows, dtype=bool) for f in item_features}
    conflicts: dict[str, int] = {}
    for feature in item_features:
        if Side.ITEM in tables:
            keys, feature_columns = tables[Side.ITEM]
            at = pc.index_in(vocabs["item"].ids, value_set=keys)
            found = at.is_valid().to_numpy(zero_copy_only=False)
            rows = _feature_rows(vocabs[_vocab_name(feature)], feature_columns[feature.name], max_values[feature.name])
            item_table[feature.name][FIRST_ID_ROW:][found] = rows[pc.drop_null(at).to_numpy()]
            conflicts["items without a row in the item table"] = int((~found).sum())

    # Pass 2: per group of buckets, map, sort, split, write one record per user.
    users_by_bucket = _kept_ids_by_bucket(vocabs["user"], num_buckets)  # a group's users are looked up among its buckets' only
    held_bytes = vocabs["user"].ids.nbytes + vocabs["user"].counts.nbytes + users_by_bucket[0].nbytes + users_by_bucket[1].nbytes
    held_bytes += _LOOKUP_COPIES * sum(v.ids.nbytes + v.counts.nbytes for name, v in vocabs.items() if name != "user")
    (work / "shards").mkdir()
    shards = ShardWriters(work / "shards", distinct_users, bucket_bytes // _INDEX_SHARE, options.shards)
    held_bytes += shards.index_bytes
    held_bytes += sum(t.nbytes for t in item_table.values()) + item_time.nbytes
    max_events = max_sorted_events(bucket_bytes - held_bytes)
    groups = bucket_groups(buckets.events, max_events)
    oversized = int(np.count_nonzero(buckets.events > max_events))
    if held_bytes > bucket_bytes // 2 or oversized:
        log(
            f"memory: the vocabularies and shard indexes take {held_bytes / 2**20:.0f} MiB of the {bucket_bytes / 2**20:.0f} MiB left for sorting, "
            f"leaving room for {max_events} events at a time"
            + (f"; {oversized} bucket(s) hold more (up to {buckets.events.max()} events: heavy users), each sorted alone above the budget" if oversized else "")
            + "; raise --memory-mb to stay within it"
        )
    item_train_events = np.zeros(item_rows, dtype=np.int64)
    item_train_positives = np.zeros((item_rows, len(schema.labels)), dtype=np.int64)
    split_counts = np.zeros(2, dtype=np.int64)
    eval_positives = np.zeros(len(schema.labels), dtype=np.int64)
    user_conflicts = dict.fromkeys((f.name for f in schema.side_features(Side.USER) if Side.USER not in tables), 0)
    missing_users = 0
    oov_events = {"user": 0, "item": 0}
    duplicates = DuplicateEvents()
    with concurrent.futures.ThreadPoolExecutor(1) as lookup_pool:  # item ids are mapped beside the users' sort
        for g, group in enumerate(groups):
            table = buckets.read_group(group)
            n = table.num_rows
            if n == 0:
                continue
            item_lookup = lookup_pool.submit(vocabs["item"].lookup, table["item"].combine_chunks())
            encoded, times, order = group_order(table)  # ties keep input order
            codes = encoded.indices.to_numpy()
            duplicates.add(table, codes, times, order)
            num_users = len(encoded.dictionary)
            starts = np.searchsorted(codes[order], np.arange(num_users + 1))

            # Ids are mapped in input order (Arrow), then every column is reordered in numpy.
            events_out = np.zeros(n, dtype=layout.event_dtype)
            events_out["item"] = item_lookup.result()[order]
            events_out["time"] = times[order]
            if schema.action:
                events_out["action"] = vocabs["action"].lookup(table["action"].combine_chunks())[order]
            for k, rule in enumerate(schema.labels):
                events_out["labels"][:, k] = table[f"label/{rule.name}"].to_numpy()[order]
            if schema.weight:
                events_out["weight"] = table["weight"].to_numpy()[order]
            events_out["split"] = eval_flags(options.split, cutoff, starts, events_out["time"])
            split_counts += np.bincount(events_out["split"], minlength=2)
            train = events_out["split"] == 0
            item_train_events += np.bincount(events_out["item"][train], minlength=item_rows)
            for k in range(len(schema.labels)):
                item_train_positives[:, k] += np.bincount(events_out["item"][train], weights=events_out["labels"][train, k] > 0, minlength=item_rows).astype(np.int64)
            eval_positives += (events_out["labels"][events_out["split"] == 1] > 0).sum(axis=0).astype(np.int64)

            users_out = np.zeros(num_users, dtype=layout.user_dtype)
            order_in_vocab, bucket_starts = users_by_bucket
            users_out["user"] = vocabs["user"].lookup_among(encoded.dictionary, order_in_vocab[bucket_starts[group.start] : bucket_starts[group.stop]])
            oov_events["user"] += int(np.diff(starts)[users_out["user"] == 1].sum())
            oov_events["item"] += int((events_out["item"] == 1).sum())
            for feature in schema.side_features(Side.USER):
                vocab, width = vocabs[_vocab_name(feature)], max_values[feature.name]
                if Side.USER in tables:
                    keys, feature_columns = tables[Side.USER]
                    at = pc.index_in(encoded.dictionary, value_set=keys)
                    found = at.is_valid().to_numpy(zero_copy_only=False)
                    missing_users += int((~found).sum())
                    rows = _feature_rows(vocab, feature_columns[feature.name], width)
                    users_out[f"user_feature/{feature.name}"][found] = rows[pc.drop_null(at).to_numpy()]
                else:
                    rows = _feature_rows(vocab, table[f"feature/{feature.name}"], width)[order]
                    chosen, conflict = _last_per_group(starts, rows)
                    users_out[f"user_feature/{feature.name}"] = chosen
                    user_conflicts[feature.name] += int(conflict.sum())
            if item_features and Side.ITEM not in tables:
                # Latest value per item in this bucket, merged into the item table by time.
                item = events_out["item"]
                by_item = stable_order(item, events_out["time"])
                item_sorted = item[by_item]
                item_starts = np.r_[0, np.flatnonzero(np.diff(item_sorted)) + 1, n]
                present = item_sorted[item_starts[:-1]]
                latest = events_out["time"][by_item][item_starts[1:] - 1]
                newer = latest >= item_time[present]
                for feature in item_features:
                    rows = _feature_rows(vocabs[_vocab_name(feature)], table[f"feature/{feature.name}"], max_values[feature.name])[order][by_item]
                    chosen, conflict = _last_per_group(item_starts, rows)
                    before = item_table[feature.name][present]
                    item_conflict[feature.name][present] |= conflict | ((before != chosen).any(axis=1) & before.any(axis=1) & chosen.any(axis=1))
                    item_table[feature.name][present[newer]] = chosen[newer]
                item_time[present] = np.maximum(item_time[present], latest)

            lengths = np.diff(starts).astype(np.int32)
            train_events = np.add.reduceat(train.astype(np.int32), starts[:-1]).astype(np.int32)  # every user has >= 1 event
            shards.write(layout.records(users_out, events_out, starts), lengths, train_events)
            del table, encoded, events_out, users_out
            pa.default_memory_pool().release_unused()
            log(f"bucket group {g + 1}/{len(groups)} (buckets {group.start + 1}-{group.stop} of {num_buckets}): {num_users} users, {n} events")
    lengths_by_shard, train_by_shard = shards.close()
    if not split_counts.all():
        log(f"note: the split ({options.split.describe()}) left {split_counts[0]} train and {split_counts[1]} eval events; gem-train needs both")

    # Files beside the shards.
    (work / "vocab").mkdir()
    for name, vocab in vocabs.items():
        vocab.save(work / "vocab" / f"{name}.csv")
    if item_features:
        for feature in item_features:
            item_table[feature.name][:FIRST_ID_ROW] = 0  # padding and OOV rows carry no features
        np.savez(work / "item_features.npz", **item_table)
    np.savez(work / "lengths.npz", **lengths_by_shard)
    np.savez(work / "train_events.npz", **train_by_shard)
    np.savez(work / "item_train_labels.npz", events=item_train_events, positives=item_train_positives)
    all_lengths = np.concatenate(list(lengths_by_shard.values()))
    if Side.ITEM not in tables:
        for feature in item_features:
            conflicts[f"items whose {feature.name} differs between events (latest kept)"] = int(item_conflict[feature.name][FIRST_ID_ROW:].sum())
    for name, count in user_conflicts.items():
        conflicts[f"users whose {name} differs between events (latest kept)"] = count
    if Side.USER in tables:
        conflicts["users without a row in the user table"] = missing_users // max(1, len(schema.side_features(Side.USER)))

    vocab_info = {}
    for name, vocab in vocabs.items():
        vocab_info[name] = {"file": f"vocab/{name}.csv", "rows": vocab.num_rows, "ids": len(vocab.ids), "oov_count": vocab.oov_count, "dropped_ids": vocab.dropped}
        if name in unseen:
            vocab_info[name]["unseen_occurrences"] = unseen[name]
    return {
        "schema": schema.to_json(),
        "counts": {
            "events": events,
            "users": distinct_users,
            "items": len(vocabs["item"].ids),
            "train_events": int(split_counts[0]),
            "eval_events": int(split_counts[1]),
            "oov_user_events": oov_events["user"],
            "oov_item_events": oov_events["item"],
            "skipped_rows": bad.total,
            "duplicate_events": duplicates.count,
            "buckets": num_buckets,
            "bucket_groups": len(groups),
        },
        "skipped_rows": bad.counts(),
        "first_duplicate_event": duplicates.first(files),
        "feature_conflicts": conflicts,
        "split": options.split.to_json() | {"description": options.split.describe(), "cutoff": cutoff},
        "time_range": [t_low, t_high],
        "vocabularies": vocab_info,
        "features": [
            {"name": f.name, "side": f.side.value, "vocab": f"vocab/{_vocab_name(f)}.csv", "vocab_size": vocabs[_vocab_name(f)].num_rows, "multi": f.multi, "max_values": max_values[f.name]}
            for f in schema.features
        ],
        "tasks": [
            {
                "name": rule.name, "rule": rule.describe(), "positive_rate": float(positives[k] / events),  # over all events
                "train_positive_rate": float(item_train_positives[:, k].sum() / split_counts[0]) if split_counts[0] else None,
                "eval_positive_rate": float(eval_positives[k] / split_counts[1]) if split_counts[1] else None,
            }
            for k, rule in enumerate(schema.labels)
        ],
        "shards": [f"shards/{name}" for name in shards.names],
        "lengths": "lengths.npz",
        "train_events": "train_events.npz",
        "item_train_labels": "item_train_labels.npz",
        "item_features": "item_features.npz" if item_features else None,
        "record_layout": layout.to_json(),
        "sequence_lengths": length_summary(all_lengths),
    }
