"""The trainer under divergence, corrupt checkpoints, a held workdir, a lowered num_steps; the logs of a resumed run."""

import errno
import json

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.serialization import serialization
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gem_jax.train import config_tree, disk_space, integrity, load_params
from gem_jax.train.checkpoint import Checkpointer, CheckpointWriteError
from gem_jax.train.disk_space import CheckpointSpaceError
from gem_jax.train.config import load_config
from gem_jax.train.divergence import NonFiniteLossError
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.run_record import RunMismatchError
from gem_jax.train.workdir_lock import WorkdirLock, WorkdirLockedError


@pytest.fixture(scope="module")
def tiny_config(repo_root):
    return load_config(repo_root / "configs" / "movielens_tiny.py")


def _steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_divergence_names_the_step_and_no_later_checkpoint_is_written(tiny_config, tmp_path):
    config = config_tree.apply_overrides(
        tiny_config,
        ["optim.learning_rate=1e30", "optim.embedding_learning_rate=1e30", "checkpoint.every_steps=1", "checkpoint.max_to_keep=1", "loop.log_every=100"],
    )
    with pytest.raises(NonFiniteLossError, match="became NaN/Inf at step") as error:
        train_and_evaluate(config, tmp_path)
    bad = error.value.step
    assert 1 < bad <= 6
    # The newest saved step survives rotation; nothing after it is saved. Saves due while the previous
    # one still writes are deferred, so it need not be step bad - 1.
    steps = _steps(tmp_path)
    assert len(steps) == 1 and steps[0] < bad
    good = steps[0]
    assert f"Last good checkpoint: step {good} ({tmp_path.absolute() / 'checkpoints' / str(good)})" in str(error.value)
    assert integrity.verify(tmp_path / "checkpoints" / str(good)) == []  # closed cleanly: its manifest is written
    params = load_params(tmp_path).params
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params))
    assert not (tmp_path / ".lock.0").exists()


def test_a_start_refused_for_disk_space_leaves_no_run_record_to_refuse_its_remedy(tiny_config, tmp_path, monkeypatch):
    """The preflight refuses before run.json is written: the same workdir then takes the changed setting the
    refusal named (bf16 moments) instead of refusing it as another run's config."""
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: 1000)
    with pytest.raises(CheckpointSpaceError, match="the checkpoints cannot fit"):
        train_and_evaluate(tiny_config, tmp_path)
    assert not (tmp_path / "run.json").exists()
    monkeypatch.undo()
    config = config_tree.apply_overrides(tiny_config, ["optim.moments_dtype=bfloat16", "checkpoint.every_steps=1"])
    train_and_evaluate(config, tmp_path, stop_after_steps=1)
    assert json.loads((tmp_path / "run.json").read_text())["config"]["optim"]["moments_dtype"] == "bfloat16"
    assert _steps(tmp_path) == [1]


def test_corrupt_latest_step_falls_back_to_the_newest_intact_one(tiny_config, tmp_path, capsys):
    train_and_evaluate(tiny_config, tmp_path, stop_after_steps=4)  # checkpoints 3 and 4
    assert _steps(tmp_path) == [3, 4]
    chunk = max((tmp_path / "checkpoints" / "4" / "state").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[len(data) // 2 + 1] ^= 0xFF
    chunk.write_bytes(bytes(data))

    with pytest.raises(integrity.CorruptCheckpointError, match=f"step 4 is corrupt:\n  {chunk}: contents changed"):
        train_and_evaluate(tiny_config, tmp_path, fallback=False)
    assert _steps(tmp_path) == [3, 4]  # nothing moved

    summary = train_and_evaluate(tiny_config, tmp_path)
    out = capsys.readouterr()
    assert f"checkpoint step 4 is corrupt, moved to {tmp_path / 'corrupt_checkpoints'}" in out.err and str(chunk) in out.err
    assert "resuming from step 3" in out.out
    assert summary["finished"] and summary["step"] == 6
    assert [p.name.split("-")[0] for p in (tmp_path / "corrupt_checkpoints").iterdir()] == ["4"]
    assert [r["step"] for r in _records(tmp_path) if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # step 4 logged once


def test_a_run_whose_checkpoints_are_all_corrupt_is_not_started_again_silently(tiny_config, tmp_path):
    train_and_evaluate(tiny_config, tmp_path, stop_after_steps=4)  # checkpoints 3 and 4
    for step in (3, 4):
        chunk = max((tmp_path / "checkpoints" / str(step) / "state").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
    quarantine = tmp_path / "corrupt_checkpoints"
    with pytest.raises(integrity.CorruptCheckpointError, match="no intact checkpoint .* The run cannot resume: .* --force-new"):
        train_and_evaluate(tiny_config, tmp_path)
    assert sorted(p.name.split("-")[0] for p in quarantine.iterdir()) == ["3", "4"] and _steps(tmp_path) == []
    logged = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RunMismatchError, match=rf"holds a run whose checkpoints were all found corrupt \(moved to {quarantine}\): it cannot resume"):
        train_and_evaluate(tiny_config, tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == logged  # the run's metrics kept as they were
    summary = train_and_evaluate(tiny_config, tmp_path, force_new=True)  # the remedy the refusal names
    assert summary["finished"] and not quarantine.exists()
    (archived,) = (tmp_path / "previous_runs").iterdir()
    assert sorted(p.name.split("-")[0] for p in (archived / "corrupt_checkpoints").iterdir()) == ["3", "4"]


def test_resumed_run_logs_each_step_once_and_eval_once_in_tensorboard(tiny_config, tmp_path, capsys):
    train_and_evaluate(tiny_config, tmp_path, stop_after_steps=4)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a start killed after logging step 5, before its checkpoint
        f.write(json.dumps({"step": 5, "kind": "train", "loss": 9.0}) + "\n")
    train_and_evaluate(tiny_config, tmp_path)
    assert "resuming from step 4 (" in capsys.readouterr().out
    train = [r for r in _records(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert train[-1]["learning_rate"] == pytest.approx(0.00815, rel=1e-3)  # warmup 2 steps to 1e-2, then cosine
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "eval/auc_like" in tags and "summary/auc_like" not in tags and "summary/train_examples_per_s" in tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


def test_held_workdir_and_lowered_num_steps_are_refused(tiny_config, tmp_path):
    train_and_evaluate(tiny_config, tmp_path, stop_after_steps=4)
    with WorkdirLock(tmp_path):
        with pytest.raises(WorkdirLockedError, match="in use by another run"):
            train_and_evaluate(tiny_config, tmp_path)
    lowered = config_tree.apply_overrides(tiny_config, ["loop.num_steps=3"])
    with pytest.raises(RunMismatchError, match="loop.num_steps=3 is below the newest checkpoint, step 4"):
        train_and_evaluate(lowered, tmp_path)
    assert _steps(tmp_path) == [3, 4]


def test_a_full_disk_ends_the_run_with_its_summary_and_a_restart_resumes(tiny_config, tmp_path, monkeypatch, capsys):
    """A save whose background write hits ENOSPC ends the run (CheckpointWriteError) with a summary of what was
    saved; the last good step stays intact, and the same command with space again resumes from it and finishes.
    (`test_checkpoint_saves.py` checks the restored arrays bit for bit.)"""
    config = config_tree.apply_overrides(tiny_config, ["checkpoint.every_steps=2", "checkpoint.max_to_keep=2", "loop.log_every=2"])
    estimate, full = serialization.estimate_write_memory_footprint, []
    save = Checkpointer.save

    def counted_save(self, step, *args, **kwargs):
        if step > 2 and not full:  # step 2 is written whole; the disk fills up after it
            self.wait()
            full.append(step)
        return save(self, step, *args, **kwargs)

    def fills_up(value):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return estimate(value)

    monkeypatch.setattr(Checkpointer, "save", counted_save)
    monkeypatch.setattr(serialization, "estimate_write_memory_footprint", fills_up)
    with pytest.raises(CheckpointWriteError, match="could not be written: the disk is full") as failed:
        train_and_evaluate(config, tmp_path)
    assert failed.value.last_good_step == 2 and _steps(tmp_path) == [2]
    summary = _records(tmp_path)[-1]
    assert summary["kind"] == "summary" and not summary["finished"] and summary["last_good_step"] == 2
    assert "the disk is full" in summary["checkpoint_error"] and summary["checkpoint_saves"] >= 1
    assert integrity.verify(tmp_path / "checkpoints" / "2") == []
    assert not (tmp_path / ".lock.0").exists()

    monkeypatch.setattr(serialization, "estimate_write_memory_footprint", estimate)  # space again
    capsys.readouterr()
    again = train_and_evaluate(config, tmp_path)
    assert "resuming from step 2" in capsys.readouterr().out
    assert again["finished"] and again["step"] == config.loop.num_steps and _steps(tmp_path)[-1] == config.loop.num_steps
