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

Every process reads the whole log (all shard files, not `ConvertedLog`'s
per-process share): a global batch may hold any example, and each process
builds its devices' chunks of every global batch (`gem_jax.data.shard`), so
each must be able to build any example. The log is held in memory as columns:
per event item, time, action, labels (and weight), per user the user row and
features, then the examples' index arrays and labels; about 40 + 8K bytes per
event with K tasks (a 20M-event log with 2 tasks: about 1.1 GB per process).
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
from gem_jax.data.examples import Examples
from gem_jax.data.ingest.shards import ConvertedLog
from gem_jax.data.ingest.split import EVAL, TRAIN
from gem_jax.data.rows import BadRowKind, DataFormatError, SkippedRows

IMPLICIT_ACTION = 1  # the action of every event of a log without an action column (num_actions 2: PAD and it)


@dataclasses.dataclass(frozen=True)
class ConvertedEvents:
    """A converted log in memory: R users' event sequences, one after another.

    Attributes:
      directory: the converted directory.
      manifest: its `manifest.json`.
      item: int32 `[N]` item rows (`vocab/item.csv`), user after user, each user's
        events in time order.
      time: int64 `[N]` the time column's integers (Unix seconds for dates).
      action: int32 `[N]` action rows (`vocab/action.csv`; 0 where the action was
        empty), or `IMPLICIT_ACTION` everywhere without an action column.
      num_actions: the action vocabulary size with PAD_ID (2 without an action column).
      labels: float32 `[N, K]` 0/1, tasks in manifest order.
      weight: float32 `[N]` the weight column, or None without one.
      split: uint8 `[N]` `TRAIN` (0) or `EVAL` (1).
      starts: int64 `[R + 1]`: user r's events are `starts[r]:starts[r + 1]`.
      user: int32 `[R]` user rows (`vocab/user.csv`; users out of the vocabulary share row 1).
      user_features: int32 `[R, max_values]` per user feature, rows of its vocabulary.
      item_features: int32 `[item rows, max_values]` per item feature.
    """

    directory: Path
    manifest: dict
    item: np.ndarray
    time: np.ndarray
    action: np.ndarray
    num_actions: int
    labels: np.ndarray
    weight: np.ndarray | None
    split: np.ndarray
    starts: np.ndarray
    user: np.ndarray
    user_features: dict[str, np.ndarray]
    item_features: dict[str, np.ndarray]

    @property
    def num_events(self) -> int:
        return int(self.item.shape[0])


def read_converted(directory: str | os.PathLike) -> ConvertedEvents:
    """Reads every record of a converted directory into columns (`ConvertedLog.read_all`).

    Raises:
      DataFormatError: not a finished conversion, a shard file missing, a record
        that does not match the manifest's layout, or shards holding other counts
        of users or events than the manifest.
      FileNotFoundError: `directory` does not exist.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"EVENTS data set not found: {directory} is not a folder; set DataConfig.path to the directory gem-data convert wrote")
    log = ConvertedLog(directory)  # process 0 of 1: every shard file (module docstring)
    users, events, starts = log.read_all()
    counts = log.manifest["counts"]
    if (len(users), events.shape[0]) != (counts["users"], counts["events"]):
        raise DataFormatError(
            f"{directory}: the shard files hold {len(users)} users and {events.shape[0]} events, the manifest "
            f"{counts['users']} and {counts['events']}; the shards were changed after the conversion (convert again)"
        )
    layout = log.layout
    return ConvertedEvents(
        directory=directory,
        manifest=log.manifest,
        item=np.ascontiguousarray(events["item"]),
        time=np.ascontiguousarray(events["time"]),
        action=np.ascontiguousarray(events["action"]) if layout.has_action else np.full(events.shape[0], IMPLICIT_ACTION, np.int32),
        num_actions=log.manifest["vocabularies"]["action"]["rows"] if layout.has_action else IMPLICIT_ACTION + 1,
        labels=np.ascontiguousarray(events["labels"]),
        weight=np.ascontiguousarray(events["weight"]) if layout.has_weight else None,
        split=np.ascontiguousarray(events["split"]),
        starts=starts,
        user=np.ascontiguousarray(users["user"]),
        user_features={name: np.ascontiguousarray(users[f"user_feature/{name}"]) for name, _ in layout.user_features},
        item_features=log.item_features(),
    )


def converted_examples(events: ConvertedEvents, max_seq_len: int) -> tuple[Examples, Examples]:
    """The train and eval examples: one per event of each split, in log order (module docstring).

    Raises:
      ValueError: `max_seq_len < 1`, or a split without events (the conversion's
        split rule named).
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    position = np.arange(events.num_events) - np.repeat(events.starts[:-1], np.diff(events.starts))  # within its user
    out = []
    for flag in (TRAIN, EVAL):
        target = np.flatnonzero(events.split == flag)
        out.append(
            Examples(
                target_event=target,
                history_length=np.minimum(position[target], max_seq_len).astype(np.int32),
                candidate=events.item[target],
                labels=events.labels[target],
            )
        )
    train, evals = out
    if not len(train) or not len(evals):
        split = events.manifest["split"]["description"]
        raise ValueError(
            f"{events.directory}: the conversion's split ({split}) left {len(train)} train and {len(evals)} eval events; "
            "both must be > 0 (convert again with another --split)"
        )
    return train, evals


def converted_spec(events: ConvertedEvents, *, num_time_buckets: int, max_seq_len: int) -> FeatureSpec:
    """The `FeatureSpec` of the log's batches: the user id (feature "user") and the user and item features
    of the manifest, in its order; vocabulary sizes are the vocabularies' rows.

    Raises:
      ValueError: a feature or task name the model cannot take (letters, digits and
        `_` only; "user" is the user id's), naming the directory and the name.
    """
    manifest = events.manifest
    sides = {side: [f for f in manifest["features"] if f["side"] == side] for side in ("user", "item")}
    widths = {"user": events.user_features, "item": events.item_features}
    try:
        return FeatureSpec(
            num_items=manifest["vocabularies"]["item"]["rows"],
            num_actions=events.num_actions,
            num_time_buckets=num_time_buckets,
            tasks=tuple(task["name"] for task in manifest["tasks"]),
            user_features=(CategoricalFeature("user", manifest["vocabularies"]["user"]["rows"]),)
            + tuple(CategoricalFeature(f["name"], f["vocab_size"], widths["user"][f["name"]].shape[1]) for f in sides["user"]),
            item_features=tuple(CategoricalFeature(f["name"], f["vocab_size"], widths["item"][f["name"]].shape[1]) for f in sides["item"]),
            max_seq_len=max_seq_len,
        )
    except ValueError as error:
        raise ValueError(
            f"{events.directory}: the converted log's names do not fit the model: {error}. Feature names are the columns' "
            "names, task names those of --label NAME=RULE, and 'user' is the user id's feature; convert again with names "
            "of letters, digits and '_'"
        ) from None


def converted_fingerprint(manifest: dict) -> str:
    """sha256 of what a conversion's data depends on: its manifest (settings, counts, vocabularies, split,
    shards, lengths), each input's size and sha256, not where the inputs were nor when or how fast
    they were converted. Two conversions with equal fingerprints hold the same records."""
    kept = {key: value for key, value in manifest.items() if key not in ("inputs", "seconds")}
    kept["inputs"] = [{"size": entry["size"], "sha256": entry["sha256"]} for entry in manifest["inputs"]]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def converted_skipped(manifest: dict) -> tuple[SkippedRows, ...]:
    """The rows the conversion skipped (`--on-bad-row skip`), per file and kind."""
    return tuple(SkippedRows(entry["file"], BadRowKind(entry["kind"]), entry["count"], entry["first"]) for entry in manifest["skipped_rows"])


def converted_notes(events: ConvertedEvents) -> tuple[str, ...]:
    """Lines for the data set summary: the conversion's split, ids out of the vocabularies, the weights."""
    manifest, counts = events.manifest, events.manifest["counts"]
    split = manifest["split"]
    cutoff = f" (cutoff {split['cutoff']})" if split["cutoff"] is not None else ""
    notes = [f"converted by gem-data from {len(manifest['inputs'])} file(s): split {split['description']}{cutoff}; every process reads all {len(manifest['shards'])} shard file(s)"]
    if counts["oov_user_events"] or counts["oov_item_events"]:
        notes.append(f"out of the vocabulary (row 1): {counts['oov_user_events']} events of users, {counts['oov_item_events']} events of items")
    weight = manifest["schema"]["weight"]
    if weight is not None:
        notes.append(
            f"weight column {weight!r}: each train example's loss weight (a batch's loss is sum(w * BCE) / max(sum(w), 1)); "
            "eval metrics count every eval event once, unweighted"
        )
    return tuple(notes)


class ConvertedBatchBuilder:
    """Builds a `Batch` from a list of example indices of one split (grain's map function).

    Args:
      events: the log.
      examples: the examples indexed by the calls (`converted_examples`).
      spec: `converted_spec(events, ...)`: the layout (ids are validated against it).
      batch_size: static B.
      weights: float32 `[E]` loss weight of each example, or None: 1 each.

    Raises:
      JaggedError: an example history longer than `spec.max_seq_len`.
      ValueError: `weights` not one per example.
    """

    def __init__(self, events: ConvertedEvents, examples: Examples, spec: FeatureSpec, batch_size: int, weights: np.ndarray | None = None):
        check_history_lengths(examples, spec)
        if weights is not None and weights.shape != (len(examples),):
            raise ValueError(f"weights have shape {weights.shape}, expected one per example ({len(examples)},)")
        self.events = events
        self.examples = examples
        self.spec = spec
        self.batch_size = batch_size
        self.weights = weights

    def __call__(self, indices: Sequence[int], batch_size: int | None = None) -> Batch:
        """The `Batch` of examples `indices` (0..b of them), then padding examples up to b.

        Args:
          indices: example indices of this builder's split.
          batch_size: b, the examples of the batch (default: B).

        Raises:
          ValueError: more than b indices, or an index out of range.
        """
        b = self.batch_size if batch_size is None else batch_size
        idx = batch_indices(indices, b, len(self.examples))
        events, ex = self.events, self.examples
        target = ex.target_event[idx]
        user = np.searchsorted(events.starts, target, side="right") - 1
        candidate = ex.candidate[idx]
        return assemble_batch(
            self.spec,
            b,
            item=events.item,
            action=events.action,
            timestamp=events.time,
            target=target,
            lengths=ex.history_length[idx],
            user={"user": events.user[user][:, None]} | {name: ids[user] for name, ids in events.user_features.items()},
            candidate=candidate,
            candidate_features={name: table[candidate] for name, table in events.item_features.items()},
            labels=ex.labels[idx],
            weights=np.ones(idx.shape[0], np.float32) if self.weights is None else self.weights[idx],
        )
