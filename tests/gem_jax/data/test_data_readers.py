"""Tests of the three readers: real files (counts, features, order) and malformed input."""

import json
from pathlib import Path

import numpy as np
import pytest

from gem_jax.data.sources.amazon_beauty import read_amazon_beauty
from gem_jax.data.sources.movielens_100k import age_bucket, read_ml_100k
from gem_jax.data.sources.movielens_small import read_ml_latest_small
from gem_jax.data.paths import SOURCE_FOLDERS, default_path, shared_data_dir
from gem_jax.data.config import Source
from gem_jax.data.rows import BadRowError, BadRowKind, DataFormatError, OnBadRow


def _shared(source: Source) -> Path:
    folder = shared_data_dir() / SOURCE_FOLDERS[source]
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent (set GEM_SHARED_DATA to the folder holding {SOURCE_FOLDERS[source]}/)")
    return folder


def _check_sorted(log):
    """Each user's events contiguous, by (timestamp, item, line)."""
    assert np.all(np.diff(log.user) >= 0)
    same_user = log.user[1:] == log.user[:-1]
    ts_step = np.diff(log.timestamp)
    assert np.all(ts_step[same_user] >= 0)
    tie = same_user & (ts_step == 0)
    item_step = np.diff(log.item)
    assert np.all(item_step[tie] >= 0)
    assert np.all(np.diff(log.line)[tie & (item_step == 0)] > 0)
    np.testing.assert_array_equal(log.user_offsets[log.user], np.searchsorted(log.user, log.user))


# ---------------------------------------------------------------- real files



def multi_hot(log):
    """The log's item feature (genres, attributes) as 0/1 rows `[num_items, vocab - 1]`."""
    table = log.item_features[0]
    hot = np.zeros((table.ids.shape[0], table.feature.vocab_size), np.uint8)
    np.put_along_axis(hot, table.ids, 1, axis=1)
    return hot[:, 1:]


def demographics(log):
    """The log's user features (age, gender, occupation) as columns `[num_users, 3]`."""
    return np.concatenate([t.ids for t in log.user_features], axis=1)

@pytest.mark.parametrize("where", ["shipped", "shared"])
def test_ml_latest_small_counts(where):
    folder = default_path(Source.ML_LATEST_SMALL) if where == "shipped" else _shared(Source.ML_LATEST_SMALL)
    log = read_ml_latest_small(folder)
    assert log.num_events == 100836
    assert log.num_users - 1 == 610
    assert log.num_items - 1 == 9742
    assert np.unique(log.item).shape[0] == 9724  # movies with a rating
    assert (log.item_features[0].feature.vocab_size - 1) == 19 and "(no genres listed)" not in log.item_features[0].names
    assert log.skipped == ()
    _check_sorted(log)
    np.testing.assert_array_equal(np.bincount(log.action, minlength=11)[1:], [1370, 2811, 1791, 7551, 5550, 20047, 13136, 26818, 8551, 13211])
    # userId 1 rated movieId 1 (Toy Story: Adventure|Animation|Children|Comedy|Fantasy) 4.0 at 964982703.
    movie = int(np.flatnonzero(log.raw_item_ids == 1)[0])
    event = np.flatnonzero((log.raw_user_ids[log.user] == 1) & (log.item == movie))
    assert event.size == 1 and log.rating[event[0]] == 4.0 and log.timestamp[event[0]] == 964982703
    names = [n for n, flag in zip(log.item_features[0].names, multi_hot(log)[movie]) if flag]
    assert names == ["Adventure", "Animation", "Children", "Comedy", "Fantasy"]
    assert multi_hot(log)[0].sum() == 0 and (demographics(log) == 0).all()
    no_genre = int(np.flatnonzero(log.raw_item_ids == 114335)[0])  # "La cravate (1957)": (no genres listed)
    assert multi_hot(log)[no_genre].sum() == 0


def test_ml_100k_counts_and_user_features():
    log = read_ml_100k(_shared(Source.ML_100K))
    assert log.num_events == 100000
    assert log.num_users - 1 == 943 and log.num_items - 1 == 1682
    assert (log.item_features[0].feature.vocab_size - 1) == 19 and log.item_features[0].names[0] == "unknown"
    assert tuple(t.feature.vocab_size for t in log.user_features) == (8, 3, 22)
    _check_sorted(log)
    np.testing.assert_array_equal(np.bincount(log.action, minlength=11)[2::2], [6110, 11370, 27145, 34174, 21201])
    # u.user line 1: "1|24|M|technician|85711"; technician is the 20th of u.occupation.
    assert log.raw_user_ids[1] == 1 and tuple(demographics(log)[1]) == (age_bucket(24), 1, 20)
    assert tuple(demographics(log)[2]) == (age_bucket(53), 2, 14)  # "2|53|F|other|94043"
    np.testing.assert_array_equal(np.bincount(demographics(log)[1:, 1]), [0, 670, 273])
    toy_story = [n for n, flag in zip(log.item_features[0].names, multi_hot(log)[1]) if flag]
    assert toy_story == ["Animation", "Children's", "Comedy"]


def test_amazon_beauty_counts():
    log = read_amazon_beauty(_shared(Source.AMAZON_BEAUTY))
    assert log.num_events == 198502
    assert log.num_users - 1 == 22363 and log.num_items - 1 == 12101
    assert (log.item_features[0].feature.vocab_size - 1) == 637
    assert np.isnan(log.rating).all() and (log.action == 1).all()
    _check_sorted(log)
    # Line 1: "1 1 2 3 4 5"; positions are the timestamps.
    np.testing.assert_array_equal(log.raw_item_ids[log.item[:5]], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(log.timestamp[:5], np.arange(5))
    lengths = np.diff(log.user_offsets)[1:]
    assert lengths.min() == 5 and lengths.max() == 204
    assert 1 <= multi_hot(log)[1:].sum(axis=1).min() and multi_hot(log)[1:].sum(axis=1).max() <= 6


def test_amazon_beauty_without_attributes():
    log = read_amazon_beauty(_shared(Source.AMAZON_BEAUTY), attributes=False)
    assert (log.item_features[0].feature.vocab_size - 1) == 1 and multi_hot(log).sum() == 0


# ---------------------------------------------------------------- malformed input

MOVIES = 'movieId,title,genres\n1,"Toy Story (1995)",Adventure|Comedy\n2,"Heat, the (1995)",Action\n3,Nothing (2000),(no genres listed)\n'


def _ml_small(tmp_path, ratings_rows, movies=MOVIES):
    (tmp_path / "movies.csv").write_text(movies)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "".join(r + "\n" for r in ratings_rows))
    return tmp_path


GOOD_RATINGS = ["1,1,4.0,100", "1,2,3.5,90", "2,3,5.0,50", "1,3,0.5,90"]


def test_ml_small_tiny_file_parsed_and_sorted(tmp_path):
    log = read_ml_latest_small(_ml_small(tmp_path, GOOD_RATINGS))
    assert log.num_events == 4 and log.num_users == 3 and log.num_items == 4
    assert log.item_features[0].names == ("Action", "Adventure", "Comedy")
    # user 1: (90, movie 2), (90, movie 3) tie broken by item id, then (100, movie 1).
    np.testing.assert_array_equal(log.raw_item_ids[log.item], [2, 3, 1, 3])
    np.testing.assert_array_equal(log.rating, [3.5, 0.5, 4.0, 5.0])
    np.testing.assert_array_equal(log.action, [7, 1, 8, 10])
    np.testing.assert_array_equal(log.line, [3, 5, 2, 4])
    np.testing.assert_array_equal(multi_hot(log)[3], [0, 0, 0])  # "(no genres listed)"
    np.testing.assert_array_equal(multi_hot(log)[2], [1, 0, 0])  # quoted title with a comma


@pytest.mark.parametrize(
    "row,kind,fragment",
    [
        ("1,1,4.0", BadRowKind.FIELD_COUNT, "expected 4 fields"),
        ("1,1,4.0,100,7", BadRowKind.FIELD_COUNT, "got 5"),
        ("1,x,4.0,100", BadRowKind.NOT_A_NUMBER, "'x'"),
        ("1,1,four,100", BadRowKind.NOT_A_NUMBER, "four"),
        ("1,1,5.5,100", BadRowKind.OUT_OF_RANGE, "half-star"),
        ("1,1,0.0,100", BadRowKind.OUT_OF_RANGE, "half-star"),
        ("1,1,3.2,100", BadRowKind.OUT_OF_RANGE, "half-star"),
        ("1,1,nan,100", BadRowKind.OUT_OF_RANGE, "half-star"),
        ("1,1,4.0,-5", BadRowKind.OUT_OF_RANGE, "negative timestamp"),
        ("1,99,4.0,100", BadRowKind.UNKNOWN_ID, "movieId 99 is not in movies.csv"),
        ('1,"1,4.0,100', BadRowKind.QUOTING, "unexpected end of data"),
        ('1,"1"x,4.0,100', BadRowKind.QUOTING, "expected after"),
        ("12345678901234567890,1,4.0,100", BadRowKind.OUT_OF_RANGE, "userId '12345678901234567890' does not fit in a 64-bit"),
        ("1,1,4.0,99999999999999999999", BadRowKind.OUT_OF_RANGE, "timestamp '99999999999999999999' does not fit"),
    ],
)
def test_ml_small_bad_rating_row_names_file_and_line(tmp_path, row, kind, fragment):
    folder = _ml_small(tmp_path, GOOD_RATINGS[:2] + [row] + GOOD_RATINGS[2:])
    with pytest.raises(BadRowError, match=fragment) as err:
        read_ml_latest_small(folder)
    assert err.value.kind is kind
    assert err.value.path == str(folder / "ratings.csv") and err.value.location == "line 4"
    assert str(folder / "ratings.csv") in str(err.value) and "line 4" in str(err.value)

    log = read_ml_latest_small(folder, OnBadRow.SKIP)
    assert log.num_events == len(GOOD_RATINGS)
    assert len(log.skipped) == 1
    skipped = log.skipped[0]
    assert (skipped.path, skipped.kind, skipped.count, skipped.first_location) == (str(folder / "ratings.csv"), kind, 1, "line 4")


def test_ml_small_skip_counts_several_kinds(tmp_path):
    rows = GOOD_RATINGS + ["1,99,4.0,1", "2,98,4.0,1", "x,1,1,1", "1,1", "1,1,9.0,1"]
    log = read_ml_latest_small(_ml_small(tmp_path, rows), OnBadRow.SKIP)
    assert log.num_events == len(GOOD_RATINGS)
    counts = {s.kind: (s.count, s.first_location) for s in log.skipped}
    assert counts == {
        BadRowKind.FIELD_COUNT: (1, "line 9"),
        BadRowKind.NOT_A_NUMBER: (1, "line 8"),
        BadRowKind.OUT_OF_RANGE: (1, "line 10"),
        BadRowKind.UNKNOWN_ID: (2, "line 6"),
    }
    assert "skipped 2 row(s), unknown id (first at line 6)" in str(log.skipped[-1])


def test_ml_small_unbalanced_quote_costs_exactly_its_line(tmp_path):
    # A csv.reader over the file would read the quote's field on to the end of the file (or to
    # the next quote) and drop every row in between; line by line, only line 3 is bad.
    rows = GOOD_RATINGS[:1] + ['1,"2,3.5,90'] + GOOD_RATINGS[1:] + [f"3,1,4.0,{t}" for t in range(40)]
    folder = _ml_small(tmp_path, rows)
    with pytest.raises(BadRowError, match="line 3: unbalanced quote"):
        read_ml_latest_small(folder)
    log = read_ml_latest_small(folder, OnBadRow.SKIP)
    assert log.num_events == len(rows) - 1
    assert [(s.kind, s.count, s.first_location) for s in log.skipped] == [(BadRowKind.QUOTING, 1, "line 3")]


def test_ml_small_non_utf8_byte_names_file_line_and_byte(tmp_path):
    folder = _ml_small(tmp_path, GOOD_RATINGS)
    path = folder / "ratings.csv"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = b"1,2,3.5,9\xff\n"  # line 3
    path.write_bytes(b"".join(lines))
    with pytest.raises(BadRowError, match=r"ratings.csv, line 3: undecodable bytes: byte 0xff at column 10 is not valid utf-8"):
        read_ml_latest_small(folder)
    log = read_ml_latest_small(folder, OnBadRow.SKIP)
    assert log.num_events == len(GOOD_RATINGS) - 1
    assert [(s.kind, s.count, s.first_location) for s in log.skipped] == [(BadRowKind.ENCODING, 1, "line 3")]


def test_ml_small_bad_movie_rows(tmp_path):
    movies = MOVIES + "2,Again (1999),Drama\n4,Empty genre (1999),\n"
    folder = _ml_small(tmp_path, GOOD_RATINGS, movies)
    with pytest.raises(BadRowError, match=r"movies.csv, line 5: duplicate id: movieId 2 appears twice"):
        read_ml_latest_small(folder)
    log = read_ml_latest_small(folder, OnBadRow.SKIP)
    assert log.num_items == 4  # movies 1..3; the duplicate and the genre-less row skipped
    assert {(s.kind, s.count) for s in log.skipped} == {(BadRowKind.DUPLICATE_ID, 1), (BadRowKind.BAD_VALUE, 1)}
    # A rating of a skipped movie is then an unknown id, counted too.
    folder = _ml_small(tmp_path, GOOD_RATINGS + ["1,4,3.0,1"], movies)
    log = read_ml_latest_small(folder, OnBadRow.SKIP)
    assert (BadRowKind.UNKNOWN_ID, 1) in {(s.kind, s.count) for s in log.skipped}


def test_ml_small_bad_header_and_empty(tmp_path):
    (tmp_path / "movies.csv").write_text(MOVIES)
    (tmp_path / "ratings.csv").write_text("user,movie,rating,ts\n1,1,4.0,1\n")
    with pytest.raises(DataFormatError, match=r"ratings.csv, line 1: expected the header"):
        read_ml_latest_small(tmp_path, OnBadRow.SKIP)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,9,4.0,1\n")
    with pytest.raises(DataFormatError, match="no valid rating rows"):
        read_ml_latest_small(tmp_path, OnBadRow.SKIP)


def test_on_bad_row_must_be_the_enum(tmp_path):
    with pytest.raises(TypeError, match="OnBadRow"):
        read_ml_latest_small(_ml_small(tmp_path, GOOD_RATINGS), "skip")


def _ml_100k(tmp_path, data_rows, user_rows=None, item_rows=None):
    genres = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
              "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western"]
    (tmp_path / "u.genre").write_text("".join(f"{g}|{k}\n" for k, g in enumerate(genres)) + "\n")
    (tmp_path / "u.occupation").write_text("artist\nwriter\n")
    flags = lambda *on: "|".join("1" if k in on else "0" for k in range(19))
    items = item_rows or [f"1|Les Mis\xe9rables (1995)|01-Jan-1995||http://x|{flags(8)}", f"2|B (1996)|01-Jan-1996||http://y|{flags(1, 2)}"]
    (tmp_path / "u.item").write_bytes(("\n".join(items) + "\n").encode("latin-1"))
    users = user_rows or ["1|17|M|writer|11111", "2|56|F|artist|22222"]
    (tmp_path / "u.user").write_text("\n".join(users) + "\n")
    (tmp_path / "u.data").write_text("\n".join(data_rows) + "\n")
    return tmp_path


GOOD_100K = ["1\t1\t5\t10", "2\t2\t3\t20", "1\t2\t4\t10"]


def test_ml_100k_tiny_file_features(tmp_path):
    log = read_ml_100k(_ml_100k(tmp_path, GOOD_100K))
    assert log.num_events == 3
    np.testing.assert_array_equal(demographics(log)[1:], [[1, 1, 2], [7, 2, 1]])
    np.testing.assert_array_equal(log.raw_item_ids[log.item], [1, 2, 2])
    np.testing.assert_array_equal(log.action, [10, 8, 6])
    assert multi_hot(log)[1].tolist() == [0] * 8 + [1] + [0] * 10


@pytest.mark.parametrize(
    "file,rows,kind,fragment,line",
    [
        ("u.data", {"data": GOOD_100K + ["1\t1\t6\t1"]}, BadRowKind.OUT_OF_RANGE, "rating 6", 4),
        ("u.data", {"data": GOOD_100K + ["3\t1\t4\t1"]}, BadRowKind.UNKNOWN_ID, "user 3 is not in u.user", 4),
        ("u.data", {"data": ["1\t7\t4\t1"] + GOOD_100K}, BadRowKind.UNKNOWN_ID, "item 7 is not in u.item", 1),
        ("u.data", {"data": GOOD_100K + ["1 1 4 1"]}, BadRowKind.FIELD_COUNT, "tab-separated", 4),
        ("u.user", {"users": ["1|17|M|writer|1", "2|50|X|artist|2"]}, BadRowKind.BAD_VALUE, "gender 'X'", 2),
        ("u.user", {"users": ["1|17|M|pilot|1", "2|50|F|artist|2"]}, BadRowKind.UNKNOWN_ID, "occupation 'pilot'", 1),
        ("u.user", {"users": ["1|0|M|writer|1", "2|50|F|artist|2"]}, BadRowKind.OUT_OF_RANGE, "age 0", 1),
        ("u.item", {"items": ["1|A|d||u|" + "|".join(["0"] * 19), "2|B|d||u|" + "|".join(["2"] * 19)]}, BadRowKind.BAD_VALUE, "0 or 1", 2),
        ("u.item", {"items": ["1|A|d||u|" + "|".join(["0"] * 18), "2|B|d||u|" + "|".join(["0"] * 19)]}, BadRowKind.FIELD_COUNT, "expected 24", 1),
    ],
)
def test_ml_100k_bad_rows(tmp_path, file, rows, kind, fragment, line):
    folder = _ml_100k(tmp_path, rows.get("data", GOOD_100K), rows.get("users"), rows.get("items"))
    with pytest.raises(BadRowError, match=fragment) as err:
        read_ml_100k(folder)
    assert err.value.kind is kind and err.value.path == str(folder / file) and err.value.location == f"line {line}"
    log = read_ml_100k(folder, OnBadRow.SKIP)
    assert any(s.kind is kind and s.path == str(folder / file) for s in log.skipped)
    assert log.num_events + sum(s.count for s in log.skipped if s.path.endswith("u.data")) <= len(rows.get("data", GOOD_100K))


def _beauty(tmp_path, lines, attributes=None):
    (tmp_path / "Beauty.txt").write_text("\n".join(lines) + "\n")
    attributes = attributes if attributes is not None else {"1": [5, 9], "2": [9], "3": [7], "4": [5]}
    (tmp_path / "Beauty_item2attributes.json").write_text(json.dumps(attributes))
    return tmp_path


def test_beauty_tiny_file(tmp_path):
    log = read_amazon_beauty(_beauty(tmp_path, ["2 3 1 3", "1 4 2"]))
    np.testing.assert_array_equal(log.raw_user_ids[log.user], [1, 1, 2, 2, 2])
    np.testing.assert_array_equal(log.raw_item_ids[log.item], [4, 2, 3, 1, 3])
    np.testing.assert_array_equal(log.timestamp, [0, 1, 0, 1, 2])
    assert log.item_features[0].names == ("5", "7", "9")
    np.testing.assert_array_equal(multi_hot(log)[1:], [[1, 0, 1], [0, 0, 1], [0, 1, 0], [1, 0, 0]])
    assert "0 item(s)" in log.notes[0]


@pytest.mark.parametrize(
    "lines,kind,fragment,line",
    [
        (["1 1 2", "2"], BadRowKind.FIELD_COUNT, "at least one item", 2),
        (["1 1 2", "2 3 x"], BadRowKind.NOT_A_NUMBER, "not an integer", 2),
        (["1 1 2", "2 0 3"], BadRowKind.OUT_OF_RANGE, "positive", 2),
        (["1 1 2", "1 3 4"], BadRowKind.DUPLICATE_ID, "user 1 has a second line", 2),
        (["1 1 2", "2 3 123456789012345678901"], BadRowKind.OUT_OF_RANGE, "does not fit in a 64-bit integer", 2),
    ],
)
def test_beauty_bad_lines(tmp_path, lines, kind, fragment, line):
    folder = _beauty(tmp_path, lines)
    with pytest.raises(BadRowError, match=fragment) as err:
        read_amazon_beauty(folder)
    assert err.value.kind is kind and err.value.location == f"line {line}" and err.value.path.endswith("Beauty.txt")
    log = read_amazon_beauty(folder, OnBadRow.SKIP)
    assert log.num_events == 2 and [(s.kind, s.count) for s in log.skipped] == [(kind, 1)]


def test_beauty_bad_attributes(tmp_path):
    folder = _beauty(tmp_path, ["1 1 2"], {"1": [3], "2": "brand", "x": [1]})
    with pytest.raises(BadRowError, match=r"key '2': invalid value"):
        read_amazon_beauty(folder)
    log = read_amazon_beauty(folder, OnBadRow.SKIP)
    assert {(s.kind, s.count) for s in log.skipped} == {(BadRowKind.BAD_VALUE, 1), (BadRowKind.NOT_A_NUMBER, 1)}
    assert "1 item(s) of Beauty.txt have no attributes" in log.notes[0]
    (folder / "Beauty_item2attributes.json").write_text("{not json")
    with pytest.raises(DataFormatError, match="not valid JSON"):
        read_amazon_beauty(folder)
