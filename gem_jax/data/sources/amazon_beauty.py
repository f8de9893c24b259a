"""Reader for Amazon Beauty in the one-line-per-user format of S3-Rec (Zhou et al., CIKM 2020).

Format: `Beauty.txt` has one line per user, `user item_1 item_2 ... item_n`
(space-separated positive integers), items in the order the user reviewed
them; there are no ratings and no timestamps. `Beauty_item2attributes.json`
(optional) maps each item id (a JSON string key) to a list of attribute ids
(brand and sub-categories of the product).

Choices:
- An event's timestamp is its 0-based position in its user's line, so time
  buckets measure age in events.
- Every event has action 1 (a review; no rating). Ratings are NaN.
- Item feature "attributes" (multi-valued, `Pooling.MULTI_HOT`): with the
  attribute file, attribute id j + 1 is the j-th distinct attribute id in sorted
  order; items without attributes get a row of PAD only (counted in
  `EventLog.notes`). Without it (or without any attribute of a listed item), the
  vocabulary is PAD and one unused id, every row PAD.
- No user features beyond the user id: "age", "gender", "occupation" are PAD only
  (vocabulary size 1), the layout of the MovieLens sources.
- The labels of the examples are defined by sampled candidates
  (`gem_jax.data.examples.next_item_examples`), not here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from gem_jax.data.events import DEMOGRAPHICS, EventLog, FeatureTable, absent_features, build_event_log
from gem_jax.data.rows import BadRowKind, DataFormatError, OnBadRow, RowChecker, int64_field, text_lines

SEQUENCES_FILE = "Beauty.txt"
ATTRIBUTES_FILE = "Beauty_item2attributes.json"
NUM_IMPLICIT_ACTIONS = 2  # PAD_ID plus "interacted"


def _read_sequences(path: Path, on_bad_row: OnBadRow) -> tuple[list[list[int]], RowChecker]:
    """Beauty.txt -> columns [user, item, position, line]."""
    check = RowChecker(path, on_bad_row)
    columns: list[list[int]] = [[], [], [], []]
    seen: set[int] = set()
    for line, text in text_lines(path, check):
        fields = text.split()
        if not fields:
            continue
        if len(fields) < 2:
            check.bad(line, BadRowKind.FIELD_COUNT, f"expected a user id and at least one item id, got {len(fields)} field(s)")
            continue
        ids = check.parse(line, lambda: [int64_field(x, "id") for x in fields], f"a field of {text.strip()[:80]!r} is not an integer")
        if ids is None:
            continue
        user, items = ids[0], ids[1:]
        if min(ids) < 1:
            check.bad(line, BadRowKind.OUT_OF_RANGE, f"ids must be positive, got {min(ids)}")
        elif user in seen:
            check.bad(line, BadRowKind.DUPLICATE_ID, f"user {user} has a second line")
        else:
            seen.add(user)
            n = len(items)
            columns[0].extend([user] * n)
            columns[1].extend(items)
            columns[2].extend(range(n))
            columns[3].extend([line] * n)
    return columns, check


def _read_attributes(path: Path, item_vocab: np.ndarray, on_bad_row: OnBadRow) -> tuple[np.ndarray, tuple[str, ...], RowChecker, tuple[str, ...]]:
    """Attribute JSON -> (multi-hot `[len(item_vocab), A]`, names, checker, notes)."""
    check = RowChecker(path, on_bad_row)
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(table, dict):
        raise DataFormatError(f"{path}: expected a JSON object of item id -> attribute ids")
    attributes: dict[int, list[int]] = {}
    for key, value in table.items():
        where = f"key {key!r}"
        try:
            item = int(key)
        except ValueError:
            check.bad(where, BadRowKind.NOT_A_NUMBER, "item id is not an integer")
            continue
        if not isinstance(value, list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in value):
            check.bad(where, BadRowKind.BAD_VALUE, f"expected a list of integer attribute ids, got {str(value)[:80]}")
        elif any(a < 1 for a in value):
            check.bad(where, BadRowKind.OUT_OF_RANGE, f"attribute ids must be positive, got {value}")
        elif item in attributes:
            check.bad(where, BadRowKind.DUPLICATE_ID, f"item {item} appears twice")
        else:
            attributes[item] = value
    known = set(item_vocab.tolist())
    used = {item: attrs for item, attrs in attributes.items() if item in known}
    names = sorted({a for attrs in used.values() for a in attrs})
    column = {a: j for j, a in enumerate(names)}
    genres = np.zeros((item_vocab.shape[0], max(len(names), 1)), np.uint8)
    for row, item in enumerate(item_vocab.tolist()):
        genres[row, [column[a] for a in used.get(item, ())]] = 1
    notes = (
        f"{path}: {len(known) - len(used)} item(s) of {SEQUENCES_FILE} have no attributes (all-zero genre row)",
        f"{path}: {len(attributes) - len(used)} attribute entr(ies) for items absent from {SEQUENCES_FILE} not used",
    )
    return genres, tuple(str(a) for a in names) or ("(no attributes)",), check, notes


def read_amazon_beauty(path: str | os.PathLike, on_bad_row: OnBadRow = OnBadRow.RAISE, *, attributes: bool = True) -> EventLog:
    """Reads an S3-Rec Amazon Beauty folder into an `EventLog`.

    Args:
      path: folder holding Beauty.txt (and Beauty_item2attributes.json).
      on_bad_row: `OnBadRow.RAISE` or `OnBadRow.SKIP` (bad lines or JSON
        entries left out and counted in `EventLog.skipped`).
      attributes: use the attribute file as the genre side features; it must
        then exist.

    Returns:
      The sorted `EventLog`: timestamps are positions, actions all 1, ratings NaN.

    Raises:
      BadRowError: under RAISE, naming the file and line (or JSON key): a line
        with fewer than two fields, a non-integer or non-positive id, a user
        with two lines; an attribute entry that is not a list of positive ints.
      DataFormatError: invalid JSON, or no valid line.
      FileNotFoundError: a missing file.
    """
    folder = Path(path)
    seq_path = folder / SEQUENCES_FILE
    (user, item, position, line), check = _read_sequences(seq_path, on_bad_row)
    if not user:
        raise DataFormatError(f"{seq_path}: no valid lines")
    item = np.array(item, dtype=np.int64)
    item_vocab = np.unique(item)
    if attributes:
        genres, genre_names, attr_check, notes = _read_attributes(folder / ATTRIBUTES_FILE, item_vocab, on_bad_row)
        skipped = check.skipped() + attr_check.skipped()
    else:
        genres, genre_names = np.zeros((item_vocab.shape[0], 1), np.uint8), ("(no attributes)",)
        notes, skipped = (), check.skipped()
    user = np.array(user, dtype=np.int64)
    user_vocab = np.unique(user)
    return build_event_log(
        name="amazon-beauty",
        raw_user=user,
        raw_item=item,
        action=np.ones(item.shape[0], np.int32),
        rating=np.full(item.shape[0], np.nan, np.float32),
        timestamp=np.array(position, dtype=np.int64),
        line=np.array(line, dtype=np.int64),
        user_vocab=user_vocab,
        item_vocab=item_vocab,
        user_features=absent_features(DEMOGRAPHICS, user_vocab.shape[0]),
        item_features=(FeatureTable.from_multi_hot("attributes", genres, genre_names),),
        num_actions=NUM_IMPLICIT_ACTIONS,
        skipped=skipped,
        notes=notes,
    )
