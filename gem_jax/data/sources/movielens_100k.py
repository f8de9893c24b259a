"""Reader for MovieLens 100K (GroupLens): `u.data`, `u.item`, `u.user`, `u.genre`, `u.occupation`.

Format (the publisher's README): `u.data` is tab-separated
`user item rating timestamp` (ratings 1..5, Unix seconds); `u.item` is
`|`-separated `item|title|release date|video release date|IMDb URL|` then the
19 genre flags of `u.genre`, in Latin-1; `u.user` is
`user|age|gender|occupation|zip`; `u.occupation` lists the occupation names.

Features:
- Item feature "genres" (multi-valued, `Pooling.MULTI_HOT`): the 19 flags of
  u.item as ids 1..19 (the first, "unknown", included).
- User features "age", "gender", "occupation". Age: the seven MovieLens-1M
  buckets, ids 1..7: under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56 and over.
  Gender: M -> 1, F -> 2. Occupation: 1..21 in u.occupation order. Zip codes
  are not used.
- Actions are half-star ids `rating * 2` (2, 4, .., 10), on the same scale as
  ml-latest-small.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gem_jax.batch import CategoricalFeature
from gem_jax.data.events import DEMOGRAPHICS, EventLog, FeatureTable, build_event_log
from gem_jax.data.features import NUM_HALF_STAR_ACTIONS
from gem_jax.data.rows import BadRowKind, DataFormatError, OnBadRow, RowChecker, int64_field

NUM_GENRE_FLAGS = 19
AGE_BUCKET_LOWER_BOUNDS = (18, 25, 35, 45, 50, 56)  # bucket id = 1 + number of bounds <= age
NUM_AGES = len(AGE_BUCKET_LOWER_BOUNDS) + 2  # PAD_ID + 7 buckets
GENDERS = {"M": 1, "F": 2}
MAX_AGE = 120


def age_bucket(age: int) -> int:
    """Age in years -> MovieLens-1M bucket id 1..7."""
    return 1 + sum(age >= bound for bound in AGE_BUCKET_LOWER_BOUNDS)


def _lines(path: Path, sep: str):
    """Yields (line, fields) of a Latin-1 text file; skips blank lines."""
    with open(path, encoding="latin-1", newline="") as f:
        for number, text in enumerate(f, start=1):
            text = text.rstrip("\r\n")
            if text.strip():
                yield number, text.split(sep)


def _read_names(path: Path) -> list[str]:
    """u.genre (`name|index`, indices 0..n-1 in order) or u.occupation (one name a line)."""
    names = []
    for line, fields in _lines(path, "|"):
        if len(fields) == 2:
            if fields[1] != str(len(names)):
                raise DataFormatError(f"{path}, line {line}: expected index {len(names)}, got {fields[1]!r}")
        elif len(fields) != 1:
            raise DataFormatError(f"{path}, line {line}: expected a name, got {'|'.join(fields)!r}")
        names.append(fields[0])
    if not names:
        raise DataFormatError(f"{path}: no names")
    return names


def _read_items(path: Path, on_bad_row: OnBadRow) -> tuple[dict[int, list[int]], RowChecker]:
    """u.item -> {item: 19 genre flags}."""
    check = RowChecker(path, on_bad_row)
    items: dict[int, list[int]] = {}
    width = 5 + NUM_GENRE_FLAGS
    for line, fields in _lines(path, "|"):
        if len(fields) != width:
            check.bad(line, BadRowKind.FIELD_COUNT, f"expected {width} fields, got {len(fields)}")
            continue
        try:
            item = int(fields[0])
            flags = [int(x) for x in fields[5:]]
        except ValueError:
            check.bad(line, BadRowKind.NOT_A_NUMBER, f"item id or genre flag in {'|'.join(fields)!r}")
            continue
        if item in items:
            check.bad(line, BadRowKind.DUPLICATE_ID, f"item {item} appears twice")
        elif any(x not in (0, 1) for x in flags):
            check.bad(line, BadRowKind.BAD_VALUE, f"genre flags must be 0 or 1, got {flags}")
        else:
            items[item] = flags
    return items, check


def _read_users(path: Path, occupations: list[str], on_bad_row: OnBadRow) -> tuple[dict[int, tuple], RowChecker]:
    """u.user -> {user: (age bucket, gender id, occupation id)}."""
    check = RowChecker(path, on_bad_row)
    occupation_id = {name: k + 1 for k, name in enumerate(occupations)}
    users: dict[int, tuple[int, int, int]] = {}
    for line, fields in _lines(path, "|"):
        if len(fields) != 5:
            check.bad(line, BadRowKind.FIELD_COUNT, f"expected 5 fields (user|age|gender|occupation|zip), got {len(fields)}")
            continue
        try:
            user, age = int(fields[0]), int(fields[1])
        except ValueError:
            check.bad(line, BadRowKind.NOT_A_NUMBER, f"user or age in {'|'.join(fields)!r}")
            continue
        if user in users:
            check.bad(line, BadRowKind.DUPLICATE_ID, f"user {user} appears twice")
        elif not 1 <= age <= MAX_AGE:
            check.bad(line, BadRowKind.OUT_OF_RANGE, f"age {age} is not in [1, {MAX_AGE}]")
        elif fields[2] not in GENDERS:
            check.bad(line, BadRowKind.BAD_VALUE, f"gender {fields[2]!r} is not M or F")
        elif fields[3] not in occupation_id:
            check.bad(line, BadRowKind.UNKNOWN_ID, f"occupation {fields[3]!r} is not in u.occupation")
        else:
            users[user] = (age_bucket(age), GENDERS[fields[2]], occupation_id[fields[3]])
    return users, check


def read_ml_100k(path: str | os.PathLike, on_bad_row: OnBadRow = OnBadRow.RAISE) -> EventLog:
    """Reads a MovieLens 100K folder into an `EventLog`.

    Args:
      path: folder holding u.data, u.item, u.user, u.genre, u.occupation.
      on_bad_row: `OnBadRow.RAISE` or `OnBadRow.SKIP` (bad rows left out and
        counted in `EventLog.skipped`).

    Returns:
      The sorted `EventLog`; users and items are those of u.user and u.item.

    Raises:
      BadRowError: under RAISE, naming the file and line: a wrong field count,
        a non-numeric field, a rating outside 1..5, a negative timestamp, a
        user or item absent from u.user / u.item, an age outside 1..120, a
        gender other than M/F, an unknown occupation, a genre flag other than
        0/1, or a repeated user or item.
      DataFormatError: malformed u.genre / u.occupation, or no valid rating.
      FileNotFoundError: a missing file.
    """
    folder = Path(path)
    genre_names = _read_names(folder / "u.genre")
    if len(genre_names) != NUM_GENRE_FLAGS:
        raise DataFormatError(f"{folder / 'u.genre'}: expected {NUM_GENRE_FLAGS} genres, got {len(genre_names)}")
    occupations = _read_names(folder / "u.occupation")
    items, item_check = _read_items(folder / "u.item", on_bad_row)
    users, user_check = _read_users(folder / "u.user", occupations, on_bad_row)

    data_path = folder / "u.data"
    check = RowChecker(data_path, on_bad_row)
    columns: list[list[int]] = [[], [], [], [], []]  # user, item, rating, timestamp, line
    for line, fields in _lines(data_path, "\t"):
        if len(fields) != 4:
            check.bad(line, BadRowKind.FIELD_COUNT, f"expected 4 tab-separated fields (user item rating timestamp), got {len(fields)}")
            continue
        parsed = check.parse(
            line,
            lambda: tuple(int64_field(x, name) for x, name in zip(fields, ("user id", "item id", "rating", "timestamp"))),
            f"fields {fields!r}",
        )
        if parsed is None:
            continue
        user, item, rating, ts = parsed
        if not 1 <= rating <= 5:
            check.bad(line, BadRowKind.OUT_OF_RANGE, f"rating {rating} is not in 1..5")
        elif ts < 0:
            check.bad(line, BadRowKind.OUT_OF_RANGE, f"negative timestamp {ts}")
        elif user not in users:
            check.bad(line, BadRowKind.UNKNOWN_ID, f"user {user} is not in u.user")
        elif item not in items:
            check.bad(line, BadRowKind.UNKNOWN_ID, f"item {item} is not in u.item")
        else:
            for column, value in zip(columns, (user, item, rating, ts, line)):
                column.append(value)
    if not columns[0]:
        raise DataFormatError(f"{data_path}: no valid rating rows")

    user_vocab = np.array(sorted(users), dtype=np.int64)
    item_vocab = np.array(sorted(items), dtype=np.int64)
    rating = np.array(columns[2], dtype=np.float32)
    demographics = np.array([users[int(u)] for u in user_vocab], dtype=np.int32).reshape(-1, len(DEMOGRAPHICS))
    return build_event_log(
        name="ml-100k",
        raw_user=np.array(columns[0], dtype=np.int64),
        raw_item=np.array(columns[1], dtype=np.int64),
        action=(2 * np.array(columns[2], dtype=np.int32)),
        rating=rating,
        timestamp=np.array(columns[3], dtype=np.int64),
        line=np.array(columns[4], dtype=np.int64),
        user_vocab=user_vocab,
        item_vocab=item_vocab,
        user_features=tuple(
            FeatureTable(CategoricalFeature(name, size), ids[:, None])
            for name, size, ids in zip(DEMOGRAPHICS, (NUM_AGES, len(GENDERS) + 1, len(occupations) + 1), demographics.T)
        ),
        item_features=(FeatureTable.from_multi_hot("genres", np.array([items[int(i)] for i in item_vocab]), tuple(genre_names)),),
        num_actions=NUM_HALF_STAR_ACTIONS,
        skipped=item_check.skipped() + user_check.skipped() + check.skipped(),
    )
