"""The planted source: its signals against direct recomputation, its oracle against the truth file,
the target gaps on the small presets, conversion through gem-data convert, determinism."""

import collections
import dataclasses
import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from gem_jax import data_cli
from gem_jax.data.ingest.convert import ConvertOptions, convert
from gem_jax.data.ingest.readers import Format
from gem_jax.data.ingest.shards import ConvertedLog
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.ingest.vocab import FIRST_ID_ROW
from gem_jax.data.planted import LONG_RANGE, SHORT_RANGE, Draw, PlantedConfig, event_schema, generate, read_truth, small, write_planted
from gem_jax.data.rows import DataFormatError
from gem_jax.train.oracle import oracle_report

SPLIT = SplitRule.parse("time:0.9")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The small long-range log, written as Parquet, and its oracle report on time:0.9."""
    log = generate(small(LONG_RANGE))
    files = write_planted(log, tmp_path_factory.mktemp("planted") / "log")
    return log, files, oracle_report(read_truth(files.truth), SPLIT)


def _positions(log):
    return np.arange(log.num_events) - log.user_offsets[log.user]


def test_signals_match_a_direct_recomputation(planted):
    log, _, _ = planted
    config = log.config
    position = _positions(log)
    assert (np.diff(log.user_offsets) >= config.min_length).all() and (np.diff(log.user_offsets) <= config.max_length).all()
    same_user = log.user[1:] == log.user[:-1]
    assert (np.diff(log.time)[same_user] >= 1).all()
    np.testing.assert_allclose(log.p, 1 / (1 + np.exp(-log.logit)), rtol=1e-12)
    np.testing.assert_allclose(log.logit, config.base_logit + sum(log.terms.values()), rtol=1e-12)

    rng = np.random.default_rng(1)
    for e in rng.choice(np.flatnonzero(position >= 300), 150, replace=False).tolist() + [int(log.user_offsets[3])]:
        history = log.item[log.user_offsets[log.user[e]] : e]  # oldest first
        candidate = log.item[e]
        last = history[-config.recent_window :]
        recent = np.mean([log.item_vectors[candidate] @ log.item_vectors[j] for j in last]) if last.size else 0.0
        mid_events = history[max(0, len(history) - config.mid_window) : max(0, len(history) - config.recent_window)]
        mid = np.mean(log.item_category[mid_events] == log.item_category[candidate]) if mid_events.size else 0.0
        near, far = config.long_window
        far_events = history[max(0, len(history) - far) : max(0, len(history) - near + 1)]
        engaged = (log.item_category[far_events] == log.item_category[candidate]).sum() >= config.long_min_count
        recently = (log.item_category[history[-config.mid_window :]] == log.item_category[candidate]).any()
        assert log.terms["recent"][e] == pytest.approx(config.recent_weight * recent, abs=1e-12)
        assert log.terms["mid"][e] == pytest.approx(config.mid_weight * mid, abs=1e-12)
        assert log.terms["long"][e] == config.long_weight * (engaged and not recently)
    assert (log.terms["long"][log.draw == Draw.RETURN] == config.long_weight).all()
    assert (log.draw[position < config.long_window[0]] != Draw.RETURN).all()


def _pair_auc(score, y):
    """P(score of a positive > score of a negative), ties counted half, by counting over sorted negatives."""
    negatives = np.sort(score[y == 0])
    below = np.searchsorted(negatives, score[y == 1], side="left")
    equal = np.searchsorted(negatives, score[y == 1], side="right") - below
    return (below + equal / 2).sum() / (negatives.size * (y == 1).sum())


def test_oracle_recomputed_from_the_truth_file(planted):
    """The oracle's AUC and NE from the truth file's p; the baseline from per-item train means; the cutoff as a time quantile."""
    _, files, report = planted
    truth = pq.read_table(files.truth).to_pydict()
    times, labels, p, items = (np.array(truth[c]) for c in ("ts", "click", "p", "item_id"))
    cutoff = np.sort(times)[int(0.9 * times.size)]
    eval_ = times >= cutoff
    y = labels[eval_]
    rate = y.mean()
    ne = -np.mean(y * np.log(p[eval_]) + (1 - y) * np.log(1 - p[eval_])) / -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert report.cutoff == cutoff and report.eval_events == eval_.sum() and report.events == times.size
    assert report.oracle.auc == pytest.approx(_pair_auc(p[eval_], y), abs=1e-12)
    assert report.oracle.ne == pytest.approx(ne, rel=1e-9)

    sums, counts = collections.Counter(), collections.Counter()
    for item, label in zip(items[~eval_].tolist(), labels[~eval_].tolist()):
        sums[item] += label
        counts[item] += 1
    overall = labels[~eval_].mean()
    baseline = np.array([sums[item] / counts[item] if counts[item] else overall for item in items[eval_].tolist()])
    assert report.item_mean.auc == pytest.approx(_pair_auc(baseline, y), abs=1e-12)


@pytest.mark.parametrize("preset", ["long-range", "short-range"])
def test_small_presets_meet_the_targets(planted, tmp_path, preset):
    if preset == "long-range":
        report = planted[2]
    else:
        report = oracle_report(read_truth(write_planted(generate(small(SHORT_RANGE)), tmp_path / "log").truth), SPLIT)
    assert 0.75 <= report.oracle.auc <= 0.85
    assert report.item_mean.auc <= report.oracle.auc - 0.10
    assert report.history_share >= 0.5
    assert report.oracle.ne < report.no_history.ne
    assert report.min_train_item_count >= 20 and report.eval_items_unseen == 0
    if preset == "long-range":
        assert report.long_range_share >= 1 / 3
        assert report.oracle.ne < report.no_long_range.ne < report.no_history.ne
    else:
        assert report.long_range_share == 0.0 and report.no_long_range == report.oracle


def test_every_item_is_in_the_log_and_seen_20_times_in_train(planted):
    log, _, report = planted
    assert np.unique(log.item).size == log.config.num_items
    assert report.min_train_item_count >= 20


def test_converts_with_gem_data_convert(planted, tmp_path):
    log, files, report = planted
    result = convert([files.events], tmp_path / "converted", event_schema(files), ConvertOptions(split=SPLIT), log=lambda line: None)
    counts = result.manifest["counts"]
    assert counts["events"] == log.num_events and counts["users"] == log.config.num_users and counts["items"] == log.config.num_items
    assert (counts["train_events"], counts["eval_events"]) == (report.train_events, report.eval_events)
    assert result.manifest["split"]["cutoff"] == report.cutoff
    assert result.manifest["tasks"][0]["eval_positive_rate"] == pytest.approx(report.eval_positive_rate, abs=1e-12)

    converted = ConvertedLog(tmp_path / "converted")
    users, items = converted.vocab("user").ids.to_pylist(), converted.vocab("item").ids.to_pylist()
    categories = converted.vocab("item_feature.category").ids.to_pylist()
    actions = converted.vocab("action").ids.to_pylist()
    category_rows = converted.item_features()["category"][:, 0]
    split_times = {}
    for record in converted:
        u = int(users[int(record["user"]) - FIRST_ID_ROW][1:])
        lo, hi = log.user_offsets[u], log.user_offsets[u + 1]
        ids = [int(items[r - FIRST_ID_ROW][1:]) for r in record["item"]]
        np.testing.assert_array_equal(ids, log.item[lo:hi])
        np.testing.assert_array_equal(record["time"], log.time[lo:hi])
        np.testing.assert_array_equal(record["labels"][:, 0], log.click[lo:hi])
        assert [actions[r - FIRST_ID_ROW] for r in record["action"]] == [("impression", "click")[c] for c in log.click[lo:hi]]  # each event's outcome
        np.testing.assert_array_equal([int(categories[category_rows[r] - FIRST_ID_ROW][1:]) for r in record["item"]], log.item_category[log.item[lo:hi]])
        split_times[u] = record["split"]
    assert len(split_times) == log.config.num_users
    assert sum(int(s.sum()) for s in split_times.values()) == report.eval_events


def test_same_seed_same_bytes_other_seed_other_log(planted, tmp_path):
    log, files, _ = planted
    again = write_planted(generate(small(LONG_RANGE)), tmp_path / "again")
    for name in ("events", "items", "truth"):
        assert getattr(files, name).read_bytes() == getattr(again, name).read_bytes(), name
    other = generate(dataclasses.replace(small(LONG_RANGE), seed=1))
    assert other.num_events != log.num_events or not np.array_equal(other.item, log.item)


def test_csv_output_and_the_cli(tmp_path, capsys):
    out = tmp_path / "csv"
    config = dataclasses.replace(small(SHORT_RANGE), num_users=200)
    files = write_planted(generate(config), out, Format.CSV)
    assert files.events.name == "events.csv" and files.items.name == "items.csv"
    header = files.events.read_text().splitlines()[0]
    assert header == '"user_id","item_id","ts","click","action"'
    with pytest.raises(DataFormatError, match="holds a planted log; pass --overwrite to replace it"):
        write_planted(generate(config), out, Format.CSV)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    with pytest.raises(DataFormatError, match="holds no planted log"):
        write_planted(generate(config), tmp_path / "other")

    data_cli.main(["plant", "--out", str(tmp_path / "cli"), "--small", "--preset", "short-range", "--seed", "3"])
    printed = capsys.readouterr().out
    assert "gem-data convert" in printed and "oracle" in printed
    saved = json.loads((tmp_path / "cli" / "oracle.json").read_text())
    report = oracle_report(read_truth(tmp_path / "cli" / "truth.parquet"), SPLIT)
    assert saved == json.loads(json.dumps(report.to_json()))
    data_cli.main(["oracle", str(tmp_path / "cli"), "--split", "last:5"])
    assert "each user's last 5 event(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit:  # the option named, with the bound the preset sets
        data_cli.main(["plant", "--out", str(tmp_path / "short"), "--small", "--preset", "short-range", "--max-length", "1"])
    assert exit.value.code == 2
    assert re.search(r"--max-length 1: the short-range preset's histories start at \d+ events; give --max-length >= \d+", capsys.readouterr().err)
    # a split that holds out one event (one label) leaves AUC and NE undefined: refused, not reported as nan
    with pytest.raises(SystemExit) as exit:
        data_cli.main(["oracle", str(tmp_path / "cli"), "--split", "time:0.9999999"])
    assert exit.value.code == 2
    assert re.search(r"all 1 eval event\(s\) are labelled [01], so AUC and NE are undefined", capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit:  # planting again into the log needs --overwrite, named as the flag
        data_cli.main(["plant", "--out", str(tmp_path / "cli"), "--small", "--preset", "short-range", "--seed", "3"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == f"gem-data plant: error: {tmp_path / 'cli'} holds a planted log; pass --overwrite to replace it"


def test_oracle_refuses_a_directory_without_a_truth_file_naming_it(tmp_path, capsys):
    """A missing path, a file, a converted directory or any other folder: exit 2 naming the path and what oracle
    takes (a planted log from gem-data plant, holding truth.parquet), no pyarrow traceback."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "converted").mkdir()
    (tmp_path / "converted" / "manifest.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    cases = {
        "nosuch": "no such directory",
        "afile": "not a directory",
        "converted": "a converted directory, which holds no truth.parquet (pass the planted log it was converted from)",
        "empty": "holds no truth.parquet",
    }
    for name, what in cases.items():
        with pytest.raises(SystemExit) as exit:
            data_cli.main(["oracle", str(tmp_path / name)])
        assert exit.value.code == 2, name
        err = capsys.readouterr().err
        assert err.strip() == (
            f"gem-data oracle: error: {tmp_path / name}: {what}; "
            "the directory must be a planted log written by gem-data plant (holding truth.parquet)"
        )


def test_the_face_exports_resolve():
    import gem_jax.data.planted as planted

    for name in planted.__all__:
        assert getattr(planted, name) is not None, name
    assert callable(planted.generate) and planted.PRESETS["long-range"] == planted.LONG_RANGE


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="recent_window < mid_window < long_window"):
        PlantedConfig(mid_window=300)
    with pytest.raises(ValueError, match="focus_prob \\+ return_prob"):
        PlantedConfig(focus_prob=0.8, return_prob=0.3)
    with pytest.raises(TypeError, match="PlantedConfig.num_users must be an int"):
        PlantedConfig(num_users=10.0)
    with pytest.raises(ValueError, match="num_items must be >= num_categories"):
        PlantedConfig(num_items=10, num_categories=20)
