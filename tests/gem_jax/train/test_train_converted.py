"""End to end on an own event log: `gem-train --config configs/events_tiny.py --set data.path=DIR` on a converted
directory trains, reports both tasks beside the item-mean baseline, resumes exactly after a stop, refuses a
restart on a changed conversion, leaves no workdir when refused, and reports a task of one class as undefined."""

import dataclasses
import json

import numpy as np
import pytest

from event_logs import SCHEMA, convert_event_log, write_event_log
from gem_jax.cli import train_main
from gem_jax.data.ingest.schema import LabelRule
from gem_jax.train.config import load_config
from gem_jax.train.config_tree import apply_overrides
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.preemption import PREEMPTED_EXIT_CODE
from gem_jax.train.run_record import RunMismatchError

NUM_EVAL = 60


def train_losses(workdir) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    write_event_log(root / "events", num_train=300, num_eval=NUM_EVAL)
    return convert_event_log(root / "events", root / "mylog").out


@pytest.fixture(scope="module")
def config(repo_root, converted):
    return apply_overrides(load_config(repo_root / "configs" / "events_tiny.py"), [f"data.path={converted}"])


@pytest.fixture(scope="module")
def uninterrupted(config, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    return workdir, train_and_evaluate(config, workdir, progress=False)


def test_trains_and_reports_every_task_beside_the_baseline(uninterrupted):
    workdir, summary = uninterrupted
    assert summary["finished"] and summary["step"] == 6
    assert summary["eval_examples"] == NUM_EVAL  # every eval event once
    for task in ("click", "like"):
        for key in (f"auc_{task}", f"baseline_auc_{task}", f"ne_{task}"):
            assert np.isfinite(summary[key]) and 0.0 < summary[key] < 2.0, key
    record = json.loads((workdir / "run.json").read_text())
    assert record["data"]["source"] == "EVENTS" and record["data"]["num_eval_examples"] == NUM_EVAL
    assert record["spec"]["tasks"] == ["click", "like"]


def test_the_cli_stops_and_a_restart_resumes_exactly(repo_root, converted, config, uninterrupted, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # the README's command, stopped as a preemption would
        train_main([
            "--config", str(repo_root / "configs" / "events_tiny.py"), "--workdir", str(tmp_path), "--no-progress",
            "--set", f"data.path={converted}", "--stop-after-steps", "4",
        ])
    assert exit_info.value.code == PREEMPTED_EXIT_CODE
    assert "mylog: 360 events" in capsys.readouterr().out
    resumed = train_and_evaluate(config, tmp_path, progress=False)
    workdir, summary = uninterrupted
    assert train_losses(tmp_path) == train_losses(workdir)  # bit-exact: same state, same batches after the restore
    assert resumed["auc_click"] == summary["auc_click"]


def test_a_changed_conversion_is_refused(config, converted, uninterrupted, tmp_path):
    """The same workdir after the log was converted again from changed events: refused, naming the fingerprint."""
    workdir, _ = uninterrupted
    write_event_log(tmp_path / "changed", num_train=300, num_eval=NUM_EVAL, seed=1)
    changed = convert_event_log(tmp_path / "changed", tmp_path / "mylog").out
    with pytest.raises(RunMismatchError, match="data.fingerprint: recorded"):
        train_and_evaluate(apply_overrides(config, [f"data.path={changed}"]), workdir, progress=False)


def test_a_refused_start_leaves_no_workdir(repo_root, tmp_path, capsys):
    """A start refused before training (here: no data set at data.path) leaves the filesystem as it was."""
    workdir = tmp_path / "runs" / "mylog"
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", str(repo_root / "configs" / "events_tiny.py"), "--workdir", str(workdir), "--set", f"data.path={tmp_path / 'nosuch'}"])
    assert exit_info.value.code == 2
    assert f"gem-train: EVENTS data set not found: {tmp_path / 'nosuch'} is not a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_task_without_positives_has_no_ne_but_no_huge_number(repo_root, tmp_path, capsys):
    """A task that is never positive: every train window's NE and the eval's AUC and NE are undefined (null, n/a, and
    the eval says why), while the other task's NE is pooled over each window (the reported ne=1.355/397131.031)."""
    write_event_log(tmp_path / "events", num_train=300, num_eval=NUM_EVAL)
    schema = dataclasses.replace(SCHEMA, labels=(LabelRule.parse("click"), LabelRule.parse("rare=rating>=9")))
    converted = convert_event_log(tmp_path / "events", tmp_path / "mylog", schema=schema).out
    config = apply_overrides(load_config(repo_root / "configs" / "events_tiny.py"), [f"data.path={converted}", "loop.num_steps=4", "loop.log_every=2"])
    summary = train_and_evaluate(config, tmp_path / "run", progress=False)
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert r["ne_rare"] is None and 0.0 < r["bce_rare"] < 1.0
        assert 0.5 < r["ne_click"] < 1.5
        assert f"ne={r['ne_click']:.3f}/n/a " in out
    (evaluated,) = [r for r in records if r["kind"] == "eval"]
    assert evaluated["eval_positives_rare"] == 0 and evaluated["auc_rare"] is None and evaluated["ne_rare"] is None
    assert evaluated["baseline_auc_rare"] is None and evaluated["calibration_rare"] is None
    assert 0.0 < evaluated["auc_click"] < 1.0 and 0.5 < evaluated["ne_click"] < 1.5
    assert summary["ne_rare"] is None
    assert f"gem-train: step 4: eval: AUC and NE of task rare are undefined: all {NUM_EVAL} eval examples are labelled 0 (no positives)" in out
