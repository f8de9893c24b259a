"""ShardWriters: records dealt over windows of files, the window closed before the next opens."""

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from gem_jax.data.ingest import shard_writer
from gem_jax.data.ingest.shard_writer import INDEX_BYTES_PER_RECORD, ShardWriters


def _write(tmp_path, num_records, index_bytes, num_files=None, chunks=(7, 0, 13, 30)):
    writers = ShardWriters(tmp_path, num_records, index_bytes, num_files)
    written, opened = 0, []
    for size in chunks:
        size = min(size, num_records - written)
        records = [f"r{written + k}".encode() for k in range(size)]
        writers.write(iter(records), np.arange(written, written + size, dtype=np.int32), np.full(size, 1, np.int32))
        opened.append(len(writers._open))
        written += size
    return writers, writers.close(), opened


def test_records_land_where_file_of_says(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_writer, "WINDOW_FILES", 4)
    writers, (lengths, train), opened = _write(tmp_path, 50, 12 * INDEX_BYTES_PER_RECORD)
    assert (writers.width, writers.per_window) == (4, 12)
    assert len(writers.names) == 20 and writers.names[0] == "part-00000-of-00020.array_record"
    assert max(opened) <= 4 and writers.index_bytes == 12 * INDEX_BYTES_PER_RECORD
    files = writers.file_of(np.arange(50))
    np.testing.assert_array_equal(files[:12], [0, 1, 2, 3] * 3)
    np.testing.assert_array_equal(files[48:], [16, 17])  # the last window holds 2 records: files 18, 19 stay empty
    for file, name in enumerate(writers.names):
        expected = [f"r{k}".encode() for k in np.flatnonzero(files == file)]
        assert list(ArrayRecordReader(str(tmp_path / name)).read_all()) == expected
        np.testing.assert_array_equal(lengths[name], np.flatnonzero(files == file))  # each record's own length
        assert train[name].tolist() == [1] * len(expected)


def test_explicit_file_count_is_one_window(tmp_path):
    writers, (lengths, _), _ = _write(tmp_path, 30, INDEX_BYTES_PER_RECORD, num_files=3, chunks=(30,))
    assert writers.names == [f"part-{s:05d}-of-00003.array_record" for s in range(3)]
    assert [len(lengths[name]) for name in writers.names] == [10, 10, 10]
    with pytest.raises(ValueError, match="num_records and num_files must be >= 1"):
        ShardWriters(tmp_path, 0, 1 << 20)
    short = ShardWriters(tmp_path / "short", 5, 1 << 20)
    (tmp_path / "short").mkdir()
    short.write(iter([b"a", b"b"]), np.ones(2, np.int32), np.ones(2, np.int32))
    with pytest.raises(ValueError, match="2 records were written, 5 were planned"):
        short.close()
