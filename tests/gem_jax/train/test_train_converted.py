"""End to end on an own event log: `gem-train --config configs/events_tiny.py --set data.path=DIR` on a converted
directory trains, reports both tasks beside the item-mean baseline, resumes exactly after a stop, and refuses a
restart on a changed conversion."""

import json

import numpy as np
import pytest

from event_logs import convert_event_log, write_event_log
from gem_jax.cli import train_main
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
