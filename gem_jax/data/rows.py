"""Malformed input rows: raise with the file and line, or skip and count.

Every reader takes an `OnBadRow` policy and reports each bad row through a
`RowChecker`. Under `OnBadRow.RAISE` (the default) the first bad row raises a
`BadRowError` that names the file, the line (or JSON key) and what is wrong.
Under `OnBadRow.SKIP` the row is left out and counted per file and kind, and
the counts travel with the data (`EventLog.skipped`) so nothing is dropped
silently. Blank lines are not rows and are ignored by every reader.

`text_lines`, `csv_fields` and `int64_field` read files one physical line at a
time, so that a bad byte, an unbalanced quote or a number too large for int64
is reported at its own line and, under SKIP, costs exactly that line.
"""

from __future__ import annotations

import dataclasses
import enum
import csv
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class OnBadRow(enum.Enum):
    """What a reader does with a malformed row."""

    RAISE = "raise"
    SKIP = "skip"


class BadRowKind(enum.Enum):
    """Why a row was rejected."""

    FIELD_COUNT = "wrong number of fields"
    NOT_A_NUMBER = "not a number"
    OUT_OF_RANGE = "value out of range"
    BAD_VALUE = "invalid value"
    UNKNOWN_ID = "unknown id"
    DUPLICATE_ID = "duplicate id"
    ENCODING = "undecodable bytes"
    QUOTING = "unbalanced quote"
    LINE_BREAK = "line break in a quoted field"


class DataFormatError(ValueError):
    """A whole file is unusable (wrong header, bad JSON, no rows); never skipped."""


class BadRowError(ValueError):
    """One malformed row, raised under `OnBadRow.RAISE` (and in every mode for a CSV record that a quote left open
    runs over several lines: skipping it would drop all of them as one row).

    Attributes:
      path: the file.
      location: where in the file, e.g. "line 17" or 'key "123"'.
      kind: a `BadRowKind`.
      detail: what was found and what was expected.
    """

    def __init__(self, path: str, location: str, kind: BadRowKind, detail: str):
        super().__init__(f"{path}, {location}: {kind.value}: {detail}")
        self.path = path
        self.location = location
        self.kind = kind
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class SkippedRows:
    """How many rows of one kind were skipped in one file under `OnBadRow.SKIP`."""

    path: str
    kind: BadRowKind
    count: int
    first_location: str

    def __str__(self) -> str:
        return f"{self.path}: skipped {self.count} row(s), {self.kind.value} (first at {self.first_location})"


class RowChecker:
    """Applies an `OnBadRow` policy to the rows of one file.

    Args:
      path: the file, as it should appear in messages.
      on_bad_row: the policy.
    """

    def __init__(self, path: str | os.PathLike, on_bad_row: OnBadRow):
        if not isinstance(on_bad_row, OnBadRow):
            raise TypeError(f"on_bad_row must be an OnBadRow, got {on_bad_row!r}")
        self.path = str(path)
        self.on_bad_row = on_bad_row
        self._counts: dict[BadRowKind, int] = {}
        self._first: dict[BadRowKind, str] = {}

    def bad(self, location: str | int, kind: BadRowKind, detail: str) -> None:
        """Reports a bad row; `location` is a 1-based line number or a description.

        Raises:
          BadRowError: under `OnBadRow.RAISE`.
        """
        where = f"line {location}" if isinstance(location, int) else location
        if self.on_bad_row is OnBadRow.RAISE:
            raise BadRowError(self.path, where, kind, detail)
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self._first.setdefault(kind, where)

    def parse(self, location: str | int, parse: Callable[[], T], not_a_number: str) -> T | None:
        """`parse()`, or None after reporting the row: OUT_OF_RANGE for an `OverflowError`
        (an int64 field out of range), NOT_A_NUMBER with `not_a_number` for a `ValueError`.

        Raises:
          BadRowError: under `OnBadRow.RAISE`, as `bad`.
        """
        try:
            return parse()
        except OverflowError as error:
            self.bad(location, BadRowKind.OUT_OF_RANGE, str(error))
        except ValueError:
            self.bad(location, BadRowKind.NOT_A_NUMBER, not_a_number)
        return None

    def skipped(self) -> tuple[SkippedRows, ...]:
        """The skipped-row counts of this file, one entry per kind, in `BadRowKind` order."""
        return tuple(
            SkippedRows(self.path, kind, self._counts[kind], self._first[kind]) for kind in BadRowKind if kind in self._counts
        )


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def int64_field(text: str, name: str) -> int:
    """`int(text)` for a field stored as int64.

    Raises:
      ValueError: `text` is not an integer.
      OverflowError: it is one, outside [-2**63, 2**63) (`name` and the value named).
    """
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise OverflowError(f"{name} {text!r} does not fit in a 64-bit integer")
    return value


def text_lines(path: str | os.PathLike, check: RowChecker, encoding: str = "utf-8") -> Iterator[tuple[int, str]]:
    """Yields `(1-based line number, text without the line break)` of a text file.

    A line that does not decode under `encoding` is reported to `check` as
    `BadRowKind.ENCODING` (the byte and its column named) and not yielded.

    Raises:
      BadRowError: an undecodable line under `OnBadRow.RAISE`.
      FileNotFoundError: no such file.
    """
    with open(Path(path), "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode(encoding)
            except UnicodeDecodeError as error:
                check.bad(number, BadRowKind.ENCODING, f"byte {raw[error.start]:#04x} at column {error.start + 1} is not valid {encoding}")
                continue
            yield number, text.rstrip("\r\n")


def csv_fields(text: str) -> list[str]:
    """The fields of one CSV record on one line (RFC 4180 quoting; `[]` for a blank line).

    Raises:
      csv.Error: an unbalanced or misplaced quote.
    """
    return next(csv.reader([text], strict=True), [])
