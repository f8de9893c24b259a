"""Your own event log as `gem-data convert` wrote it (`Source.EVENTS`): examples, feature spec, batches.

Every event of the log is one example, in the split its flag gives
(`gem_jax.data.ingest.split`): its history is the user's events before it in
the record's order (time, then input order), train and eval alike, at most
`max_seq_len`, the most recent kept (a user's first event has an empty
history); its candidate is the event's item, with the item's features; its
labels are the event's task labels; the user token is the user's row of
`vocab/user.csv`, beside the user's features. An example thus means what it
means for the built-in sources (`gem_jax.data.examples`): the outcome of one
event, predicted from what the user did before it. Events that share the
target's time but come before it in the input belong to its history, with age
0; ages (time buckets) are in the time column's units (Unix seconds for dates).
Every feature is pooled by `Pooling.MEAN` (an embedding table of any size).

Weights: with a weight column, a train example's `Batch.weights` is its event's
weight, so each batch's loss is `sum(w * BCE) / max(sum(w), 1)`; eval examples
weigh 1 each, so the eval metrics (AUC, NE) count every eval event once,
unweighted.

No process reads the whole log. What the global batches need, every example's
split, target and history length, comes from the conversion's index
(`lengths.npz`, `train_events.npz`: events and train events per record) without
reading a record, so every process plans the same global batches (shuffle,
BBS) from it; the item-mean baseline and the train label rates come from
`item_train_labels.npz`. A batch builder then reads, per call, only the records
(users) of the examples it builds, in one batched read (`RecordReader`: random
access, one record per chunk, a shard file opened on its first read), so a
process of a multi-process run (`gem_jax.data.shard`) reads the records of its
own devices' examples and nothing else. Held per process: the
index, about 12 bytes per event (each example's target and history length),
the item tables, and the records read last, up to `RecordReader.CACHE_BYTES`
(1 GiB; a log whose records fit is read from its files once per process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gem_jax.batch import Batch, CategoricalFeature, FeatureSpec
from gem_jax.data.collate import assemble_batch, batch_indices, check_history_lengths
from gem_jax.data.ingest.manifest import DUPLICATES_NOT_COUNTED
from gem_jax.data.ingest.records import RecordLayout
from gem_jax.data.ingest.shards import ConvertedLog, RecordReader
from gem_jax.data.ingest.split import TRAIN
from gem_jax.data.rows import BadRowKind, DataFormatError, SkippedRows

IMPLICIT_ACTION = 1  # the action of every event of a log without an action column (num_actions 2: PAD and it)


@dataclasses.dataclass(frozen=True)
class ConvertedIndex:
    """What every process knows of a converted log without reading a record.

    Records are numbered over the shard files in manifest order, each file's in
    its index order; events are numbered over the records, each user's in time
    order (the order one process reading every record in turn would see).

    Attributes:
      directory: the converted directory.
      manifest: its `manifest.json`.
      layout: the record layout.
      reader: reads records on demand, opening a shard file on its first read.
      starts: int64 `[R + 1]`: record r's events are `starts[r]:starts[r + 1]`.
      train_events: int64 `[R]`: record r's first `train_events[r]` events are train, the rest eval.
      num_actions: the action vocabulary size with PAD_ID (2 without an action column).
      item_features: int32 `[item rows, max_values]` per item feature.
      item_train_events: int64 `[item rows]` train events of each item.
      item_train_positives: int64 `[item rows, K]` their positive labels per task.
    """

    directory: Path
    manifest: dict
    layout: RecordLayout
    reader: RecordReader
    starts: np.ndarray
    train_events: np.ndarray
    num_actions: int
    item_features: dict[str, np.ndarray]
    item_train_events: np.ndarray
    item_train_positives: np.ndarray

    @property
    def num_events(self) -> int:
        return int(self.starts[-1])

    def read(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Records `records` (int64 `[u]`, distinct), in one batched read.

        Returns:
          `(users, events, starts)`: `layout.user_dtype` `[u]`; `layout.event_dtype`
          `[n]`, record `records[k]`'s events at `starts[k]:starts[k + 1]`; int64 `[u + 1]`.

        Raises:
          DataFormatError: a record that does not match its header, or holds other
            counts of events than the index (the shard file and record named).
        """
        try:
            users, events, counts = self.layout.decode_many(self.reader.read(records) if len(records) else [])
        except ValueError as error:
            raise DataFormatError(f"{self.directory}: {error} (among records {self.where(records)})") from None
        expected = self.starts[records + 1] - self.starts[records]
        wrong = np.flatnonzero(counts != expected)
        if wrong.size:
            k = int(wrong[0])
            raise DataFormatError(
                f"{self.directory}: record {self.where(records[k : k + 1])} holds {int(counts[k])} events, the index {int(expected[k])}; "
                "the shards were changed after the conversion (convert again)"
            )
        starts = np.zeros(len(records) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        return users, events, starts

    def where(self, records: np.ndarray) -> str:
        """Records `records` named by shard file and position in it (`shards/part-00001-of-00016.array_record:17`)."""
        first = self.reader.first
        files = np.searchsorted(first, records, side="right") - 1
        return ", ".join(f"{self.manifest['shards'][f]}:{r - first[f]}" for f, r in zip(files.tolist(), records.tolist()))

    def item_mean_labels(self) -> np.ndarray:
        """float32 `[item rows, K]`: mean train label of each item as a candidate; the train mean where an item has no train event."""
        counts = self.item_train_events[:, None]
        overall = self.item_train_positives.sum(axis=0) / max(int(self.item_train_events.sum()), 1)
        return np.where(counts > 0, self.item_train_positives / np.maximum(counts, 1), overall).astype(np.float32)


def read_converted_index(directory: str | os.PathLike) -> ConvertedIndex:
    """The index of a converted directory (`ConvertedIndex`): the manifest, `lengths.npz`,
    `train_events.npz`, `item_train_labels.npz` and the item features; no record is read.

    Raises:
      DataFormatError: not a finished conversion, one of an older format (convert
        again), a shard file missing, or shard files or an index that disagree with
        the manifest's counts (a record that disagrees with the index is found when
        it is read: `ConvertedIndex.read`).
      FileNotFoundError: `directory` does not exist.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"EVENTS data set not found: {directory} is not a folder; set DataConfig.path to the directory gem-data convert wrote")
    log = ConvertedLog(directory)  # process 0 of 1: every shard file, in manifest order
    lengths, train_events = log.lengths().astype(np.int64), log.train_lengths().astype(np.int64)
    counts = log.manifest["counts"]
    if (len(log), len(lengths), int(lengths.sum()), int(train_events.sum())) != (counts["users"],) * 2 + (counts["events"], counts["train_events"]):
        raise DataFormatError(
            f"{directory}: the shard files hold {len(log)} records and the index {len(lengths)} users, {int(lengths.sum())} events, "
            f"{int(train_events.sum())} train events; the manifest {counts['users']} users, {counts['events']} events, "
            f"{counts['train_events']} train events; the conversion was changed after it was written (convert again)"
        )
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    layout = log.layout
    item_train_events, item_train_positives = log.item_train_labels()
    return ConvertedIndex(
        directory=directory,
        manifest=log.manifest,
        layout=layout,
        reader=log.record_reader(),
        starts=starts,
        train_events=train_events,
        num_actions=log.manifest["vocabularies"]["action"]["rows"] if layout.has_action else IMPLICIT_ACTION + 1,
        item_features=log.item_features(),
        item_train_events=item_train_events,
        item_train_positives=item_train_positives,
    )


@dataclasses.dataclass(frozen=True)
class ConvertedExamples:
    """E examples of one split of a converted log, from its index alone.

    Attributes:
      target_event: int64 `[E]` event number of each example's target (`ConvertedIndex`).
      history_length: int32 `[E]` events of history: the events `[target - h, target)`, all the user's.
    """

    target_event: np.ndarray
    history_length: np.ndarray

    def __len__(self) -> int:
        return int(self.target_event.shape[0])


def converted_examples(index: ConvertedIndex, max_seq_len: int) -> tuple[ConvertedExamples, ConvertedExamples]:
    """The train and eval examples: one per event of each split, in event order (module docstring).

    Raises:
      ValueError: `max_seq_len < 1`.
      DataFormatError: a split without train or eval events (the conversion's
        split rule named).
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    lengths = np.diff(index.starts)
    position = np.arange(index.num_events) - np.repeat(index.starts[:-1], lengths)  # within its user
    is_eval = position >= np.repeat(index.train_events, lengths)
    out = []
    for target in (np.flatnonzero(~is_eval), np.flatnonzero(is_eval)):
        out.append(ConvertedExamples(target_event=target, history_length=np.minimum(position[target], max_seq_len).astype(np.int32)))
    train, evals = out
    if not len(train) or not len(evals):
        split = index.manifest["split"]["description"]
        raise DataFormatError(
            f"{index.directory}: the conversion's split ({split}) left {len(train)} train and {len(evals)} eval events; "
            "both must be > 0 (convert again with another --split)"
        )
    return train, evals


def converted_spec(index: ConvertedIndex, *, num_time_buckets: int, max_seq_len: int, history_item_features: bool = False) -> FeatureSpec:
    """The `FeatureSpec` of the log's batches: the user id (feature "user") and the user and item features
    of the manifest, in its order (with `history_item_features`, the item features in the history rows
    too); vocabulary sizes are the vocabularies' rows.

    Raises:
      DataFormatError: a feature or task name the model cannot take (letters, digits
        and `_` only; "user" is the user id's), naming the directory and the name.
    """
    manifest = index.manifest
    sides = {side: [f for f in manifest["features"] if f["side"] == side] for side in ("user", "item")}
    widths = {"user": dict(index.layout.user_features), "item": {name: table.shape[1] for name, table in index.item_features.items()}}
    try:
        return FeatureSpec(
            num_items=manifest["vocabularies"]["item"]["rows"],
            num_actions=index.num_actions,
            num_time_buckets=num_time_buckets,
            tasks=tuple(task["name"] for task in manifest["tasks"]),
            user_features=(CategoricalFeature("user", manifest["vocabularies"]["user"]["rows"]),)
            + tuple(CategoricalFeature(f["name"], f["vocab_size"], widths["user"][f["name"]]) for f in sides["user"]),
            item_features=tuple(CategoricalFeature(f["name"], f["vocab_size"], widths["item"][f["name"]]) for f in sides["item"]),
            max_seq_len=max_seq_len,
            history_item_features=history_item_features,
        )
    except ValueError as error:
        raise DataFormatError(
            f"{index.directory}: the converted log's names do not fit the model: {error}. Feature names are the columns' "
            "names, task names those of --label NAME=RULE, and 'user' is the user id's feature; convert again with names "
            "of letters, digits and '_'"
        ) from None


def converted_fingerprint(manifest: dict) -> str:
    """sha256 of what a conversion's data depends on: its manifest (settings, counts, vocabularies, split,
    shards, lengths), each input's size and sha256, not where the inputs were nor when or how fast
    they were converted, nor the format version and the index files that version 2 added (derived from
    the records: a run on a version-1 conversion resumes on the same inputs converted again), nor the
    duplicate events' count and first place, which conversions written before they were counted lack
    (derived from the inputs: a run on such a conversion resumes too). Two conversions with equal
    fingerprints hold the same records."""
    kept = {key: value for key, value in manifest.items() if key not in ("inputs", "seconds", "version", "train_events", "item_train_labels", "first_duplicate_event")}
    kept["counts"] = {key: value for key, value in manifest["counts"].items() if key != "duplicate_events"}
    kept["inputs"] = [{"size": entry["size"], "sha256": entry["sha256"]} for entry in manifest["inputs"]]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def converted_skipped(manifest: dict) -> tuple[SkippedRows, ...]:
    """The rows the conversion skipped (`--on-bad-row skip`), per file and kind."""
    return tuple(SkippedRows(entry["file"], BadRowKind(entry["kind"]), entry["count"], entry["first"]) for entry in manifest["skipped_rows"])


def converted_notes(manifest: dict) -> tuple[str, ...]:
    """Lines for the data set summary: the conversion's split, how it is read, ids out of the vocabularies, duplicate events, the weights."""
    counts, split = manifest["counts"], manifest["split"]
    cutoff = f" (cutoff {split['cutoff']})" if split["cutoff"] is not None else ""
    notes = [
        f"converted by gem-data from {len(manifest['inputs'])} file(s): split {split['description']}{cutoff}; "
        f"each process reads only its batches' users, on demand, from the {len(manifest['shards'])} shard file(s)"
    ]
    if counts["oov_user_events"] or counts["oov_item_events"]:
        notes.append(f"out of the vocabulary (row 1): {counts['oov_user_events']} events of users, {counts['oov_item_events']} events of items")
    if "duplicate_events" not in counts:
        notes.append(DUPLICATES_NOT_COUNTED)
    elif counts["duplicate_events"]:
        notes.append(f"{counts['duplicate_events']} event(s) equal to an earlier row in every column read, as parsed (times to the second); kept, each an example")
    weight = manifest["schema"]["weight"]
    if weight is not None:
        notes.append(
            f"weight column {weight!r}: each train example's loss weight (a batch's loss is sum(w * BCE) / max(sum(w), 1)); "
            "eval metrics count every eval event once, unweighted"
        )
    return tuple(notes)


class ConvertedBatchBuilder:
    """Builds a `Batch` from a list of example indices of one split (grain's map function), reading
    only the records of those examples (`ConvertedIndex.read`, one batched read per call).

    Args:
      index: the log's index.
      examples: the examples indexed by the calls (`converted_examples`).
      spec: `converted_spec(index, ...)`: the layout (ids are validated against it).
      batch_size: static B.
      split: `TRAIN` or `EVAL`, the examples' split: train examples weigh their event's
        weight (with a weight column), eval examples 1 each.

    Raises:
      JaggedError: an example history longer than `spec.max_seq_len`.
    """

    def __init__(self, index: ConvertedIndex, examples: ConvertedExamples, spec: FeatureSpec, batch_size: int, split: int):
        check_history_lengths(examples.history_length, spec)
        self.index = index
        self.examples = examples
        self.spec = spec
        self.batch_size = batch_size
        self.split = split

    def __call__(self, indices: Sequence[int], batch_size: int | None = None) -> Batch:
        """The `Batch` of examples `indices` (0..b of them), then padding examples up to b.

        Args:
          indices: example indices of this builder's split.
          batch_size: b, the examples of the batch (default: B).

        Raises:
          ValueError: more than b indices, or an index out of range.
          DataFormatError: a record read that disagrees with the index (`ConvertedIndex.read`),
            or a target event of the other split.
        """
        b = self.batch_size if batch_size is None else batch_size
        idx = batch_indices(indices, b, len(self.examples))
        index = self.index
        target = self.examples.target_event[idx]
        record = np.searchsorted(index.starts, target, side="right") - 1
        records, slot = np.unique(record, return_inverse=True)
        users, events, starts = index.read(records)
        local = starts[slot] + (target - index.starts[record])  # each target among the events read
        if np.any(events["split"][local] != self.split):
            raise DataFormatError(f"{index.directory}: a record's split flags disagree with train_events.npz; the conversion was changed after it was written (convert again)")
        candidate = events["item"][local]
        weighted = self.split == TRAIN and index.layout.has_weight
        return assemble_batch(
            self.spec,
            b,
            item=events["item"],
            action=events["action"] if index.layout.has_action else np.full(events.shape[0], IMPLICIT_ACTION, np.int32),
            timestamp=events["time"],
            target=local,
            lengths=self.examples.history_length[idx],
            user={"user": users["user"][slot][:, None]} | {name: users[f"user_feature/{name}"][slot] for name, _ in index.layout.user_features},
            candidate=candidate,
            item_features=index.item_features,
            labels=events["labels"][local],
            weights=events["weight"][local] if weighted else np.ones(idx.shape[0], np.float32),
        )
