"""End-to-end: the CLI on ml-latest-small with a tiny config; exact resume after a stop."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from gem_jax.cli import train_main
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.config import load_config
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.preemption import PREEMPTED_EXIT_CODE
from gem_jax.train.setup import setup_training


def read_records(workdir, kind):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def tiny_config(repo_root):
    return load_config(repo_root / "configs" / "movielens_tiny.py")


@pytest.fixture(scope="module")
def uninterrupted(tiny_config, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    summary = train_and_evaluate(tiny_config, workdir)
    return workdir, summary


def test_cli_trains_evaluates_and_checkpoints(repo_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # stopped before loop.num_steps: the preemption status, resume by running again
        train_main(["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path), "--stop-after-steps", "2"])
    assert exit_info.value.code == PREEMPTED_EXIT_CODE
    train = read_records(tmp_path, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in train)
    assert (tmp_path / "checkpoints" / "2").is_dir()
    assert any((tmp_path / "tensorboard").iterdir())
    out = capsys.readouterr().out
    assert "run summary" in out and "goodput (train_step / wall)" in out
    assert f"metrics: {tmp_path / 'metrics.jsonl'}" in out
    summary = read_records(tmp_path, "summary")[-1]
    assert summary["time_startup_imports_s"] > 0  # the clock starts with the process
    assert summary["compiles_after_start"] == 0


def test_finished_run_reports_eval_and_baseline(uninterrupted):
    workdir, summary = uninterrupted
    assert summary["finished"] and summary["step"] == 6
    assert summary["eval_examples"] == 9818  # every eval example of ml-latest-small, once
    for key in ("auc_like", "auc_love", "baseline_auc_like", "ne_like"):
        assert 0.0 < summary[key] < 2.0, key


def test_stop_and_restart_reproduces_the_loss_sequence(tiny_config, uninterrupted, tmp_path):
    workdir, _ = uninterrupted
    train_and_evaluate(tiny_config, tmp_path, stop_after_steps=4)  # checkpoints at 3 and 4 (the stop)
    resumed = train_and_evaluate(tiny_config, tmp_path)
    expected = [(r["step"], r["loss"]) for r in read_records(workdir, "train")]
    got = [(r["step"], r["loss"]) for r in read_records(tmp_path, "train")]
    assert got == expected  # bit-exact: same parameters, optimizer state and batches
    assert resumed["auc_like"] == read_records(workdir, "summary")[-1]["auc_like"]


def test_snapshot_saves_train_and_checkpoint_what_blocking_saves_do(tiny_config, uninterrupted, tmp_path):
    """Saves from an on-device snapshot (the next steps donate the live state meanwhile): the same losses and the same
    checkpoints bit for bit, and the snapshot's copy is compiled before the first step."""
    workdir, _ = uninterrupted
    config = dataclasses.replace(tiny_config, checkpoint=dataclasses.replace(tiny_config.checkpoint, snapshot="on"))
    summary = train_and_evaluate(config, tmp_path)
    # step 3 from a snapshot; step 6 too unless step 3 was still being written (then the final save blocks)
    assert summary["checkpoint_snapshots"] >= 1 and summary["checkpoint_saves"] == 2 and summary["compiles_after_start"] == 0
    assert [(r["step"], r["loss"]) for r in read_records(tmp_path, "train")] == [(r["step"], r["loss"]) for r in read_records(workdir, "train")]
    training, _ = setup_training(tiny_config, init_state=False)
    for step in (3, 6):
        blocking, snapshot = (
            Checkpointer(d / "checkpoints", tiny_config.checkpoint, read_only=True).restore_state(step, training.state.abstract)
            for d in (workdir, tmp_path)
        )
        for a, b in zip(jax.tree.leaves(blocking), jax.tree.leaves(snapshot), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_finished_run_started_again_only_reports(tiny_config, uninterrupted):
    workdir, summary = uninterrupted
    before = (workdir / "metrics.jsonl").read_text()
    events = sorted((workdir / "tensorboard").iterdir())
    again = train_and_evaluate(tiny_config, workdir)
    assert again["auc_like"] == summary["auc_like"]
    assert (workdir / "metrics.jsonl").read_text() == before
    assert sorted((workdir / "tensorboard").iterdir()) == events


def test_bad_config_path_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", str(tmp_path / "missing.py"), "--workdir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert "missing.py not found" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["gem_h200_tiny.py", "gem_h200_seq4096_tiny.py"])
def test_gem_h200_tiny_configs_train_two_steps(repo_root, tmp_path, config):
    train_main(["--config", str(repo_root / "configs" / config), "--workdir", str(tmp_path), "--no-progress"])
    train = read_records(tmp_path, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in train)
