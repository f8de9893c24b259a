"""Vocabularies (min count, max size, OOV, the id mapping file) and splits (exact time quantile, last N)."""

import numpy as np
import pyarrow as pa
import pytest

from gem_jax.data.ingest import split as split_lib
from gem_jax.data.ingest.split import SplitKind, SplitRule, eval_flags, time_quantile
from gem_jax.data.ingest.vocab import OOV_ROW, PAD_ROW, CountAccumulator, Vocab
from gem_jax.data.rows import DataFormatError


def _counts(*batches, merge_rows=1 << 21):
    counter = CountAccumulator(merge_rows=merge_rows)
    for batch in batches:
        counter.add(pa.array(batch, pa.string()))
    return counter


def test_counts_merge_across_batches():
    counter = _counts(["a", "b", "a", None], ["b", "c", "a"], ["a"], merge_rows=2)
    table = counter.table().sort_by("id")
    assert table.to_pydict() == {"id": ["a", "b", "c"], "count": [4, 2, 1]}
    assert counter.total == 7


def test_min_count_max_size_and_oov():
    counts = _counts(["x"] * 5 + ["y"] * 3 + ["z"] * 3 + ["w"]).table()
    vocab = Vocab.build("item", counts, min_count=2)
    assert vocab.ids.to_pylist() == ["x", "y", "z"]  # by count, ties by id
    assert (vocab.oov_count, vocab.dropped, vocab.num_rows) == (1, 1, 5)
    top = Vocab.build("item", counts, max_size=2)
    assert top.ids.to_pylist() == ["x", "y"] and top.oov_count == 4 and top.dropped == 2
    rows = top.lookup(pa.array(["y", "x", "z", "never", None]))
    assert rows.tolist() == [3, 2, OOV_ROW, OOV_ROW, PAD_ROW]
    with pytest.raises(ValueError, match="min_count and max_size must be >= 1"):
        Vocab.build("item", counts, min_count=0)


def test_lookup_among_a_subset_of_the_kept_ids_is_lookup():
    rng = np.random.default_rng(3)
    ids = [f"id{k}" for k in range(50)]
    vocab = Vocab.build("user", _counts(list(rng.choice(ids, 400))).table(), min_count=5)
    kept = set(vocab.ids.to_pylist())
    values = pa.array([v for v in ids[::2]] + ["never"])
    candidates = np.array([k for k, i in enumerate(vocab.ids.to_pylist()) if i in set(values.to_pylist())], dtype=np.int64)
    expected = vocab.lookup(values)
    assert (expected == OOV_ROW).any() and len(kept) < len(ids)  # some values are dropped ids or unknown
    np.testing.assert_array_equal(vocab.lookup_among(values, candidates), expected)
    # a value outside the candidates is unknown to the subset: OOV
    assert vocab.lookup_among(pa.array([vocab.ids[0].as_py()]), np.array([1], np.int64)).tolist() == [OOV_ROW]


def test_the_mapping_file_round_trips(tmp_path):
    ids = ['plain', 'with,comma', 'with "quote"', "ünicode", "  spaced "]
    vocab = Vocab.build("user", _counts(ids + ids[:2]).table())
    vocab.save(tmp_path / "user.csv")
    text = (tmp_path / "user.csv").read_text().splitlines()
    assert text[:4] == ['"row","id","count"', '0,"",0', '1,"",0', '2,"plain",2']
    loaded = Vocab.load("user", tmp_path / "user.csv")
    assert loaded.ids.to_pylist() == vocab.ids.to_pylist()
    assert loaded.counts.tolist() == vocab.counts.tolist() == [2, 2, 1, 1, 1]
    (tmp_path / "bad.csv").write_text("row,id\n0,\n")
    with pytest.raises(DataFormatError, match="bad.csv: a vocabulary file has columns row,id,count"):
        Vocab.load("user", tmp_path / "bad.csv")


@pytest.mark.parametrize("q", [0.1, 0.5, 0.9, 0.999])
def test_time_quantile_is_exact(monkeypatch, q):
    monkeypatch.setattr(split_lib, "_BINS", 16)  # several narrowing rounds on a small input
    monkeypatch.setattr(split_lib, "_SELECT_IN_MEMORY", 8)
    rng = np.random.default_rng(int(q * 1000))
    chunks = [rng.integers(-(10**12), 10**12, 300), rng.integers(0, 40, 500), np.full(50, 7)]
    times = np.concatenate(chunks)
    got = time_quantile(lambda: iter(chunks), q, times.size, int(times.min()), int(times.max()))
    assert got == np.sort(times)[int(np.floor(q * times.size))]


def test_eval_flags():
    starts = np.array([0, 1, 3, 7])  # users of 1, 2 and 4 events
    times = np.array([5, 1, 9, 2, 3, 8, 9])
    assert eval_flags(SplitRule(SplitKind.LAST, 1), None, starts, times).tolist() == [0, 0, 1, 0, 0, 0, 1]
    assert eval_flags(SplitRule(SplitKind.LAST, 2), None, starts, times).tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert eval_flags(SplitRule(SplitKind.TIME_CUTOFF, 8), 8, starts, times).tolist() == [0, 0, 1, 0, 0, 1, 1]
