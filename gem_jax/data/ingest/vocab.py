"""Vocabularies: original string ids <-> embedding rows, built in one counting pass.

Row convention of every vocabulary (ids, actions, feature values):

- row 0 (`PAD_ROW`): padding, and "absent" for an empty feature value;
- row 1 (`OOV_ROW`): out of vocabulary, every id dropped by `min_count` /
  `max_size` and every id unseen when the vocabulary was built;
- rows 2, 3, ...: the kept ids by decreasing count, ties by id (byte order).

`Vocab.save` writes a CSV file a serving team can read with any CSV reader::

    "row","id","count"
    0,"",0
    1,"",17
    2,"item 42",1893
    3,"a ""quoted"", id",1201

with the count of row 1 the number of occurrences mapped to OOV when the
vocabulary was built; ids are quoted (RFC 4180: a quote inside is doubled). `Vocab.load` reads it back (the same rows).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from gem_jax.data.rows import DataFormatError

PAD_ROW = 0
OOV_ROW = 1
FIRST_ID_ROW = 2


class CountAccumulator:
    """Counts the distinct strings of a stream, merged in Arrow.

    Each `add` keeps the batch's `value_counts`; once the partial counts held
    since the last merge outnumber `merge_rows` and the merged rows, they are
    merged with a group-by, so memory stays within a few times the number of
    distinct values, whatever the stream's length, at an amortised linear cost.
    """

    def __init__(self, merge_rows: int = 1 << 18):
        self._parts: list[pa.Table] = []
        self._held = 0  # rows added since the last merge
        self._merged = 0  # rows of the merged table
        self._merge_rows = merge_rows
        self.total = 0  # non-null values added

    def add(self, values: pa.Array) -> None:
        """Counts the non-null strings of `values` (a string array, or list<string>: its values)."""
        if pa.types.is_list(values.type):
            values = pc.list_flatten(values)
        counts = pc.value_counts(values.drop_null())
        self.add_counted(counts.field("values"), counts.field("counts"))

    def add_counted(self, values: pa.Array, counts) -> None:
        """Adds distinct non-null strings `values` `[k]` seen `counts` (int `[k]`) times each."""
        part = pa.table({"id": values, "count": pc.cast(pa.array(counts), pa.int64())})
        self.total += int(pc.sum(part["count"]).as_py() or 0)
        self._parts.append(part)
        self._held += part.num_rows
        if self._held > max(self._merge_rows, self._merged):
            self._merge()

    def _merge(self) -> None:
        if len(self._parts) > 1:
            merged = pa.concat_tables(self._parts).group_by("id").aggregate([("count", "sum")])
            self._parts = [merged.rename_columns(["id", "count"]).combine_chunks()]
        self._merged = self._parts[0].num_rows if self._parts else 0
        self._held = 0

    def table(self) -> pa.Table:
        """`id` (string), `count` (int64): one row per distinct value, in no particular order."""
        self._merge()
        return self._parts[0] if self._parts else pa.table({"id": pa.array([], pa.string()), "count": pa.array([], pa.int64())})


@dataclasses.dataclass(frozen=True, eq=False)
class Vocab:
    """The kept ids of one vocabulary, row `FIRST_ID_ROW + k` for `ids[k]`.

    Attributes:
      name: e.g. `user`, `item`, `action`, `item_feature.category`.
      ids: string array `[n]`, the kept ids in row order.
      counts: int64 `[n]`, their occurrences when the vocabulary was built.
      oov_count: occurrences mapped to `OOV_ROW` when it was built.
      dropped: distinct ids left out by `min_count` / `max_size`.
    """

    name: str
    ids: pa.Array
    counts: np.ndarray
    oov_count: int = 0
    dropped: int = 0

    @property
    def num_rows(self) -> int:
        """Embedding rows the vocabulary needs: padding, OOV and the kept ids."""
        return len(self.ids) + FIRST_ID_ROW

    @classmethod
    def build(cls, name: str, counts: pa.Table, min_count: int = 1, max_size: int | None = None) -> Vocab:
        """The vocabulary of counted ids (`CountAccumulator.table()`).

        Args:
          min_count: ids seen fewer times go to OOV (>= 1).
          max_size: at most this many ids are kept (the most frequent), or None.

        Raises:
          ValueError: `min_count < 1` or `max_size < 1`.
        """
        if min_count < 1 or (max_size is not None and max_size < 1):
            raise ValueError(f"vocabulary {name}: min_count and max_size must be >= 1, got {min_count}, {max_size}")
        ranked = counts.sort_by([("count", "descending"), ("id", "ascending")])
        kept = ranked.filter(pc.greater_equal(ranked["count"], min_count))
        if max_size is not None:
            kept = kept.slice(0, max_size)
        total = int(pc.sum(counts["count"]).as_py() or 0)
        kept_counts = kept["count"].to_numpy()
        return cls(
            name=name,
            ids=kept["id"].combine_chunks() if kept.num_rows else pa.array([], pa.string()),
            counts=kept_counts.astype(np.int64),
            oov_count=total - int(kept_counts.sum()),
            dropped=counts.num_rows - kept.num_rows,
        )

    def lookup(self, values: pa.Array) -> np.ndarray:
        """int32 rows of string `values` `[n]`: nulls -> `PAD_ROW`, unknown ids -> `OOV_ROW`."""
        index = pc.fill_null(pc.index_in(values, value_set=self.ids), OOV_ROW - FIRST_ID_ROW)
        rows = index.to_numpy(zero_copy_only=False).astype(np.int32) + FIRST_ID_ROW
        rows[values.is_null().to_numpy(zero_copy_only=False)] = PAD_ROW
        return rows

    def lookup_among(self, values: pa.Array, candidates: np.ndarray) -> np.ndarray:
        """`lookup` of non-null string `values` `[n]` that can only be the kept ids
        `ids[candidates]` (int64 `[k]`) or unknown: int32 rows, unknown -> `OOV_ROW`. Its hash
        table holds k ids instead of all (e.g. the users of one bucket of a conversion)."""
        index = pc.fill_null(pc.index_in(values, value_set=self.ids.take(pa.array(candidates))), -1).to_numpy(zero_copy_only=False)
        return np.where(index >= 0, candidates[np.maximum(index, 0)] + FIRST_ID_ROW, OOV_ROW).astype(np.int32)

    def save(self, path: Path) -> None:
        """Writes the `row,id,count` CSV file of the module docstring."""
        table = pa.table({
            "row": pa.array(np.arange(self.num_rows, dtype=np.int64)),
            "id": pa.concat_arrays([pa.array(["", ""], pa.string()), self.ids.cast(pa.string())]),
            "count": pa.array(np.concatenate([[0, self.oov_count], self.counts]).astype(np.int64)),
        })
        pa_csv.write_csv(table, str(path), pa_csv.WriteOptions(quoting_style="needed"))

    @classmethod
    def load(cls, name: str, path: Path) -> Vocab:
        """Reads a file written by `save`.

        Raises:
          DataFormatError: the file is not such a file (named).
        """
        try:
            table = pa_csv.read_csv(str(path), convert_options=pa_csv.ConvertOptions(column_types={"row": pa.int64(), "id": pa.string(), "count": pa.int64()}, strings_can_be_null=False))
        except (pa.ArrowInvalid, FileNotFoundError) as error:
            raise DataFormatError(f"{path}: not a vocabulary file ({error})") from error
        rows = table["row"].to_numpy()
        if table.column_names != ["row", "id", "count"] or not np.array_equal(rows, np.arange(len(rows))) or len(rows) < FIRST_ID_ROW:
            raise DataFormatError(f"{path}: a vocabulary file has columns row,id,count with rows 0, 1, 2, ... (0 padding, 1 OOV)")
        counts = table["count"].to_numpy()
        return cls(name, table["id"].combine_chunks().slice(FIRST_ID_ROW), counts[FIRST_ID_ROW:].astype(np.int64), int(counts[OOV_ROW]))
