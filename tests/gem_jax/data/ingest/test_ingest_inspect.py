"""gem-data inspect on a small known log (raw and converted), and the gem-data command line."""

import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from gem_jax import data_cli
from gem_jax.data.balance import padding_waste
from gem_jax.data.ingest import convert as convert_module
from gem_jax.data.ingest.batch_layout import layout_report
from gem_jax.data.ingest.convert import ConvertOptions, bucket_count, convert, max_sorted_events, memory_plan
from gem_jax.data.ingest.inspect import inspect_raw
from gem_jax.data.ingest.readers import expand_inputs
from gem_jax.data.ingest.schema import EventSchema, FeatureColumn, LabelRule, Side
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.ingest.stats import length_summary, text_histogram

# 4 users with 1, 2, 3 and 6 events; click rate 6/12; like (stars>=4) 3/12
LOG = """user,item,ts,click,stars,genre
u1,a,1,1,5,x
u2,a,2,0,1,x
u2,b,3,1,2,y
u3,a,4,0,3,x
u3,b,5,1,4,y
u3,c,6,0,1,z
u4,a,7,1,5,x
u4,b,8,0,1,y
u4,c,9,1,2,z
u4,a,10,0,3,x
u4,b,11,1,1,y
u4,c,12,0,1,z
"""
FLAGS = ["--user", "user", "--item", "item", "--time", "ts", "--label", "click", "--label", "like=stars>=4", "--item-feature", "genre"]


def test_length_summary_and_histogram():
    summary = length_summary(np.array([1, 2, 3, 6]))
    assert summary["histogram"] == {"edges": [1, 2, 4, 8], "counts": [1, 2, 1]}
    assert (summary["events"], summary["mean"], summary["max"], summary["quantiles"]["p50"]) == (12, 3.0, 6, 2.5)
    assert text_histogram(summary, width=4).splitlines() == ["              1 | ##   1", "            2-3 | #### 2", "            4-7 | ##   1"]


def test_layout_report_on_known_lengths():
    equal = layout_report(np.full(64, 10), batch_size=16, gpus=4)
    assert (equal.padded_waste, equal.padded_to_longest_waste, equal.imbalance, equal.imbalance_bbs) == (0, 0, 0, 0)
    # 4 devices of 4 samples, 40 real tokens each, in the smallest capacity (128 rows): 1 - 160 / 512
    assert equal.jagged_slack == pytest.approx(padding_waste(np.full(16, 10), 4 * 128))
    skewed = layout_report(np.r_[np.full(60, 2), np.full(4, 200)], batch_size=16, gpus=4, batches=32)
    assert skewed.imbalance_bbs < skewed.imbalance
    assert skewed.padded_waste > skewed.jagged_slack
    with pytest.raises(ValueError, match="the shard size 12 / 4 = 3 is odd"):
        layout_report(np.full(8, 3), batch_size=12, gpus=4)


def test_inspect_raw_and_converted(tmp_path, capsys):
    (tmp_path / "log.csv").write_text(LOG)
    data_cli.main(["inspect", str(tmp_path / "log.csv"), *FLAGS, "--batch-size", "4", "--gpus", "2", "--figure", str(tmp_path / "raw.png")])
    raw = capsys.readouterr().out
    assert "events 12, users 4, items 3, time 1 .. 12" in raw
    assert "task click: 50.00% positive" in raw and "task like: 25.00% positive" in raw
    assert "feature genre: 3 distinct values" in raw
    assert "events per user: mean 3.0, std 1.9, min 1, p50 2.5" in raw and "max 6" in raw
    assert "layout, batch 4 on 2 GPU(s), histories up to 6 events" in raw
    assert "duplicate events 0" in raw.splitlines()
    assert (tmp_path / "raw.png").stat().st_size > 1000

    data_cli.main(["convert", str(tmp_path / "log.csv"), "--out", str(tmp_path / "out"), *FLAGS, "--split", "last:1", "--shards", "2", "--quiet"])
    converted = capsys.readouterr().out
    assert "events 12 (train 9, eval 3), users 4, items 3, 2 shard(s), split each user's last 1 event(s)" in converted
    data_cli.main(["inspect", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "events 12, users 4, items 3, time 1 .. 12" in out and "task like: 25.00% positive" in out
    assert "            4-7 | " in out and (tmp_path / "out" / "length_histogram.png").exists()
    assert "duplicate events 0" in out.splitlines()


def test_inspect_counts_and_names_duplicate_events_as_convert_does(tmp_path, capsys):
    """A raw log's rows equal in every column read to an earlier row, as parsed, are counted and the first named as
    gem-data convert counts and names them; inspecting the converted directory shows its manifest's count."""
    path = tmp_path / "log.csv"
    # line 14 repeats line 13; line 15 repeats line 3 once parsed; line 16 is line 2 with another stars value (both likes)
    path.write_text(LOG + "u4,c,12,0,1,z\n" + "u2,a,2,0,1.0,x\n" + "u1,a,1,1,4,x\n")
    meaning = f"rows equal in every column read to an earlier row (first: {path}, line 14, a copy of line 13)"
    data_cli.main(["inspect", str(path), *FLAGS])
    raw = capsys.readouterr().out.splitlines()
    assert "events 15, users 4, items 3, time 1 .. 12" in raw and f"duplicate events 2: {meaning}" in raw
    data_cli.main(["convert", str(path), "--out", str(tmp_path / "out"), *FLAGS, "--split", "last:1", "--quiet"])
    assert f"  2 duplicate event(s), kept: {meaning}" in capsys.readouterr().out.splitlines()
    data_cli.main(["inspect", str(tmp_path / "out")])
    assert f"duplicate events 2: {meaning}" in capsys.readouterr().out.splitlines()


def test_inspect_finds_the_duplicates_convert_finds_across_files_buckets_and_groups(tmp_path, monkeypatch):
    """A log of a CSV and a Parquet file with many copies: inspect, its rows spread over several buckets compared in
    several groups, counts the duplicates a Python set of the parsed rows counts and names the first as convert does."""
    rng = np.random.default_rng(0)
    n = 600
    rows = {
        "user": rng.choice([f"u{k}" for k in range(12)], n), "item": rng.choice(["a", "b"], n), "ts": rng.integers(0, 3, n),
        "click": rng.integers(0, 2, n), "stars": rng.choice([1.0, 4.0, 5.0], n), "genre": rng.choice(["x", "y"], n),
    }
    table = pa.table(rows)
    pa_csv.write_csv(table.slice(0, n // 2), tmp_path / "a.csv")
    pq.write_table(table.slice(n // 2), tmp_path / "b.parquet", row_group_size=64)
    files = [tmp_path / "a.csv", tmp_path / "b.parquet"]
    schema = EventSchema(
        user="user", item="item", time="ts", labels=(LabelRule.parse("click"), LabelRule.parse("like=stars>=4")),
        features=(FeatureColumn("genre", Side.ITEM),),
    )
    manifest = convert(files, tmp_path / "out", schema, ConvertOptions(split=SplitRule.parse("last:1")), log=lambda line: None).manifest
    expected = n - len(set(zip(*(table[name].to_pylist() for name in rows))))
    monkeypatch.setattr(convert_module, "_BYTES_PER_EVENT", 1 << 23)  # as if every event took 8 MiB to sort
    _, sort_bytes = memory_plan(2048)
    assert bucket_count(expand_inputs(files), sort_bytes) >= 8 and max_sorted_events(sort_bytes) < n // 2
    report = inspect_raw(files, schema)
    assert report.duplicate_events == manifest["counts"]["duplicate_events"] == expected > 0
    assert report.first_duplicate_event == manifest["first_duplicate_event"]
    assert report.first_duplicate_event["file"] == str(tmp_path / "a.csv")  # the CSV half holds copies of its own rows


def test_inspect_takes_a_memory_budget_of_at_least_its_minimum(tmp_path, capsys):
    (tmp_path / "log.csv").write_text(LOG)
    with pytest.raises(SystemExit) as exit:
        data_cli.main(["inspect", str(tmp_path / "log.csv"), *FLAGS, "--memory-mb", "100"])
    assert exit.value.code == 2
    assert "gem-data inspect: error: --memory-mb must be at least 408 (MiB), got 100" in capsys.readouterr().err
    data_cli.main(["inspect", str(tmp_path / "log.csv"), *FLAGS, "--memory-mb", "408"])
    assert "events 12, users 4, items 3, time 1 .. 12" in capsys.readouterr().out


def test_cli_refuses_bad_input_with_exit_2(tmp_path, capsys):
    (tmp_path / "log.csv").write_text(LOG + "u5,a,13,1\n")
    with pytest.raises(SystemExit) as exit:
        data_cli.main(["convert", str(tmp_path / "log.csv"), "--out", str(tmp_path / "out"), *FLAGS])
    assert exit.value.code == 2
    assert "line 14: wrong number of fields: 4 fields, the header has 6" in capsys.readouterr().err
    data_cli.main(["convert", str(tmp_path / "log.csv"), "--out", str(tmp_path / "out"), *FLAGS, "--on-bad-row", "skip", "--quiet"])
    assert "skipped 1 row(s) of" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_cli_names_the_first_bad_row_of_the_file_before_a_later_wrong_field_count(tmp_path, capsys, command):
    """A bad value on line 3 is named, not the wrong field count the CSV parser meets first on line 5."""
    lines = LOG.splitlines()
    lines[2], lines[4] = "u2,a,2,yes,1,x", "u3,a,4,0"
    (tmp_path / "log.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit:
        data_cli.main([command, str(tmp_path / "log.csv"), *FLAGS, "--on-bad-row", "error", *(["--out", str(tmp_path / "out")] if command == "convert" else [])])
    assert exit.value.code == 2
    assert f"{tmp_path / 'log.csv'}, line 3, column 'click': not a number: 'yes' is not a number" in capsys.readouterr().err


def test_inspect_names_a_path_that_does_not_exist_before_asking_for_columns(tmp_path, capsys):
    """Without --user/--item/--time a missing path is named as missing, not answered with the schema flags it would need."""
    with pytest.raises(SystemExit) as exit:
        data_cli.main(["inspect", str(tmp_path / "nosuch") + "/"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"gem-data inspect: error: {tmp_path / 'nosuch'}/: no such file or directory" in err
    assert "--user" not in err and "Traceback" not in err
    (tmp_path / "log.csv").write_text(LOG)  # an existing raw file still needs the columns
    with pytest.raises(SystemExit) as exit:
        data_cli.main(["inspect", str(tmp_path / "log.csv")])
    assert exit.value.code == 2
    assert "raw inputs need --user, --item and --time" in capsys.readouterr().err


def test_layout_options_are_checked_when_parsed_and_named_in_the_split_error(tmp_path, capsys):
    (tmp_path / "log.csv").write_text(LOG)
    for flag, value in (("--batch-size", "0"), ("--batch-size", "-4"), ("--gpus", "0"), ("--max-seq-len", "0")):
        with pytest.raises(SystemExit) as exit:
            data_cli.main(["inspect", str(tmp_path / "log.csv"), *FLAGS, flag, value])
        assert exit.value.code == 2
        assert f"gem-data inspect: error: argument {flag}: must be >= 1, got {int(value)}" in capsys.readouterr().err
    for batch, gpus, what in (("10", "4", "a batch of 10 samples does not split into 4 equal shards"), ("12", "4", "the shard size 12 / 4 = 3 is odd")):
        with pytest.raises(SystemExit) as exit:
            data_cli.main(["inspect", str(tmp_path / "log.csv"), *FLAGS, "--batch-size", batch, "--gpus", gpus])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert f"gem-data inspect: error: --batch-size {batch} on --gpus {gpus}: {what}" in err
        assert "layout_report" not in err and "Traceback" not in err


def test_a_header_of_one_column_holding_another_delimiter_names_the_delimiter_option(tmp_path, capsys):
    (tmp_path / "tabs.csv").write_text(LOG.replace(",", "\t"))
    (tmp_path / "semicolons.csv").write_text(LOG.replace(",", ";"))
    for name, hint in (("tabs.csv", "holds '\\t' (a tab): if the file is separated by it, pass --delimiter '\\t'"),
                       ("semicolons.csv", "holds ';': if the file is separated by it, pass --delimiter ';'")):
        with pytest.raises(SystemExit) as exit:
            data_cli.main(["inspect", str(tmp_path / name), *FLAGS])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name}: missing column(s) ['user', 'item', 'ts', 'genre', 'click', 'stars']" in err
        assert f"the header reads as one column split at ',' but {hint}" in err
    data_cli.main(["inspect", str(tmp_path / "tabs.csv"), *FLAGS, "--delimiter", "\\t"])  # the hint's option reads it
    assert "events 12, users 4, items 3" in capsys.readouterr().out
    (tmp_path / "other.csv").write_text("uid,iid,ts\nu1,a,1\n")  # several columns, none with a tab: no hint
    with pytest.raises(SystemExit):
        data_cli.main(["inspect", str(tmp_path / "other.csv"), *FLAGS])
    assert "--delimiter" not in capsys.readouterr().err


def test_vocab_from_is_checked_before_the_log_is_read(tmp_path, capsys):
    (tmp_path / "log.csv").write_text(LOG)
    data_cli.main(["convert", str(tmp_path / "log.csv"), "--out", str(tmp_path / "first"), "--user", "user", "--item", "item", "--time", "ts",
                   "--label", "click", "--split", "last:1", "--quiet"])
    capsys.readouterr()
    (tmp_path / "raw").mkdir()
    for vocab_from, what in (
        ("data/nosuch", "no such directory; name a directory gem-data convert wrote"),
        (str(tmp_path / "log.csv"), "not a directory"),
        (str(tmp_path / "raw"), "not a converted directory (no manifest.json)"),
        (str(tmp_path / "first"), "lacks vocab/item_feature.genre.csv: this conversion's columns need a vocabulary the reused one has none of"),
    ):
        with pytest.raises(SystemExit) as exit:
            data_cli.main(["convert", str(tmp_path / "log.csv"), "--out", str(tmp_path / "out"), *FLAGS, "--vocab-from", vocab_from, "--quiet"])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert f"gem-data convert: error: --vocab-from {vocab_from}: {what}" in err
        assert "not a vocabulary file" not in err and "Traceback" not in err
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()  # refused before pass 1


def test_inspect_removes_its_temporary_folder_on_sigterm(tmp_path, monkeypatch):
    """A SIGTERM while the rows are bucketed exits with 128 + 15, as the signal would, after the bucket files' folder is removed."""
    path = tmp_path / "log.csv"
    path.write_text(LOG)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    write = convert_module.Buckets.write

    def write_then_terminated(self, table):
        write(self, table)
        assert list(scratch.iterdir())  # the folder exists while the rows go in
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(convert_module.Buckets, "write", write_then_terminated)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        data_cli.main(["inspect", str(path), *FLAGS])
    assert exited.value.code == 128 + signal.SIGTERM
    assert list(scratch.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back


def test_a_full_disk_is_named_with_the_folder_it_fills(tmp_path, monkeypatch, capsys):
    path = tmp_path / "log.csv"
    path.write_text(LOG)

    def full(self, table):
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(convert_module.Buckets, "write", full)
    with pytest.raises(SystemExit) as exited:
        data_cli.main(["inspect", str(path), *FLAGS])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "gem-data inspect: error: no space left on the device of the temporary folder" in error and "(TMPDIR)" in error
    with pytest.raises(SystemExit) as exited:
        data_cli.main(["convert", str(path), "--out", str(tmp_path / "out"), *FLAGS, "--split", "last:1", "--quiet"])
    assert exited.value.code == 2
    assert f"gem-data convert: error: no space left on the device of --out {tmp_path / 'out'}" in capsys.readouterr().err
