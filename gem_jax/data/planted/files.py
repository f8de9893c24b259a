"""The planted log on disk: an event log as a user would bring it, and the truth beside it.

`write_planted` writes into one directory::

    events.parquet | events.csv   user_id (string), item_id (string), ts (Unix seconds), click (0/1),
                                  action ("click" or "impression": the event's outcome as an event
                                  type, which a history row carries), sorted by time, then user
    items.parquet | items.csv     item_id, category (string): the item table
    truth.parquet                 per event, in the same order: user_id, item_id, ts, click, p, logit,
                                  draw (focus / return / explore) and the logit's terms
                                  (<name>_term for name in generator.TERMS)
    planted.json                  the config, counts and file names

(written as `DIR.partial`, moved into place when complete). Ids are `u<k>`,
`i<k>`, `c<k>` for user, item and category index k. `event_schema` is the
schema `gem-data convert` reads the events with (`convert_command` spells it
as a command line): by default with the action column, so that each history row carries
whether its event was clicked, as a real log's event types say what a user did with what it saw
(the target's own label is never in its history: `gem_jax.data.collate`); `read_truth` reads the truth back for the oracle
(`gem_jax.train.oracle`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from gem_jax.data.ingest.readers import Format
from gem_jax.data.ingest.schema import EventSchema, FeatureColumn, LabelRule, Side
from gem_jax.data.planted.generator import TERMS, Draw, PlantedLog
from gem_jax.data.rows import DataFormatError

INFO = "planted.json"
TRUTH = "truth.parquet"
INFO_FORMAT = "gem-data planted event log"
INFO_VERSION = 2  # 2: the events' action column
USER, ITEM, TIME, LABEL, ACTION, CATEGORY = "user_id", "item_id", "ts", "click", "action", "category"
ACTION_NAMES = ("impression", "click")  # the action column's value of a label 0 and 1


@dataclasses.dataclass(frozen=True)
class PlantedFiles:
    """Where `write_planted` put a log: the directory and its events, items and truth files."""

    directory: Path
    events: Path
    items: Path
    truth: Path


@dataclasses.dataclass(frozen=True)
class Truth:
    """The truth file's N events, sorted by (user, time).

    Attributes:
      user: int64 `[N]` user index in order of first appearance in the file.
      item: int64 `[N]` item index in order of first appearance in the file.
      num_items: distinct items.
      time: int64 `[N]` Unix seconds, strictly increasing within a user.
      click: float32 `[N]` the labels, 0 or 1.
      logit: float64 `[N]` the true click logit.
      terms: float64 `[N]` per name of `generator.TERMS`: the logit's terms.
    """

    user: np.ndarray
    item: np.ndarray
    num_items: int
    time: np.ndarray
    click: np.ndarray
    logit: np.ndarray
    terms: dict[str, np.ndarray]


def _names(prefix: str, index: np.ndarray, count: int) -> pa.Array:
    return pc.take(pa.array([f"{prefix}{k}" for k in range(count)]), pa.array(index))


def _files_of(directory: str | os.PathLike, fmt: Format) -> PlantedFiles:
    """The file paths of a planted log in `directory` written as `fmt`."""
    directory = Path(directory)
    suffix = ".parquet" if fmt is Format.PARQUET else ".csv"
    return PlantedFiles(directory, directory / f"events{suffix}", directory / f"items{suffix}", directory / TRUTH)


def event_schema(files: PlantedFiles, *, actions: bool = True) -> EventSchema:
    """How `gem-data convert` reads the planted events: ids, time, the click label, the item table's
    category and, with `actions`, the action column (each history row's outcome; module docstring)."""
    return EventSchema(
        user=USER, item=ITEM, time=TIME, labels=(LabelRule.parse(LABEL),), action=ACTION if actions else None,
        features=(FeatureColumn(CATEGORY, Side.ITEM),), item_table=str(files.items), item_key=ITEM,
    )


def convert_command(files: PlantedFiles, out: str, split: str) -> str:
    """The `gem-data convert` command line that converts the planted events into `out` (`event_schema`'s flags)."""
    schema = event_schema(files)
    words = ["gem-data", "convert", str(files.events), "--out", out, "--user", schema.user, "--item", schema.item, "--time", schema.time]
    words += ["--label", schema.labels[0].column, "--action", schema.action, "--item-table", schema.item_table, "--item-feature", CATEGORY, "--split", split]
    return shlex.join(words)


def _write_table(table: pa.Table, path: Path, fmt: Format) -> None:
    if fmt is Format.PARQUET:
        pq.write_table(table, path)
    else:
        pa_csv.write_csv(table, path)


def write_planted(log: PlantedLog, directory: str | os.PathLike, fmt: Format = Format.PARQUET, *, overwrite: bool = False) -> PlantedFiles:
    """Writes `log` into `directory` (module docstring).

    Args:
      log: the generated log.
      directory: the output directory.
      fmt: `Format.PARQUET` or `Format.CSV` for the events and items (the truth is always Parquet).
      overwrite: replace a planted log already in `directory` (one that holds `planted.json`).

    Returns:
      The written files' paths.

    Raises:
      DataFormatError: `directory` exists and is not empty, unless it holds a
        planted log and `overwrite` is set.
    """
    started = time.perf_counter()
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (overwrite and (out / INFO).is_file()):
            what = "holds a planted log; pass --overwrite to replace it" if (out / INFO).is_file() else "is not empty and holds no planted log: choose another directory"
            raise DataFormatError(f"{out} {what}")
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        files = _files_of(work, fmt)
        config = log.config
        order = np.lexsort((log.user, log.time))  # by time, then user
        users = _names("u", log.user[order], config.num_users)
        items = _names("i", log.item[order], config.num_items)
        times = pa.array(log.time[order])
        clicks = pa.array(log.click[order])
        actions = pc.take(pa.array(ACTION_NAMES), clicks)
        _write_table(pa.table({USER: users, ITEM: items, TIME: times, LABEL: clicks, ACTION: actions}), files.events, fmt)
        item_table = {ITEM: _names("i", np.arange(config.num_items), config.num_items), CATEGORY: _names("c", log.item_category, config.num_categories)}
        _write_table(pa.table(item_table), files.items, fmt)
        draws = pc.take(pa.array([d.name.lower() for d in Draw]), pa.array(log.draw[order]))
        truth = {USER: users, ITEM: items, TIME: times, LABEL: clicks, "p": log.p[order], "logit": log.logit[order], "draw": draws}
        truth |= {f"{name}_term": log.terms[name][order] for name in TERMS}
        pq.write_table(pa.table(truth), files.truth)
        final = _files_of(out, fmt)
        info = {
            "format": INFO_FORMAT,
            "version": INFO_VERSION,
            "config": dataclasses.asdict(config),
            "counts": {"events": log.num_events, "users": config.num_users, "items": config.num_items, "categories": config.num_categories},
            "positive_rate": float(log.click.mean()),
            "draws": {d.name.lower(): int((log.draw == d).sum()) for d in Draw},
            "files": {"events": final.events.name, "items": final.items.name, "truth": final.truth.name},
            "write_seconds": round(time.perf_counter() - started, 2),
        }
        (work / INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def read_truth(path: str | os.PathLike) -> Truth:
    """Reads a truth file (`write_planted`) and sorts its events by (user, time).

    Raises:
      DataFormatError: a missing column, or two events of one user at the same time.
    """
    columns = [USER, ITEM, TIME, LABEL, "logit"] + [f"{name}_term" for name in TERMS]
    schema = pq.read_schema(path)
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataFormatError(f"{path}: not a planted truth file, missing column(s) {missing}")
    table = pq.read_table(path, columns=columns)
    users = pc.dictionary_encode(table[USER]).combine_chunks()
    items = pc.dictionary_encode(table[ITEM]).combine_chunks()
    user = users.indices.to_numpy().astype(np.int64)
    times = table[TIME].to_numpy()
    order = np.lexsort((times, user))
    user, times = user[order], times[order]
    tie = (np.diff(user) == 0) & (np.diff(times) <= 0)
    if tie.any():
        k = int(np.flatnonzero(tie)[0])
        raise DataFormatError(f"{path}: user {users.dictionary[user[k]].as_py()!r} has two events at time {int(times[k])}; the truth needs one time order per user")
    return Truth(
        user=user,
        item=items.indices.to_numpy().astype(np.int64)[order],
        num_items=len(items.dictionary),
        time=times,
        click=table[LABEL].to_numpy().astype(np.float32)[order],
        logit=table["logit"].to_numpy()[order],
        terms={name: table[f"{name}_term"].to_numpy()[order] for name in TERMS},
    )


def log_truth(log: PlantedLog) -> Truth:
    """The `Truth` of an in-memory log: what `read_truth` reads back from its truth file.

    Users and items keep the generator's numbering (items renumbered densely among those with
    events), where the file numbers both in order of first appearance: only which events share a
    user or an item matters. The log's events are already ordered by (user, time).
    """
    items, item = np.unique(log.item, return_inverse=True)
    return Truth(
        user=log.user, item=item.astype(np.int64), num_items=int(items.size), time=log.time, click=log.click.astype(np.float32),
        logit=log.logit, terms=dict(log.terms),
    )
