"""Reader for MovieLens latest-small (GroupLens): `ratings.csv` and `movies.csv`.

Format (the publisher's README.txt): UTF-8 CSV with a header row;
`ratings.csv` is `userId,movieId,rating,timestamp` with ratings 0.5..5 in
half-star steps and Unix-second timestamps; `movies.csv` is
`movieId,title,genres` with quoted titles and `|`-separated genres.

Choices:
- The item vocabulary is every movie of movies.csv (dense ids by movieId
  order), rated or not; users are those with at least one rating.
- Item feature "genres" (multi-valued, `Pooling.MULTI_HOT`): genre id j + 1 is the
  j-th distinct genre name of movies.csv in sorted order; "(no genres listed)"
  gives a row of PAD only (no id of its own).
- No user demographics: the user features "age", "gender", "occupation" of
  MovieLens 100K are PAD only (vocabulary size 1), so both MovieLens sets share one
  model layout.
- Actions are half-star ratings, `rating * 2` in 1..10.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from gem_jax.data.events import DEMOGRAPHICS, EventLog, FeatureTable, absent_features, build_event_log
from gem_jax.data.features import NUM_HALF_STAR_ACTIONS
from gem_jax.data.rows import BadRowKind, DataFormatError, OnBadRow, RowChecker, csv_fields, int64_field, text_lines

RATINGS_HEADER = ["userId", "movieId", "rating", "timestamp"]
MOVIES_HEADER = ["movieId", "title", "genres"]
NO_GENRES = "(no genres listed)"


def _rows(path: Path, header: list[str], check: RowChecker):
    """Yields (line, fields) of a CSV file after checking its header; skips blank lines.

    One record per line (the publisher's files have no line break inside a quoted
    field): a line with an unbalanced quote or bytes that are not UTF-8 is a bad row
    of its own.
    """
    first = True
    for line, text in text_lines(path, check):
        try:
            fields = csv_fields(text)
        except csv.Error as error:
            check.bad(line, BadRowKind.QUOTING, f"{error} in {text[:80]!r}")
            continue
        if first:
            if fields != header:
                raise DataFormatError(f"{path}, line {line}: expected the header {','.join(header)}, got {fields!r}")
            first = False
        elif fields:
            yield line, fields
    if first:
        raise DataFormatError(f"{path}: no header line {','.join(header)}")


def read_movies(path: Path, on_bad_row: OnBadRow) -> tuple[dict[int, list[str]], RowChecker]:
    """movies.csv -> {movieId: [genre, ...]} (empty list for "(no genres listed)")."""
    check = RowChecker(path, on_bad_row)
    movies: dict[int, list[str]] = {}
    for line, fields in _rows(path, MOVIES_HEADER, check):
        if len(fields) != 3:
            check.bad(line, BadRowKind.FIELD_COUNT, f"expected 3 fields (movieId,title,genres), got {len(fields)}")
            continue
        movie = check.parse(line, lambda: int64_field(fields[0], "movieId"), f"movieId {fields[0]!r}")
        if movie is None:
            continue
        genres = fields[2].split("|")
        if movie in movies:
            check.bad(line, BadRowKind.DUPLICATE_ID, f"movieId {movie} appears twice")
        elif not fields[2] or any(not g for g in genres):
            check.bad(line, BadRowKind.BAD_VALUE, f"empty genre in {fields[2]!r}")
        else:
            movies[movie] = [] if genres == [NO_GENRES] else genres
    return movies, check


def read_ml_latest_small(path: str | os.PathLike, on_bad_row: OnBadRow = OnBadRow.RAISE) -> EventLog:
    """Reads a MovieLens latest-small folder into an `EventLog`.

    Args:
      path: folder holding `ratings.csv` and `movies.csv`.
      on_bad_row: `OnBadRow.RAISE` (first bad row raises) or `OnBadRow.SKIP`
        (bad rows are left out and counted in `EventLog.skipped`).

    Returns:
      The sorted `EventLog` (timestamps in Unix seconds; ratings in stars).

    Raises:
      BadRowError: under RAISE, naming the file and line: bytes that are not
        UTF-8, an unbalanced quote, a wrong field count, a non-numeric field, an
        id or timestamp outside int64, a rating that is not a half-star in [0.5, 5], a
        negative timestamp, a movieId absent from movies.csv, or a repeated or
        genre-less movie row.
      DataFormatError: a wrong header, or no valid rating left.
      FileNotFoundError: a missing file.
    """
    folder = Path(path)
    movies, movie_check = read_movies(folder / "movies.csv", on_bad_row)
    ratings_path = folder / "ratings.csv"
    check = RowChecker(ratings_path, on_bad_row)
    users, items, stars, times, lines = [], [], [], [], []
    for line, fields in _rows(ratings_path, RATINGS_HEADER, check):
        if len(fields) != 4:
            check.bad(line, BadRowKind.FIELD_COUNT, f"expected 4 fields (userId,movieId,rating,timestamp), got {len(fields)}")
            continue
        parsed = check.parse(
            line,
            lambda: (int64_field(fields[0], "userId"), int64_field(fields[1], "movieId"), float(fields[2]), int64_field(fields[3], "timestamp")),
            f"fields {fields!r}",
        )
        if parsed is None:
            continue
        user, movie, rating, ts = parsed
        if not (0.5 <= rating <= 5.0) or rating * 2 != round(rating * 2):
            check.bad(line, BadRowKind.OUT_OF_RANGE, f"rating {fields[2]!r} is not a half-star in [0.5, 5]")
        elif ts < 0:
            check.bad(line, BadRowKind.OUT_OF_RANGE, f"negative timestamp {ts}")
        elif movie not in movies:
            check.bad(line, BadRowKind.UNKNOWN_ID, f"movieId {movie} is not in movies.csv")
        else:
            users.append(user)
            items.append(movie)
            stars.append(rating)
            times.append(ts)
            lines.append(line)
    if not users:
        raise DataFormatError(f"{ratings_path}: no valid rating rows")

    item_vocab = np.array(sorted(movies), dtype=np.int64)
    genre_names = tuple(sorted({g for genres in movies.values() for g in genres}))
    column = {g: j for j, g in enumerate(genre_names)}
    item_genres = np.zeros((item_vocab.shape[0], len(genre_names)), np.uint8)
    for row, movie in enumerate(item_vocab):
        item_genres[row, [column[g] for g in movies[int(movie)]]] = 1
    stars = np.array(stars, dtype=np.float32)
    user_vocab = np.unique(np.array(users, dtype=np.int64))
    return build_event_log(
        name="ml-latest-small",
        raw_user=np.array(users, dtype=np.int64),
        raw_item=np.array(items, dtype=np.int64),
        action=np.rint(stars * 2).astype(np.int32),
        rating=stars,
        timestamp=np.array(times, dtype=np.int64),
        line=np.array(lines, dtype=np.int64),
        user_vocab=user_vocab,
        item_vocab=item_vocab,
        user_features=absent_features(DEMOGRAPHICS, user_vocab.shape[0]),
        item_features=(FeatureTable.from_multi_hot("genres", item_genres, genre_names),),
        num_actions=NUM_HALF_STAR_ACTIONS,
        skipped=movie_check.skipped() + check.skipped(),
    )
