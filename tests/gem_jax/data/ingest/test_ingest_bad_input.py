"""Bad input is named by file, line (CSV) or row group and row (Parquet), column and value; skip mode counts it."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem_jax.data.ingest.convert import ConvertOptions, convert, memory_plan
from gem_jax.data.ingest.inspect import inspect_raw
from gem_jax.data.ingest.readers import BadRows, event_kinds, expand_inputs, stream_rows
from gem_jax.data.ingest.schema import EventSchema, FeatureColumn, LabelRule, SchemaError, Side
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.rows import BadRowError, BadRowKind, DataFormatError, OnBadRow

SCHEMA = EventSchema(user="u", item="i", time="t", labels=(LabelRule.parse("click"), LabelRule.parse("r4=r>=4")))
HEADER = "u,i,t,click,r\n"


def _convert(path, out, on_bad_row=OnBadRow.RAISE, schema=SCHEMA):
    return convert([path], out, schema, ConvertOptions(split=SplitRule.parse("time:0.5"), on_bad_row=on_bad_row), log=lambda _: None)


@pytest.mark.parametrize(
    "row, kind, message",
    [
        ("a,b,3,1", BadRowKind.FIELD_COUNT, "line 5: wrong number of fields: 4 fields, the header has 5"),
        ("a,b,3,1,5,6", BadRowKind.FIELD_COUNT, "line 5: wrong number of fields: 6 fields"),
        ("a,b,3,yes,5", BadRowKind.NOT_A_NUMBER, "line 5, column 'click': not a number: 'yes' is not a number"),
        ("a,b,3,2,5", BadRowKind.BAD_VALUE, "line 5, column 'click': invalid value: 2 is not 0 or 1"),
        ("a,b,3,1,1e999", BadRowKind.OUT_OF_RANGE, "line 5, column 'r': value out of range: '1e999' is not a finite float64"),
        ("a,b,soon,1,5", BadRowKind.BAD_VALUE, "line 5, column 't': invalid value: 'soon' is neither an integer nor an ISO 8601"),
        ("a,b,2024-13-01,1,5", BadRowKind.BAD_VALUE, "line 5, column 't': invalid value: '2024-13-01' is not a valid date/time"),
        ("a,b,99999999999999999999,1,5", BadRowKind.OUT_OF_RANGE, "line 5, column 't': value out of range: '99999999999999999999' does not fit in int64"),
        (",b,3,1,5", BadRowKind.BAD_VALUE, "line 5, column 'u': invalid value: empty id"),
    ],
)
def test_a_bad_csv_row_is_named_then_skipped_and_counted(tmp_path, row, kind, message):
    # line 2 good, line 3 blank (no row), line 4 good, line 5 bad, line 6 good
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "a,b,1,1,5\n\nc,d,2,0,3\n" + row + "\ne,f,4,1,4\n")
    with pytest.raises(BadRowError) as error:
        _convert(path, tmp_path / "out")
    assert error.value.path == str(path)
    assert message in str(error.value)
    result = _convert(path, tmp_path / "skip", OnBadRow.SKIP)
    assert result.manifest["counts"]["events"] == 3
    assert result.manifest["counts"]["skipped_rows"] == 1
    (skipped,) = result.manifest["skipped_rows"]
    assert skipped["file"] == str(path) and skipped["count"] == 1 and skipped["first"].startswith("line 5")
    assert skipped["kind"] == kind.value


@pytest.mark.parametrize("on_bad_row", [OnBadRow.RAISE, OnBadRow.SKIP])
def test_a_quote_left_open_is_refused_in_every_mode_rather_than_dropping_the_lines_it_swallows(tmp_path, on_bad_row):
    # line 2 good, line 3 opens a quote it never closes, which runs the record over the 50 good lines after it
    path = tmp_path / "log.csv"
    path.write_text(HEADER + 'a,b,1,1,5\na,"b,2,1,5\n' + "".join(f"u{i},i{i},{10 + i},{i % 2},1\n" for i in range(50)))
    with pytest.raises(BadRowError) as error:
        _convert(path, tmp_path / "out", on_bad_row)
    assert (error.value.path, error.value.location, error.value.kind) == (str(path), "line 3", BadRowKind.QUOTING)
    assert "the record runs over lines 3-53" in str(error.value) and "would drop all 51 lines" in str(error.value)
    assert "close or remove the quote" in str(error.value)
    assert not (tmp_path / "out").exists()


# line 2 good; `early` on line 3 and `late` on line 5, around good lines 4 and 6
FIRST_BAD_ROW = [
    ("a,b,2,yes,5", "a,b,3,1", "line 3, column 'click': not a number: 'yes' is not a number"),  # a bad value before a wrong field count
    ("a,b,3,1", "a,b,2,yes,5", "line 3: wrong number of fields: 4 fields, the header has 5: 'a,b,3,1'"),  # and after one
    ("a,b,2,1,5,6", "a,b,2,yes,5", "line 3: wrong number of fields: 6 fields, the header has 5: 'a,b,2,1,5,6'"),
    ("a,b,2,yes,5", ",b,3,1,5", "line 3, column 'click': not a number: 'yes' is not a number"),  # a later column's defect on an earlier line
    ("a,b,2,1,1e999", "a,b,3,1,x", "line 3, column 'r': value out of range: '1e999' is not a finite float64"),  # a check that runs after another
    ("a,b,2,2,5", "a,b,soon,1,5", "line 3, column 'click': invalid value: 2 is not 0 or 1 (a 0/1 label; use a rule such as click>=1 for other values)"),
    ("a,b,2,yes,5", 'a,"b,3,1,5', "line 3, column 'click': not a number: 'yes' is not a number"),  # before a quote left open
]


@pytest.mark.parametrize("early, late, message", FIRST_BAD_ROW)
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_raise_names_the_first_bad_row_of_the_file_whatever_its_defect(tmp_path, early, late, message, command):
    """`--on-bad-row raise` stops at the file's first malformed row: a wrong field count that the CSV parser finds
    while the values before it are unchecked, a later column's or a later check's defect, waits for them."""
    path = tmp_path / "log.csv"
    path.write_text(HEADER + f"a,b,1,1,5\n{early}\nc,d,3,0,3\n{late}\ne,f,4,1,4\n")
    with pytest.raises(BadRowError) as error:
        _convert(path, tmp_path / "out") if command == "convert" else inspect_raw([path], SCHEMA)
    assert str(error.value) == f"{path}, {message}"
    assert not (tmp_path / "out").exists()


def test_a_bad_value_before_a_line_break_in_a_quoted_field_raises_first(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(HEADER + 'a,b,1,1,5\nc,d,2,0,x\n"e\nf",g,3,1,4\nh,i,4,1,4\n')
    with pytest.raises(BadRowError) as error:
        _convert(path, tmp_path / "out")
    assert str(error.value) == f"{path}, line 3, column 'r': not a number: 'x' is not a number"


@pytest.mark.parametrize("value_line, count_line", [(41, 42), (42, 41), (40, 41), (41, 40), (12, 150), (150, 12), (97, 97 + 30), (97 + 30, 97)])
def test_raise_names_the_first_bad_row_across_parser_blocks(tmp_path, value_line, count_line):
    """Blocks of 64 bytes (a few lines): the wrong field count and the bad value in one block, in two next to each
    other, or far apart; `skip` drops both rows and keeps the rest."""
    lines = [f"u{k},i{k},{k},{k % 2},3" for k in range(2, 200)]
    lines[value_line - 2] = f"u{value_line},i,{value_line},1,x"
    lines[count_line - 2] = f"u{count_line},i,{count_line}"
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "\n".join(lines) + "\n")
    with pytest.raises(BadRowError) as error:
        for _ in stream_rows(expand_inputs([path]), event_kinds(SCHEMA), BadRows(OnBadRow.RAISE), block_size=64):
            pass
    first = min(value_line, count_line)
    assert error.value.location == (f"line {first}, column 'r'" if first == value_line else f"line {first}")
    skipped = BadRows(OnBadRow.SKIP)
    rows = [r for _, _, rows in stream_rows(expand_inputs([path]), event_kinds(SCHEMA), skipped, block_size=64) for r in rows.tolist()]
    assert len(rows) == 196 and value_line not in rows and count_line not in rows and skipped.total == 2


def test_a_line_break_in_a_quoted_field_is_a_bad_row_and_later_lines_keep_their_numbers(tmp_path):
    # line 2 good, lines 3-4 one record (a quoted id with a line break), line 5 good, line 6 bad, line 7 good
    path = tmp_path / "log.csv"
    path.write_text(HEADER + 'a,b,1,1,5\n"c\nd",x,2,0,3\ne,f,3,1,4\ng,h,soon,1,4\ni,j,5,0,1\n')
    with pytest.raises(BadRowError, match="line 3: line break in a quoted field: a quoted field holds a line break \\(lines 3-4\\)"):
        _convert(path, tmp_path / "out")
    result = _convert(path, tmp_path / "skip", OnBadRow.SKIP)
    assert result.manifest["counts"]["events"] == 3 and result.manifest["counts"]["skipped_rows"] == 2
    firsts = {entry["kind"]: entry["first"] for entry in result.manifest["skipped_rows"]}
    assert firsts[BadRowKind.LINE_BREAK.value].startswith("line 3:")
    assert firsts[BadRowKind.BAD_VALUE.value].startswith("line 6, column 't'")  # not line 5: the break's second line counts


def test_a_duplicate_event_after_skipped_and_blank_lines_is_named_at_its_own_line(tmp_path):
    # line 2 good, line 3 blank, lines 4-5 one record (skipped), line 6 bad (skipped), line 7 a copy of line 2,
    # line 8 one too once parsed (5.0 is 5)
    path = tmp_path / "log.csv"
    path.write_text(HEADER + 'a,b,1,1,5\n\n"c\nd",x,2,0,3\ng,h,soon,1,4\na,b,1,1,5\na,b,1,1,5.0\n')
    result = _convert(path, tmp_path / "skip", OnBadRow.SKIP)
    assert result.manifest["counts"]["events"] == 3 and result.manifest["counts"]["skipped_rows"] == 2
    assert result.manifest["counts"]["duplicate_events"] == 2
    assert result.manifest["first_duplicate_event"] == {"file": str(path), "location": "line 7", "copy_of": "line 2"}


def test_utc_offsets_are_converted_and_fractions_of_a_second_floored(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "a,b,2024-01-01T02:00:00+02:00,1,5\nc,d,2024-01-01T00:00:00Z,0,3\ne,f,2024-01-01 01:00-0100,1,4\ng,h,2024-01-01T00:00:01.9,0,1\n")
    result = _convert(path, tmp_path / "out")
    assert result.manifest["time_range"] == [1704067200, 1704074400]  # 00:00 UTC twice, 00:00:01 (floored), 01:00 at UTC-1: 02:00 UTC
    # Parquet timestamps of any unit alike (milliseconds floored, also before 1970)
    pq.write_table(pa.table({"u": ["a", "b", "c"], "i": ["x", "y", "z"], "click": [1, 0, 1], "r": [5, 3, 4],
                             "t": pa.array([1704067200999, -1500, 1704067201000], pa.timestamp("ms"))}), tmp_path / "log.parquet")
    assert _convert(tmp_path / "log.parquet", tmp_path / "pq").manifest["time_range"] == [-2, 1704067201]


def test_a_missing_side_table_column_is_named_before_the_log_is_read(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "a,b,1,1,5\n")
    (tmp_path / "items.csv").write_text("item,genre\nb,x\n")
    schema = EventSchema(user="u", item="i", time="t", labels=SCHEMA.labels, item_table=str(tmp_path / "items.csv"), item_key="item_id",
                         features=(FeatureColumn("genre", Side.ITEM),))
    lines = []
    with pytest.raises(DataFormatError, match=r"items\.csv: missing column\(s\) \['item_id'\]; the header has \['item', 'genre'\]"):
        convert([path], tmp_path / "out", schema, ConvertOptions(split=SplitRule.parse("time:0.5")), log=lines.append)
    assert lines == [] and not (tmp_path / "out.partial").exists()  # nothing was read or written


def test_a_time_column_mixing_integers_and_dates_is_refused(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "a,b,2024-01-01,1,5\nc,d,20240102,0,3\n")  # the second is no ISO date: 20240102 seconds
    with pytest.raises(DataFormatError, match=r"column 't' mixes integers \(line 3: '20240102', read as Unix seconds\) and ISO 8601 dates \(line 2: '2024-01-01'\)"):
        _convert(path, tmp_path / "out")


def test_weights_and_huge_times_are_checked(tmp_path):
    schema = EventSchema(user="u", item="i", time="t", weight="w", labels=(LabelRule.parse("click"),))
    path = tmp_path / "log.parquet"
    pq.write_table(pa.table({"u": ["a", "b"], "i": ["x", "y"], "t": pa.array([1, 2], pa.uint64()), "click": [1, 0], "w": [1.0, -0.5]}), path)
    with pytest.raises(BadRowError, match=r"row group 0, row 1, column 'w': value out of range: weight -0.5 is negative"):
        _convert(path, tmp_path / "out", schema=schema)
    pq.write_table(pa.table({"u": ["a", "b"], "i": ["x", "y"], "t": pa.array([1, 2**64 - 1], pa.uint64()), "click": [1, 0], "w": [1.0, 1.0]}), path)
    with pytest.raises(BadRowError, match=r"row 1, column 't': value out of range: 18446744073709551615 does not fit in int64"):
        _convert(path, tmp_path / "out", schema=schema)
    pq.write_table(pa.table({"u": ["a", "b"], "i": ["x", "y"], "t": [1, 2], "click": [1.0, float("nan")], "w": [1.0, 1.0]}), path)
    with pytest.raises(BadRowError, match=r"row 1, column 'click': value out of range: nan is not a finite number$"):
        _convert(path, tmp_path / "out", schema=schema)
    # Weights are stored as float32: one it would turn into inf or 0 is refused, not stored so.
    csv = tmp_path / "log.csv"
    for weight, shown, becomes in (("1e39", r"1e\+39", "inf"), ("1e-50", "1e-50", "0")):
        csv.write_text(f"u,i,t,click,w\na,x,1,1,1\nb,y,2,0,{weight}\n")
        with pytest.raises(BadRowError, match=rf"line 3, column 'w': value out of range: weight {shown} is outside float32's range .* become {becomes}\)"):
            _convert(csv, tmp_path / "out", schema=schema)
    csv.write_text("u,i,t,click,w\na,x,1,1,1\nb,y,2,0,1e-40\n")  # a float32 subnormal: stored as it is
    assert _convert(csv, tmp_path / "sub", schema=schema).manifest["counts"]["events"] == 2
    # Times beyond +-2^62, whose differences would overflow int64 (ages, the split's quantile), are refused.
    for time in (str(-(2**63)), str(2**62), "-4611686018427387904"):
        csv.write_text(f"u,i,t,click,w\na,x,{time},1,1\nb,y,2,0,1\n")
        with pytest.raises(BadRowError, match=rf"line 2, column 't': value out of range: time {time} is outside \+-2\^62"):
            _convert(csv, tmp_path / "out", schema=schema)
    csv.write_text(f"u,i,t,click,w\na,x,{2**62 - 1},1,1\nb,y,{-(2**62) + 1},0,1\n")
    assert _convert(csv, tmp_path / "edge", schema=schema).manifest["counts"]["events"] == 2
    # The minimum named is the one accepted (the fixed share grows with the budget's CSV block size).
    for memory_mb in (100, 392, 407):
        with pytest.raises(ValueError, match=rf"--memory-mb must be at least 408 \(MiB\), got {memory_mb}"):
            ConvertOptions(split=SplitRule.parse("last:1"), memory_mb=memory_mb)
    assert memory_plan(408) == (3 << 20, (408 - 320 - 8 * 3) << 20)
    for flag, field in (("--min-count", "min_count"), ("--max-vocab", "max_vocab"), ("--shards", "shards")):
        with pytest.raises(ValueError, match=rf"^{flag} must be at least 1, got 0$"):
            ConvertOptions(split=SplitRule.parse("last:1"), **{field: 0})


def test_a_row_empty_in_the_read_columns_is_a_bad_row_not_a_blank_line(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("u,i,t,click,r,note\na,b,1,1,5,\n,,,,,kept for the record\n\n")
    with pytest.raises(BadRowError, match=r"line 3, column 'u': invalid value: empty id"):
        _convert(path, tmp_path / "out")


def test_undecodable_bytes_name_the_line_and_byte(tmp_path):
    path = tmp_path / "log.csv"
    path.write_bytes(HEADER.encode() + b"a,b,1,1,5\nc\xff,d,2,0,3\n")
    with pytest.raises(BadRowError, match=r"line 3, column 'u': undecodable bytes: byte 0xff at byte 2 is not valid UTF-8"):
        _convert(path, tmp_path / "out")


def test_a_byte_order_mark_is_no_part_of_the_first_column_name(tmp_path):
    # Spreadsheet exports ("CSV UTF-8") begin with one; the rows after it are read as without it.
    path = tmp_path / "log.csv"
    path.write_bytes(b"\xef\xbb\xbf" + HEADER.encode() + b"a,b,1,1,5\nc,d,2,0,3\na,d,3,1,4\n")
    result = _convert(path, tmp_path / "out")
    assert result.manifest["counts"]["events"] == 3
    assert (tmp_path / "out" / "vocab" / "user.csv").read_text().splitlines()[3:] == ['2,"a",2', '3,"c",1']


def test_every_dropped_row_is_counted_by_kind(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "a,b,1,1,5\nx,y\na,b,x,1,1\nc,d,2,1,x\nc,d,3,1,y\ne,f,4,1,4\n")
    result = _convert(path, tmp_path / "out", OnBadRow.SKIP)
    by_kind = {entry["kind"]: (entry["count"], entry["first"]) for entry in result.manifest["skipped_rows"]}
    assert by_kind == {
        "wrong number of fields": (1, "line 3: 2 fields, the header has 5: 'x,y'"),
        "invalid value": (1, "line 4, column 't': 'x' is neither an integer nor an ISO 8601 date/time"),
        "not a number": (2, "line 5, column 'r': 'x' is not a number"),
    }
    assert result.manifest["counts"]["events"] == 2


def test_a_bad_parquet_value_names_row_group_and_row(tmp_path):
    path = tmp_path / "log.parquet"
    table = pa.table({"u": ["a"] * 6, "i": ["b"] * 6, "t": list(range(6)), "click": ["1", "0", "1", "1", "maybe", "0"], "r": [5.0] * 6})
    pq.write_table(table, path, row_group_size=3)
    with pytest.raises(BadRowError, match=r"log\.parquet, row group 1, row 1, column 'click': not a number: 'maybe' is not a number"):
        _convert(path, tmp_path / "out")
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"u": ["a", None], "i": ["b", "c"], "t": [1, 2], "click": [1, 0], "r": [5.0, None]}), nulls)
    with pytest.raises(BadRowError, match=r"row group 0, row 1, column 'u': invalid value: empty id"):
        _convert(nulls, tmp_path / "out")


def test_missing_and_mistyped_columns_name_the_file(tmp_path):
    csv = tmp_path / "log.csv"
    csv.write_text("u,i,time,click,r\na,b,1,1,5\n")
    with pytest.raises(DataFormatError, match=r"log\.csv: missing column\(s\) \['t'\]; the header has \['u', 'i', 'time', 'click', 'r'\]"):
        _convert(csv, tmp_path / "out")
    parquet = tmp_path / "log.parquet"
    pq.write_table(pa.table({"u": ["a"], "i": ["b"], "t": [1], "click": [1]}), parquet)
    with pytest.raises(DataFormatError, match=r"log\.parquet: missing column\(s\) \['r'\]; the file has"):
        _convert(parquet, tmp_path / "out")
    listy = tmp_path / "list.parquet"
    pq.write_table(pa.table({"u": [[1]], "i": ["b"], "t": [1], "click": [1], "r": [1.0]}), listy)
    with pytest.raises(DataFormatError, match=r"list\.parquet: column 'u' has type list<.*: int64>; expected text or integers"):
        _convert(listy, tmp_path / "out")


def test_parquet_files_that_disagree_are_named(tmp_path):
    folder = tmp_path / "events"
    folder.mkdir()
    pq.write_table(pa.table({"u": ["a"], "i": ["b"], "t": [1], "click": [1], "r": [1.0]}), folder / "a.parquet")
    pq.write_table(pa.table({"u": ["a"], "i": ["b"], "t": ["2024-01-01"], "click": [1], "r": [1.0]}), folder / "b.parquet")
    with pytest.raises(DataFormatError, match=r"files disagree on column 't': .*a\.parquet has type int64, .*b\.parquet has type string"):
        _convert(folder, tmp_path / "out")


def test_inputs_and_flags_are_checked(tmp_path):
    with pytest.raises(DataFormatError, match="no such file or directory, and no file matches it as a glob"):
        expand_inputs([tmp_path / "nothing*.csv"])
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(DataFormatError, match=r"notes\.json: unknown file type"):
        expand_inputs([tmp_path / "notes.json"])
    with pytest.raises(SchemaError, match="expected a column"):
        LabelRule.parse("rating>=")
    with pytest.raises(SchemaError, match="threshold 'high' is not a number"):
        LabelRule.parse("rating>=high")
    with pytest.raises(SchemaError, match=r"expected time:Q \(0 < Q < 1\)"):
        SplitRule.parse("time:1.5")
    assert LabelRule.parse("like=rating>=4") == LabelRule("like", "rating", ">=", 4.0)
    assert LabelRule.parse("high = rating > 3.5") == LabelRule("high", "rating", ">", 3.5)
    with pytest.raises(SchemaError, match=r"name the rule's task .*, e\.g\. --label like=rating > 3\.5"):
        LabelRule.parse("rating > 3.5")  # its task would be named 'rating>3.5', which no metric can carry
    with pytest.raises(SchemaError, match="the task name 'my-like' must be letters, digits and '_'"):
        LabelRule.parse("my-like=rating>=4")
    with pytest.raises(SchemaError, match="the feature's name is its column's, which must be letters, digits and '_'"):
        FeatureColumn.parse("genre-list:multi", Side.ITEM)
    assert SplitRule.parse("time:2024-01-02").value == 1704153600
    # a cutoff with an offset or Z means that instant, as the time column reads one; without, UTC; fractions floored
    for cutoff in ("2024-01-02T00:00:00Z", "2024-01-02T02:00:00+02:00", "2024-01-01T19:00:00-0500", "2024-01-02 00:00:00.9"):
        assert SplitRule.parse(f"time:{cutoff}").value == 1704153600, cutoff
    with pytest.raises(SchemaError, match=r"time:T \(an integer >= 1\)"):
        SplitRule.parse("time:0")
    schema = EventSchema(user="u", item="i", time="u", labels=(LabelRule.parse("click"),))
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "a,b,1,1,5\n")
    with pytest.raises(DataFormatError, match="column 'u' is named by both --user and --time"):
        _convert(path, tmp_path / "out", schema=schema)


def test_a_binary_column_reads_true_and_false_as_python_json_and_spreadsheets_write_them(tmp_path):
    from gem_jax.data.ingest.shards import ConvertedLog

    schema = EventSchema(user="u", item="i", time="t", labels=(LabelRule.parse("click"),))
    path = tmp_path / "log.csv"
    words = ["true", "False", "TRUE", "false", "True", "FALSE", "1", "0"]
    path.write_text("u,i,t,click\n" + "".join(f"a,x{k},{k + 1},{w}\n" for k, w in enumerate(words)))
    out = _convert(path, tmp_path / "out", schema=schema).out
    (record,) = list(ConvertedLog(out))
    assert record["labels"][:, 0].tolist() == [1, 0, 1, 0, 1, 0, 1, 0]
    path.write_text("u,i,t,click\na,x,1,yes\n")
    with pytest.raises(BadRowError, match=r"line 2, column 'click': not a number: 'yes' is not a number"):
        _convert(path, tmp_path / "refused", schema=schema)


def test_a_bad_value_in_a_parquet_list_column_drops_its_row_as_it_counts_it(tmp_path):
    """A multi-valued feature read from a Parquet list column: an undecodable value refuses its row (named by its
    row, not by its place among the list's values), and under skip the row counted is the row left out."""
    path = tmp_path / "log.parquet"
    tags = pa.array([[b"x", b"y"], [b"z"], [b"ok", b"c"], [b"w"], [b"v\xff", b"u\xfe"], [b"q", b"r", b"s", b"t\xff"]], pa.list_(pa.binary()))
    pq.write_table(pa.table({"u": list("abcdef"), "i": ["b"] * 6, "t": list(range(6)), "click": [1, 0, 1, 1, 0, 0], "tags": tags}), path)
    schema = EventSchema(user="u", item="i", time="t", labels=(LabelRule.parse("click"),), features=(FeatureColumn("tags", Side.ITEM, multi=True),))
    with pytest.raises(BadRowError, match=r"row group 0, row 4, column 'tags': undecodable bytes: byte 0xff at byte 2 is not valid UTF-8"):
        _convert(path, tmp_path / "out", schema=schema)
    result = _convert(path, tmp_path / "skip", OnBadRow.SKIP, schema=schema)
    assert result.manifest["counts"]["events"] == 4 and result.manifest["counts"]["skipped_rows"] == 2
    assert [(e["kind"], e["count"]) for e in result.manifest["skipped_rows"]] == [("undecodable bytes", 2)]
