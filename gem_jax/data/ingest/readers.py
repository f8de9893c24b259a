"""Streaming readers of CSV/TSV and Parquet event logs, with per-row checks.

`expand_inputs` turns paths, directories and globs into a sorted list of
`InputFile`s; `stream_rows` yields their rows in record batches (pyarrow
`csv.open_csv` blocks, `ParquetFile.iter_batches` per row group), parsed
column by column with vectorised pyarrow / numpy code, never reading a whole
file, with each row's line or row number (`row_location` names it). A malformed
value is reported through `BadRows`: under `OnBadRow.RAISE` the first one in the
file (the smallest line or row, whichever check or the CSV parser finds it) raises
`BadRowError` naming the file, the line (CSV) or row group and row (Parquet, both
0-based), the column and the value; under `OnBadRow.SKIP` its row is dropped and
counted by file and kind (but a CSV record that an unclosed quote runs over
several lines raises in every mode: skipping it would drop all of those lines as
one row). A missing or mistyped column, and Parquet files whose column types
disagree, raise `DataFormatError` naming the file(s).

CSV files are read with a header line, RFC 4180 quoting (a quoted field may
hold the delimiter, not a line break: such a record is a bad row,
`BadRowKind.LINE_BREAK`) and UTF-8 text; `.csv.gz` / `.csv.bz2`
are decompressed on the fly. A line whose fields are all empty (a blank line)
is no row, as in every reader of this package.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import csv
import dataclasses
import enum
import glob
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from gem_jax.data.ingest.schema import EventSchema
from gem_jax.data.rows import BadRowError, BadRowKind, DataFormatError, OnBadRow

T = TypeVar("T")
CSV_SUFFIXES = (".csv", ".tsv", ".txt", ".csv.gz", ".tsv.gz", ".csv.bz2", ".tsv.bz2")
PARQUET_SUFFIXES = (".parquet", ".pq")
_INTEGER = r"^\s*[-+]?[0-9]+\s*$"
_NUMBER = r"^\s*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?\s*$"
_ISO_TIME = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}([T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)?)?(Z|[+-][0-9]{2}:?[0-9]{2})?$"
_ISO_ZONE = r"(Z|[+-][0-9]{2}:?[0-9]{2})$"  # a UTC offset: the time is converted to UTC
_TRUE_FALSE = {"true": 1.0, "false": 0.0, "True": 1.0, "False": 0.0, "TRUE": 1.0, "FALSE": 0.0}  # as Python, JSON and spreadsheets write them


class Format(enum.Enum):
    """An input file's format, from its suffix or the `--format` option."""

    CSV = "csv"
    PARQUET = "parquet"


class ColumnKind(enum.Enum):
    """How a column is parsed (`stream_rows`)."""

    ID = "id"  # non-empty string (integers become their decimal text)
    TIME = "time"  # int64: integers as given, ISO 8601 (UTC or with an offset) / Parquet timestamps as Unix seconds, fractions floored
    NUMBER = "number"  # float64, finite
    WEIGHT = "weight"  # float64, finite, >= 0
    BINARY = "binary"  # float64, 0 or 1 (also true / false)
    CATEGORY = "category"  # string; empty or null = absent
    MULTI_CATEGORY = "multi_category"  # list<string> split at the separator; empty = no values


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input file and how to read it."""

    path: Path
    format: Format
    delimiter: str = ","

    def __str__(self) -> str:
        return str(self.path)


def _format_of(path: Path) -> Format | None:
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return Format.PARQUET
    if name.endswith(CSV_SUFFIXES):
        return Format.CSV
    return None


def expand_inputs(specs: Sequence[str | os.PathLike], delimiter: str = ",") -> tuple[InputFile, ...]:
    """The input files named by `specs`: files, directories (their CSV/TSV/Parquet files) or globs.

    Files are sorted by path within each spec and kept once. A `.tsv` file is
    read with a tab unless `delimiter` is set to something other than `,`.

    Raises:
      DataFormatError: a spec matches nothing, or names a file of unknown type.
    """
    files: dict[Path, InputFile] = {}
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and _format_of(p) is not None)
            if not found:
                raise DataFormatError(f"{path}: no CSV/TSV ({', '.join(CSV_SUFFIXES)}) or Parquet ({', '.join(PARQUET_SUFFIXES)}) files in this directory")
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(str(spec)) if Path(p).is_file())
            if not found:
                raise DataFormatError(f"{spec}: no such file or directory, and no file matches it as a glob")
        for p in found:
            fmt = _format_of(p)
            if fmt is None:
                raise DataFormatError(f"{p}: unknown file type; expected one of {', '.join(CSV_SUFFIXES + PARQUET_SUFFIXES)}")
            sep = "\t" if delimiter == "," and p.name.lower().split(".")[1:2] == ["tsv"] else delimiter
            files.setdefault(p.resolve(), InputFile(p, fmt, sep))
    return tuple(files.values())


class BadRows:
    """Applies an `OnBadRow` policy to whole batches and counts what it skips.

    `counts()` are the skipped rows by (file, kind) with the first location and
    column, the record the manifest and the summaries carry. Under `OnBadRow.RAISE`
    the checks of one batch run inside `in_file_order`, so that the bad row that
    raises is the batch's first in the file, whichever check found it.
    """

    def __init__(self, on_bad_row: OnBadRow):
        if not isinstance(on_bad_row, OnBadRow):
            raise TypeError(f"on_bad_row must be an OnBadRow, got {on_bad_row!r}")
        self.on_bad_row = on_bad_row
        self._counts: dict[tuple[str, BadRowKind], list] = {}
        self._first: list | None = None  # inside `in_file_order`: [] or [number, BadRowError] of the first bad row reported
        self._numbers: np.ndarray | None = None  # inside `in_file_order`: the line or row numbers of the batch's rows

    @contextlib.contextmanager
    def in_file_order(self) -> Iterator[None]:
        """Under `OnBadRow.RAISE`, the bad rows reported inside are held, not raised, and on leaving the one of
        the smallest line (CSV) or row number (Parquet) raises: checks that each find their first bad row (a
        column, a kind of defect, the parser's wrong field counts) raise the first of the file between them,
        at the cost of finishing the batch's checks. The rows are numbered by `one`'s `number`, or by `row`
        (also `many`'s rows), an index into the numbers `number_rows` gives; a bad row given neither raises at
        once. An exception raised inside gives way to a bad row held before it. Under `OnBadRow.SKIP`, nothing changes.

        Raises:
          BadRowError: the first bad row reported inside, under `OnBadRow.RAISE`.
        """
        if self.on_bad_row is not OnBadRow.RAISE or self._first is not None:
            yield
            return
        self._first, self._numbers = [], None
        try:
            yield
        except Exception:
            if self._first:
                raise self._first[1] from None
            raise
        else:
            if self._first:
                raise self._first[1]
        finally:
            self._first = self._numbers = None

    def number_rows(self, numbers: np.ndarray) -> None:
        """int64 `numbers` `[rows]`: the line (CSV) or row number (Parquet) of each row of the batch whose checks
        run inside `in_file_order`, indexed by `one`'s `row` and `many`'s rows."""
        if self._first is not None:
            self._numbers = numbers

    def report(self, error: BadRowError, number: int | None = None) -> None:
        """Raises `error`, a bad row under `OnBadRow.RAISE`; inside `in_file_order` holds it instead where it is the
        first so far (`number`: its line or row number in its file; None raises at once)."""
        if self._first is None or number is None:
            raise error
        if not self._first or number < self._first[0]:
            self._first[:] = [number, error]

    def one(self, path: str, location: str, kind: BadRowKind, detail: str, *, row: int | None = None, number: int | None = None) -> None:
        """Reports one bad row. Raises `BadRowError` under `OnBadRow.RAISE` (`in_file_order`: held, ordered by
        `number`, its line or row number, or by row `row` of `number_rows`)."""
        if self.on_bad_row is OnBadRow.RAISE:
            if number is None and row is not None and self._numbers is not None:
                number = int(self._numbers[row])
            self.report(BadRowError(path, location, kind, detail), number)
            return
        entry = self._counts.setdefault((path, kind), [0, f"{location}: {detail}"])
        entry[0] += 1

    def many(self, path: str, mask: np.ndarray, locate: Callable[[int], str], kind: BadRowKind, detail: Callable[[int], str]) -> None:
        """Reports the rows where bool `mask` is set (row i at `locate(i)`, described by `detail(i)`)."""
        rows = np.flatnonzero(mask)
        if rows.size == 0:
            return
        first = int(rows[0])
        self.one(path, locate(first), kind, detail(first), row=first)
        if self.on_bad_row is OnBadRow.SKIP:
            self._counts[(path, kind)][0] += rows.size - 1

    @property
    def total(self) -> int:
        return sum(count for count, _ in self._counts.values())

    def counts(self) -> list[dict]:
        """`[{"file", "kind", "count", "first"}]`, in the order first met."""
        return [{"file": path, "kind": kind.value, "count": count, "first": first} for (path, kind), (count, first) in self._counts.items()]


def _csv_line(skipped_lines: list[int], k: int) -> int:
    """Line of the k-th (0-based) row the parser accepted: the header is line 1, rows follow, past
    `skipped_lines` (sorted: lines the parser rejected, and the continuation lines of rows whose
    quoted fields hold line breaks)."""
    return int(_csv_lines(skipped_lines, np.asarray(k)))


def _csv_lines(skipped_lines: list[int], k: np.ndarray) -> np.ndarray:
    """int64 lines of the rows `k` (int64, 0-based among the rows the parser accepted; `_csv_line`)."""
    adjusted = np.asarray(skipped_lines, dtype=np.int64) - np.arange(len(skipped_lines)) - 2
    return k + 2 + np.searchsorted(adjusted, k, side="right")


def _line_breaks(path: str, batch: pa.RecordBatch, skipped_lines: list[int], rows_before: int, bad: BadRows) -> np.ndarray:
    """bool `[rows]`: the batch's rows whose quoted fields hold a line break (pyarrow takes them
    within a block). Each is reported as a bad row at its first line, and its continuation lines
    join `skipped_lines` so that the rows after it keep their true line numbers."""
    newlines = np.zeros(batch.num_rows, dtype=np.int64)
    returns = np.zeros(batch.num_rows, dtype=bool)
    for column in batch.columns:
        newlines += pc.count_substring(column, "\n").to_numpy(zero_copy_only=False)
        returns |= pc.match_substring(column, "\r").to_numpy(zero_copy_only=False)
    broken = (newlines > 0) | returns
    for i in np.flatnonzero(broken).tolist():
        line = _csv_line(skipped_lines, rows_before + i)
        for extra in range(1, int(newlines[i]) + 1):
            bisect.insort(skipped_lines, line + extra)
        fields = [batch.column(c)[i].as_py()[:60] for c in range(batch.num_columns)]
        lines = f"lines {line}-{line + int(newlines[i])}" if newlines[i] else f"line {line}"
        bad.one(path, f"line {line}", BadRowKind.LINE_BREAK, f"a quoted field holds a line break ({lines}); a record is one line: {fields!r}", number=line)
    return broken


def _csv_batches(file: InputFile, columns: Sequence[str], bad: BadRows, block_size: int) -> Iterator[tuple[pa.RecordBatch, Callable[[int], str], np.ndarray]]:
    """`(batch, locate, lines)`: the rows of `columns`, `locate(i)` naming row i's line, int64 `lines` `[rows]` their numbers.

    A record the parser refuses (a wrong field count, a quote left open) is, under `OnBadRow.RAISE`, held until
    the rows before it have come out, then reported with the first batch past it (`BadRows.report`, inside the
    caller's `BadRows.in_file_order`) or raised at the end of the file: a bad value on an earlier line raises first.
    """
    skipped_lines: list[int] = []
    pending: list[tuple[int, BadRowError]] = []  # the parser's first refused record (line, error), raised from here, not through pyarrow

    def on_invalid(row) -> str:
        lines = row.text.count("\n") + 1
        skipped_lines.extend(range(row.number, row.number + lines))
        if row.actual_columns == 1 and not row.text.strip():
            return "skip"
        if row.text.count('"') % 2:
            span = f"lines {row.number}-{row.number + lines - 1}" if lines > 1 else "one line"
            kind, detail = BadRowKind.QUOTING, f"the record runs over {span}: {row.text[:200]!r}"
        else:
            kind, detail = BadRowKind.FIELD_COUNT, f"{row.actual_columns} fields, the header has {row.expected_columns}: {row.text[:200]!r}"
        if lines > 1:
            # A quote opened and never closed on its line swallows the lines after it into one malformed record:
            # skipping it would drop them all, counted as one row, so this is refused in every --on-bad-row mode.
            detail = (
                f"{detail}; a quote that is not closed on its line (the record runs over {lines} lines) would drop all "
                f"{lines} lines as one bad row even with --on-bad-row skip: close or remove the quote"
            )
            if bad.on_bad_row is OnBadRow.SKIP:
                pending.append((row.number, BadRowError(str(file), f"line {row.number}", kind, detail)))
                return "error"
        if bad.on_bad_row is OnBadRow.RAISE:
            # Parsed past (its lines kept out of the rows), and held until the rows before it are checked.
            if not pending:
                pending.append((row.number, BadRowError(str(file), f"line {row.number}", kind, detail)))
            return "skip"
        bad.one(str(file), f"line {row.number}", kind, detail)
        return "skip"

    header = _csv_header(file)  # holds `columns` (`require_columns`)
    try:
        # Every column is read (as bytes, not converted) so that a blank line is told from a row
        # whose read columns are empty; only `columns` are parsed.
        reader = pa_csv.open_csv(
            pa.input_stream(str(file.path), compression="detect"),
            read_options=pa_csv.ReadOptions(block_size=block_size, use_threads=False),
            parse_options=pa_csv.ParseOptions(delimiter=file.delimiter, invalid_row_handler=on_invalid, ignore_empty_lines=False),
            convert_options=pa_csv.ConvertOptions(column_types={c: pa.binary() for c in header}, strings_can_be_null=False),
        )
    except pa.ArrowInvalid as error:
        if pending:
            raise pending[0][1] from None
        raise DataFormatError(f"{file}: not a readable CSV file ({error})") from error
    rows_before = 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            if pending:  # every row before it was checked
                raise pending[0][1] from None
            return
        except pa.ArrowInvalid as error:
            if pending:
                raise pending[0][1] from None
            raise DataFormatError(f"{file}: unreadable CSV after line {rows_before + 1 + len(skipped_lines)} ({error})") from error
        # A blank line comes through as a row with every column empty: it is no row.
        blank = pc.equal(pc.binary_length(batch.column(0)), 0).to_numpy(zero_copy_only=False)
        if blank.any():
            for column in batch.columns[1:]:
                blank &= pc.equal(pc.binary_length(column), 0).to_numpy(zero_copy_only=False)
        blank |= _line_breaks(str(file), batch, skipped_lines, rows_before, bad)  # reported, then left out like blank lines
        lines = _csv_lines(skipped_lines, np.arange(rows_before, rows_before + batch.num_rows, dtype=np.int64))
        rows_before += batch.num_rows
        if pending and lines.size and lines[-1] > pending[0][0]:  # the rows before it are in this batch or were checked
            bad.report(pending[0][1], pending[0][0])
            pending.clear()
        batch = batch.select(list(columns))
        if blank.any():
            batch = batch.filter(pa.array(~blank))
            lines = lines[~blank]
        yield batch, (lambda i, lines=lines: f"line {int(lines[i])}"), lines


def _csv_header(file: InputFile) -> list[str]:
    """The column names of a CSV file's header line.

    Raises:
      DataFormatError: the file is empty, its header is not UTF-8 or names a column twice.
    """
    with pa.input_stream(str(file.path), compression="detect") as stream:
        head = stream.read(1 << 20)
    try:
        # "utf-8-sig": a byte order mark (as spreadsheet exports write) is no part of the first name; pyarrow's reader drops it too.
        first = head.split(b"\n")[0].rstrip(b"\r").decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataFormatError(f"{file}: the header line is not UTF-8 text") from None
    header = next(csv.reader([first], delimiter=file.delimiter), [])
    if not header or header == [""]:
        raise DataFormatError(f"{file}: no header line (the first line names the columns)")
    if len(set(header)) != len(header):
        raise DataFormatError(f"{file}: the header names a column twice: {header}")
    return header


def _parquet_batches(file: InputFile, columns: Sequence[str], batch_size: int) -> Iterator[tuple[pa.RecordBatch, Callable[[int], str], np.ndarray]]:
    """`(batch, locate, rows)`: `locate(i)` names row i's row group and row, int64 `rows` `[rows]` count from the file's first row."""
    try:
        parquet = pq.ParquetFile(str(file.path))
    except (pa.ArrowInvalid, OSError) as error:
        raise DataFormatError(f"{file}: not a readable Parquet file ({error})") from error
    before = 0  # rows of the file before this batch
    for group in range(parquet.num_row_groups):
        start = 0
        for batch in parquet.iter_batches(batch_size=batch_size, row_groups=[group], columns=list(columns)):
            yield batch, (lambda i, g=group, s=start: f"row group {g}, row {s + i}"), np.arange(before, before + batch.num_rows, dtype=np.int64)
            start += batch.num_rows
            before += batch.num_rows


def row_location(file: InputFile, number: int) -> str:
    """Where a row of `stream_rows` is: "line N" of a CSV file, "row group G, row R" of a Parquet
    file (both 0-based, as bad rows are named), from its `number` there."""
    if file.format is Format.CSV:
        return f"line {number}"
    metadata = pq.ParquetFile(str(file.path)).metadata
    starts = np.cumsum([0] + [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
    group = int(np.searchsorted(starts, number, side="right")) - 1
    return f"row group {group}, row {number - int(starts[group])}"


def require_columns(files: Sequence[InputFile], columns: Sequence[str]) -> None:
    """Checks, from headers and Parquet schemas only, that every file has `columns` (before a long read).

    Raises:
      DataFormatError: the first file missing a column, naming the columns it has.
    """
    for file in files:
        if file.format is Format.CSV:
            present = _csv_header(file)
        else:
            try:
                present = pq.read_schema(str(file.path)).names
            except (pa.ArrowInvalid, OSError) as error:
                raise DataFormatError(f"{file}: not a readable Parquet file ({error})") from error
        missing = [c for c in columns if c not in present]
        if missing:
            hint = _delimiter_hint(file, present) if file.format is Format.CSV else ""
            raise DataFormatError(f"{file}: missing column(s) {missing}; the {'header' if file.format is Format.CSV else 'file'} has {present}{hint}")


# Delimiters a header read as one column may hold instead: how each is named to --delimiter.
_OTHER_DELIMITERS = {"\t": "'\\t' (a tab)", ";": "';'", ",": "','"}


def _delimiter_hint(file: InputFile, header: Sequence[str]) -> str:
    """A hint naming `--delimiter` when a CSV header read as one column holds another delimiter, else ""."""
    if len(header) != 1:
        return ""
    found = [d for d in _OTHER_DELIMITERS if d != file.delimiter and d in header[0]]
    if not found:
        return ""
    return (
        f"; the header reads as one column split at {file.delimiter!r} but holds {_OTHER_DELIMITERS[found[0]]}: "
        f"if the file is separated by it, pass --delimiter {_OTHER_DELIMITERS[found[0]].split(' ')[0]}"
    )


def parquet_column_types(file: InputFile, columns: Sequence[str]) -> dict[str, str]:
    """The Arrow type (as text) of each of `columns` in a Parquet file."""
    schema = pq.read_schema(str(file.path))
    return {c: str(schema.field(c).type) for c in columns if c in schema.names}


def check_parquet_types(files: Sequence[InputFile], columns: Sequence[str]) -> None:
    """Parquet files must agree on the types of the columns read.

    Raises:
      DataFormatError: naming two files that disagree, the column and both types.
    """
    first: dict[str, tuple[InputFile, str]] = {}
    for file in files:
        if file.format is not Format.PARQUET:
            continue
        for column, kind in parquet_column_types(file, columns).items():
            seen = first.setdefault(column, (file, kind))
            if seen[1] != kind:
                raise DataFormatError(f"files disagree on column {column!r}: {seen[0]} has type {seen[1]}, {file} has type {kind}")


def _to_text(path: str, column: str, values: pa.Array, locate, bad: BadRows, rejected: np.ndarray, rows: np.ndarray | None = None) -> pa.Array:
    """`values` as a string array (binary CSV fields checked as UTF-8; integers as decimal text); int `rows`: the
    batch row of each value (a flattened list column's), None where value i is row i."""
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return values
    if pa.types.is_integer(values.type):
        return pc.cast(values, pa.string())
    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        try:
            return values.cast(pa.string())
        except pa.ArrowInvalid:
            texts = values.to_pylist()
            valid = np.ones(len(texts), dtype=bool)
            reported: set[int] = set()  # batch rows named already (a list row may hold several bad values)
            for i, raw in enumerate(texts):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    valid[i] = False
                    row = i if rows is None else int(rows[i])
                    if not rejected[i] and row not in reported:
                        reported.add(row)
                        bad.one(path, f"{locate(i)}, column {column!r}", BadRowKind.ENCODING, f"byte {raw[error.start]:#04x} at byte {error.start + 1} is not valid UTF-8",
                                row=row)
            rejected |= ~valid
            return pa.array([raw.decode("utf-8") if ok else "" for raw, ok in zip(texts, valid)], pa.string())
    raise DataFormatError(f"{path}: column {column!r} has type {values.type}; expected text or integers")


def _text_values(values: pa.Array) -> Callable[[int], str]:
    return lambda i: repr(values[i].as_py())


def _parse_id(path, column, values, locate, bad, rejected) -> pa.Array:
    text = _to_text(path, column, values, locate, bad, rejected)
    empty = pc.fill_null(pc.equal(pc.utf8_length(text), 0), True).to_numpy(zero_copy_only=False) & ~rejected
    bad.many(path, empty, lambda i: f"{locate(i)}, column {column!r}", BadRowKind.BAD_VALUE, lambda i: "empty id")
    rejected |= empty
    return text


def _parse_number(path, column, values, locate, bad, rejected) -> np.ndarray:
    where = lambda i: f"{locate(i)}, column {column!r}"  # noqa: E731
    if pa.types.is_boolean(values.type) or pa.types.is_integer(values.type) or pa.types.is_floating(values.type):
        null = values.is_null().to_numpy(zero_copy_only=False) & ~rejected
        bad.many(path, null, where, BadRowKind.BAD_VALUE, lambda i: "missing value")
        rejected |= null
        numbers = pc.cast(values, pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        infinite = ~np.isfinite(numbers) & ~rejected
        bad.many(path, infinite, where, BadRowKind.OUT_OF_RANGE, lambda i: f"{float(numbers[i])!r} is not a finite number")
        rejected |= infinite
        return np.where(rejected, 0.0, numbers)
    text = _to_text(path, column, values, locate, bad, rejected)
    fast = _strict_cast(text, pa.float64())
    if fast is not None:
        numbers = fast
        infinite = ~np.isfinite(numbers) & ~rejected
        bad.many(path, infinite, where, BadRowKind.OUT_OF_RANGE, lambda i: f"{text[i].as_py()!r} is not a finite float64")
        rejected |= infinite
        return np.where(rejected, 0.0, numbers)
    # Slow path, only for a batch that needs it: trim, true/false, find the bad values.
    text = pc.utf8_trim_whitespace(text)
    for word, value in _TRUE_FALSE.items():
        text = pc.if_else(pc.equal(text, word), str(value), text)
    numeric = pc.fill_null(pc.match_substring_regex(text, _NUMBER), False).to_numpy(zero_copy_only=False)
    show = _text_values(text)
    bad.many(path, ~numeric & ~rejected, lambda i: f"{locate(i)}, column {column!r}", BadRowKind.NOT_A_NUMBER, lambda i: f"{show(i)} is not a number")
    rejected |= ~numeric
    numbers = pc.cast(pc.if_else(pa.array(numeric), text, "0"), pa.float64()).to_numpy(zero_copy_only=False)
    infinite = ~np.isfinite(numbers) & ~rejected
    bad.many(path, infinite, lambda i: f"{locate(i)}, column {column!r}", BadRowKind.OUT_OF_RANGE, lambda i: f"{show(i)} is not a finite float64")
    rejected |= infinite
    return np.where(rejected, 0.0, numbers)


def _strict_cast(text: pa.Array, to: pa.DataType) -> np.ndarray | None:
    """`text` cast to `to` as numpy when every value is present and parses; None otherwise
    (then the caller's checks find the bad values)."""
    if text.null_count:
        return None
    try:
        return pc.cast(text, to).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def _check_binary(path, column, numbers: np.ndarray, locate, bad, rejected) -> None:
    other = (numbers != 0) & (numbers != 1) & ~rejected
    bad.many(path, other, lambda i: f"{locate(i)}, column {column!r}", BadRowKind.BAD_VALUE, lambda i: f"{numbers[i]:g} is not 0 or 1 (a 0/1 label; use a rule such as {column}>=1 for other values)")
    rejected |= other


def _whole_seconds(stamps: pa.Array) -> pa.Array:
    """int64 Unix seconds of a timestamp array of any unit, fractions of a second floored (nulls kept)."""
    per_second = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[stamps.type.unit]
    ticks = pc.cast(stamps, pa.int64())
    floored = pc.fill_null(ticks, 0).to_numpy(zero_copy_only=False) // per_second  # exact integer floor, also before 1970
    return pa.array(floored, mask=np.asarray(ticks.is_null())) if ticks.null_count else pa.array(floored)


def _check_weight(path, column, weights: np.ndarray, locate, bad, rejected) -> None:
    """Reports weights that are negative, or that float32 (the stored dtype) turns into inf or 0."""
    where = lambda i: f"{locate(i)}, column {column!r}"  # noqa: E731
    negative = (weights < 0) & ~rejected
    bad.many(path, negative, where, BadRowKind.OUT_OF_RANGE, lambda i: f"weight {weights[i]:g} is negative")
    rejected |= negative
    with np.errstate(over="ignore"):
        stored = weights.astype(np.float32)
    lost = ((stored == np.inf) | ((stored == 0) & (weights > 0))) & ~rejected
    bad.many(path, lost, where, BadRowKind.OUT_OF_RANGE,
             lambda i: f"weight {weights[i]:g} is outside float32's range (weights are stored as float32: it would become {float(stored[i]):g})")
    rejected |= lost


# Times are int64 in the file's own unit; within +-2^62 the difference of any two fits int64 (ages, spans, quantiles).
_TIME_LIMIT = 2**62


def _parse_time(path, column, values, locate, bad, rejected) -> np.ndarray:
    """int64 times of a column (its own unit; ISO 8601 and Arrow timestamps as seconds), |t| < `_TIME_LIMIT`."""
    times = _parse_time_values(path, column, values, locate, bad, rejected)
    far = ((times >= _TIME_LIMIT) | (times <= -_TIME_LIMIT)) & ~rejected
    bad.many(path, far, lambda i: f"{locate(i)}, column {column!r}", BadRowKind.OUT_OF_RANGE,
             lambda i: f"time {int(times[i])} is outside +-2^62 (the range in which differences of times fit int64)")
    rejected |= far
    return times


def _parse_time_values(path, column, values, locate, bad, rejected) -> np.ndarray:
    where = lambda i: f"{locate(i)}, column {column!r}"  # noqa: E731
    if pa.types.is_timestamp(values.type) or pa.types.is_date(values.type):
        stamps = values if pa.types.is_timestamp(values.type) else pc.cast(values, pa.timestamp("s"))
        seconds = _whole_seconds(stamps)
        missing = np.asarray(seconds.is_null()) & ~rejected
        bad.many(path, missing, where, BadRowKind.BAD_VALUE, lambda i: "missing time")
        rejected |= missing
        return pc.fill_null(seconds, 0).to_numpy(zero_copy_only=False)
    if pa.types.is_integer(values.type):
        missing = np.asarray(values.is_null()) & ~rejected
        bad.many(path, missing, where, BadRowKind.BAD_VALUE, lambda i: "missing time")
        rejected |= missing
        if values.type == pa.uint64():
            huge = pc.fill_null(pc.greater(values, pa.scalar(2**63 - 1, pa.uint64())), False).to_numpy(zero_copy_only=False) & ~rejected
            bad.many(path, huge, where, BadRowKind.OUT_OF_RANGE, lambda i: f"{values[i].as_py()} does not fit in int64")
            rejected |= huge
            values = pc.if_else(pa.array(huge), pa.scalar(0, pa.uint64()), values)
        return pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy(zero_copy_only=False)
    text = _to_text(path, column, values, locate, bad, rejected)
    fast = _strict_cast(text, pa.int64())
    if fast is not None:
        return fast
    text = pc.utf8_trim_whitespace(text)
    integer = pc.fill_null(pc.match_substring_regex(text, _INTEGER), False).to_numpy(zero_copy_only=False)
    iso = pc.fill_null(pc.match_substring_regex(text, _ISO_TIME), False).to_numpy(zero_copy_only=False)
    show = _text_values(text)
    unknown = ~(integer | iso) & ~rejected
    bad.many(path, unknown, where, BadRowKind.BAD_VALUE, lambda i: f"{show(i)} is neither an integer nor an ISO 8601 date/time")
    rejected |= unknown
    out = np.zeros(len(text), dtype=np.int64)
    if integer.any():
        digits = pc.filter(text, pa.array(integer))
        try:
            out[integer] = pc.cast(digits, pa.int64()).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:
            rows = np.flatnonzero(integer)
            big = np.array([not -(2**63) <= int(v) < 2**63 for v in digits.to_pylist()])
            bad.many(path, np.isin(np.arange(len(text)), rows[big]) & ~rejected, where, BadRowKind.OUT_OF_RANGE, lambda i: f"{show(i)} does not fit in int64")
            rejected[rows[big]] = True
            out[rows[~big]] = pc.cast(pc.filter(digits, pa.array(~big)), pa.int64()).to_numpy(zero_copy_only=False)
    zoned = pc.fill_null(pc.match_substring_regex(text, _ISO_ZONE), False).to_numpy(zero_copy_only=False)
    for rows, kind in ((np.flatnonzero(iso & zoned), pa.timestamp("ns", "UTC")), (np.flatnonzero(iso & ~zoned), pa.timestamp("ns"))):
        if rows.size == 0:
            continue
        stamps = text.take(pa.array(rows))
        try:
            out[rows] = _whole_seconds(pc.cast(stamps, kind)).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:  # e.g. month 13: find the rows one by one (only on this error path)
            for row, stamp in zip(rows, stamps.to_pylist()):
                try:
                    out[row] = _whole_seconds(pa.array([stamp]).cast(kind))[0].as_py()
                except pa.ArrowInvalid:
                    if not rejected[row]:
                        bad.one(path, where(int(row)), BadRowKind.BAD_VALUE, f"{stamp!r} is not a valid date/time", row=int(row))
                    rejected[row] = True
    if (integer & ~rejected).any() and (iso & ~rejected).any():  # two units in one column: neither can be trusted
        first_int, first_iso = int(np.flatnonzero(integer & ~rejected)[0]), int(np.flatnonzero(iso & ~rejected)[0])
        raise DataFormatError(
            f"{path}: column {column!r} mixes integers ({locate(first_int)}: {show(first_int)}, read as Unix seconds) and ISO 8601 "
            f"dates ({locate(first_iso)}: {show(first_iso)}); write one form in the whole column"
        )
    return out


def _parse_category(path, column, values, locate, bad, rejected, multi: bool, separator: str) -> pa.Array:
    if multi and (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
        parent = pc.list_parent_indices(values)
        rows = parent.to_numpy(zero_copy_only=False)
        flat_rejected = rejected[rows]  # a row already refused is not reported again
        flat = _to_text(path, column, pc.list_flatten(values), lambda i: locate(int(rows[i])), bad, flat_rejected, rows=rows)
        rejected[rows[flat_rejected]] = True  # a row with a refused value is left out, as it is counted
        return _lists(flat, parent, len(values))
    text = _to_text(path, column, values, locate, bad, rejected)
    text = pc.if_else(pc.equal(pc.utf8_length(text), 0), pa.scalar(None, pa.string()), text)
    if not multi:
        return text
    parts = pc.split_pattern(pc.fill_null(text, ""), separator)
    return _lists(pc.list_flatten(parts), pc.list_parent_indices(parts), len(text))


def _lists(flat: pa.Array, parent: pa.Array, n: int) -> pa.ListArray:
    """list<string> `[n]` of the non-empty strings `flat`, value j in row `parent[j]` (non-decreasing)."""
    keep = pc.fill_null(pc.greater(pc.utf8_length(flat), 0), False)
    flat, parent = pc.filter(flat, keep), pc.filter(parent, keep).to_numpy(zero_copy_only=False)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(parent, minlength=n), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), flat)


def event_kinds(schema: EventSchema) -> dict[str, ColumnKind]:
    """How each event column is parsed. A column may serve one role, except labels: several rules
    may read one column (read as a number, checked 0/1 when one of them is a plain 0/1 label)."""
    roles = [(schema.user, ColumnKind.ID, "--user"), (schema.item, ColumnKind.ID, "--item"), (schema.time, ColumnKind.TIME, "--time")]
    roles += [(schema.action, ColumnKind.CATEGORY, "--action")] if schema.action else []
    roles += [(schema.weight, ColumnKind.WEIGHT, "--weight")] if schema.weight else []
    roles += [(f.name, ColumnKind.MULTI_CATEGORY if f.multi else ColumnKind.CATEGORY, f"--{f.side.value}-feature") for f in schema.event_features]
    kinds, flags = {}, {}
    for column, kind, flag in roles:
        if column in kinds:
            raise DataFormatError(f"column {column!r} is named by both {flags[column]} and {flag}; a column serves one role")
        kinds[column], flags[column] = kind, flag
    for rule in schema.labels:
        if rule.column in kinds and flags[rule.column] != "--label":
            raise DataFormatError(f"column {rule.column!r} is named by both {flags[rule.column]} and --label")
        binary = rule.op is None or kinds.get(rule.column) is ColumnKind.BINARY
        kinds[rule.column], flags[rule.column] = (ColumnKind.BINARY if binary else ColumnKind.NUMBER), "--label"
    return kinds


def prefetched(items: Iterator[T]) -> Iterator[T]:
    """`items`, with the next one computed in a background thread while the caller uses the current one.

    pyarrow's parsing and compute kernels release the GIL, so reading and
    parsing the next batch overlaps the caller's work on two cores. An
    exception raised while computing an item is raised here, in order.
    """
    end = object()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        upcoming = pool.submit(next, items, end)
        while (item := upcoming.result()) is not end:
            upcoming = pool.submit(next, items, end)
            yield item


def stream_rows(
    files: Sequence[InputFile],
    kinds: dict[str, ColumnKind],
    bad: BadRows,
    *,
    separator: str = "|",
    block_size: int = 16 << 20,
    on_file: Callable[[InputFile], None] | None = None,
) -> Iterator[tuple[InputFile, dict[str, object], np.ndarray]]:
    """Parsed columns of `files`, a record batch at a time, and where each row is in its file.

    Args:
      files: the inputs, read in order.
      kinds: column name -> how to parse it.
      bad: the bad-row policy and tally; rows with a bad value are left out.
      separator: of multi-valued categories.
      block_size: bytes of CSV parsed at once (Parquet: rows per batch = block_size / 64).
      on_file: called with each file before it is read.

    Yields:
      `(file, columns, rows)` with, per column: ID a string array, TIME int64
      `[n]`, NUMBER float64 `[n]`, CATEGORY a string array (null = absent),
      MULTI_CATEGORY a list<string> array; all of the same length n. `rows`
      int64 `[n]`: each row's line (CSV) or its row number from the file's
      first row (Parquet), increasing; `row_location` names it.

    Raises:
      BadRowError: under `OnBadRow.RAISE`, a file's first bad row (the smallest line or row number, whatever
        its defect), before any of its batch's rows are yielded.
      DataFormatError: a missing or mistyped column, Parquet files whose types disagree.
    """
    require_columns(files, list(kinds))
    check_parquet_types(files, list(kinds))
    for file in files:
        if on_file is not None:
            on_file(file)
        path = str(file)
        batches = _csv_batches(file, list(kinds), bad, block_size) if file.format is Format.CSV else _parquet_batches(file, list(kinds), max(1024, block_size // 64))
        while True:
            # Under RAISE each check, and the CSV parser, finds its first bad row: the first of them in the file raises.
            with bad.in_file_order():
                item = next(batches, None)
                if item is None:
                    break
                batch, locate, rows = item
                bad.number_rows(rows)
                parsed, rows = _parse_batch(path, batch, locate, rows, kinds, bad, separator)
            yield file, parsed, rows


def _parse_batch(path: str, batch: pa.RecordBatch, locate, rows: np.ndarray, kinds: dict[str, ColumnKind], bad: BadRows, separator: str) -> tuple[dict[str, object], np.ndarray]:
    """`stream_rows`' parsed columns of one batch and the numbers `rows` of the rows kept (bad ones reported, left out)."""
    rejected = np.zeros(batch.num_rows, dtype=bool)
    parsed: dict[str, object] = {}
    for column, kind in kinds.items():
        values = batch.column(column)
        if kind is ColumnKind.ID:
            parsed[column] = _parse_id(path, column, values, locate, bad, rejected)
        elif kind is ColumnKind.TIME:
            parsed[column] = _parse_time(path, column, values, locate, bad, rejected)
        elif kind in (ColumnKind.NUMBER, ColumnKind.BINARY, ColumnKind.WEIGHT):
            parsed[column] = _parse_number(path, column, values, locate, bad, rejected)
            if kind is ColumnKind.WEIGHT:
                _check_weight(path, column, parsed[column], locate, bad, rejected)
            if kind is ColumnKind.BINARY:
                _check_binary(path, column, parsed[column], locate, bad, rejected)
        else:
            parsed[column] = _parse_category(path, column, values, locate, bad, rejected, kind is ColumnKind.MULTI_CATEGORY, separator)
    if rejected.any():
        keep = ~rejected
        keep_arrow = pa.array(keep)
        parsed = {c: v[keep] if isinstance(v, np.ndarray) else pc.filter(v, keep_arrow) for c, v in parsed.items()}
        rows = rows[keep]
    return parsed, rows
