"""Unit tests of the robustness pieces: workdir lock, checksum manifests, config validation, run identity, train line."""

import json
import os
import socket
import subprocess
import sys

import pytest

from gem_jax.data.config import DataConfig
from gem_jax.train import config_tree, integrity, run_record
from gem_jax.train.checkpoint import CheckpointConfig, Checkpointer
from gem_jax.train.config import LoopConfig, TrainConfig
from gem_jax.train.metric_log import MetricLogger, eval_line, train_line
from gem_jax.train.optimizer import OptimConfig, learning_rate_schedule
from gem_jax.train.workdir_lock import WorkdirLock, WorkdirLockedError


# ---------------------------------------------------------------- workdir lock


def test_second_holder_is_refused_and_the_lock_is_released(tmp_path):
    with WorkdirLock(tmp_path) as lock:
        assert lock.path.read_text().split() == [socket.gethostname(), str(os.getpid())]
        with pytest.raises(WorkdirLockedError, match=f"in use by another run \\(process {os.getpid()} on this host"):
            WorkdirLock(tmp_path).__enter__()
    assert not lock.path.exists()
    with WorkdirLock(tmp_path):  # free again
        pass


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (tmp_path / ".lock.0").write_text(f"{socket.gethostname()} {dead}\n")
    with WorkdirLock(tmp_path) as lock:
        assert lock.path.read_text().split()[1] == str(os.getpid())
    assert f"stale lock {tmp_path / '.lock.0'} of process {dead}" in capsys.readouterr().err


def test_lock_of_another_host_is_refused_with_the_file_to_remove(tmp_path):
    (tmp_path / ".lock.0").write_text("other-host 123\n")
    with pytest.raises(WorkdirLockedError, match=f"process 123 on host other-host.*remove {tmp_path / '.lock.0'}"):
        WorkdirLock(tmp_path).__enter__()


def test_a_refused_start_removes_the_directories_the_lock_made_and_a_run_keeps_them(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.raises(ValueError, match="refused"):
        with WorkdirLock(tmp_path / "runs" / "a" / "b"):
            assert (tmp_path / "runs" / "a" / "b" / ".lock.0").exists()
            raise ValueError("refused")  # e.g. the data set is not found: nothing was written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())
    with WorkdirLock(tmp_path / "runs" / "a" / "b"):
        (tmp_path / "runs" / "a" / "b" / "run.json").write_text("{}")
    assert [p.name for p in (tmp_path / "runs" / "a" / "b").iterdir()] == ["run.json"]  # a run's files stay, the lock goes


def test_force_new_keeps_the_lock_in_place(tmp_path):
    with WorkdirLock(tmp_path) as lock:
        (tmp_path / "metrics.jsonl").write_text("{}\n")
        moved = run_record.start_new_run(tmp_path)
        assert (moved / "metrics.jsonl").exists() and lock.path.exists()


# ---------------------------------------------------------------- checksum manifests


def _step(tmp_path):
    step = tmp_path / "7"
    (step / "state" / "d").mkdir(parents=True)
    (step / "state" / "d" / "chunk").write_bytes(bytes(range(256)) * 4)
    (step / "commit_success.txt").write_text("ok")
    integrity.write_manifest(step)
    return step


def test_checkpoints_are_saved_every_n_steps_only(tmp_path):
    """No extra save after the first step of a new run (Orbax's default policy has one)."""
    checkpointer = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(every_steps=1000))
    assert [step for step in (1, 2, 999, 1000, 2000) if checkpointer.should_save(step)] == [1000, 2000]
    checkpointer.manager.close()


def test_intact_step_verifies(tmp_path):
    assert integrity.verify(_step(tmp_path)) == []


def test_two_flipped_bytes_are_found(tmp_path):
    step = _step(tmp_path)
    chunk = step / "state" / "d" / "chunk"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    data[101] ^= 0x01
    chunk.write_bytes(bytes(data))
    assert integrity.verify(step) == [f"{chunk}: contents changed since the save (sha256 mismatch)"]


def test_truncated_missing_and_added_files_are_named(tmp_path):
    step = _step(tmp_path)
    chunk = step / "state" / "d" / "chunk"
    chunk.write_bytes(chunk.read_bytes()[:10])
    (step / "commit_success.txt").unlink()
    (step / "extra").write_text("x")
    assert integrity.verify(step) == [
        f"{step / 'commit_success.txt'}: missing",
        f"{chunk}: 10 bytes, 1024 when saved",
        f"{step / 'extra'}: not part of the saved checkpoint",
    ]


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "build,error,fragment",
    [
        (lambda: LoopConfig(num_steps=-5), ValueError, "LoopConfig.num_steps must be >= 1, got -5"),
        (lambda: LoopConfig(log_every=0), ValueError, "LoopConfig.log_every must be >= 1, got 0"),
        (lambda: LoopConfig(num_steps="5"), TypeError, r"LoopConfig.num_steps must be an int, got '5' \(str\)"),
        (lambda: LoopConfig(eval_every=5.0), TypeError, r"LoopConfig.eval_every must be an int, got 5.0 \(float\)"),
        (lambda: CheckpointConfig(max_to_keep=0), ValueError, "CheckpointConfig.max_to_keep must be >= 1, got 0"),
        (lambda: CheckpointConfig(every_steps=True), TypeError, "CheckpointConfig.every_steps must be an int"),
        (lambda: OptimConfig(learning_rate="1e-3"), TypeError, r"OptimConfig.learning_rate must be a number, got '1e-3' \(str\)"),
        (lambda: OptimConfig(learning_rate=float("nan")), ValueError, "OptimConfig.learning_rate must be finite"),
        (lambda: OptimConfig(warmup_steps=2.5), TypeError, "OptimConfig.warmup_steps must be an int"),
        (lambda: DataConfig(batch_size="64"), TypeError, r"DataConfig.batch_size must be an int, got '64' \(str\)"),
        (lambda: DataConfig(seed=-1), ValueError, "DataConfig.seed must be >= 0"),
    ],
)
def test_config_fields_are_validated_by_name(build, error, fragment):
    with pytest.raises(error, match=fragment):
        build()


def test_override_with_a_bad_value_names_the_field():
    config = TrainConfig(data=DataConfig())
    with pytest.raises(config_tree.ConfigError, match="loop.log_every=0.*LoopConfig.log_every must be >= 1"):
        config_tree.apply_overrides(config, ["loop.log_every=0"])
    with pytest.raises(config_tree.ConfigError, match="loop.num_steps: expected an int, got 5.0"):
        config_tree.apply_overrides(config, ["loop.num_steps=5.0"])


# ---------------------------------------------------------------- run identity


@pytest.mark.parametrize(
    "override", ["data.batch_size=32", "data.seed=1", "model.embed_dim=16", "optim.moments_dtype=bfloat16", "optim.embedding_accumulator=element"]
)
def test_result_changing_fields_are_refused_on_restart(tmp_path, override):
    config = TrainConfig(data=DataConfig())
    run_record.check_run(tmp_path, run_record.make_record(config, {}, None), has_checkpoints=False)
    changed = config_tree.apply_overrides(config, [override])
    field, value = override.split("=")
    with pytest.raises(run_record.RunMismatchError, match=f"config.{field}: recorded .*, now '?{value}'?"):
        run_record.check_run(tmp_path, run_record.make_record(changed, {}, None), has_checkpoints=True)


def test_num_steps_below_the_newest_checkpoint_is_refused(tmp_path):
    with pytest.raises(run_record.RunMismatchError, match=r"loop.num_steps=45 is below the newest checkpoint, step 50"):
        run_record.check_num_steps(45, 50, tmp_path)
    run_record.check_num_steps(50, 50, tmp_path)
    run_record.check_num_steps(60, 50, tmp_path)
    run_record.check_num_steps(5, None, tmp_path)


# ---------------------------------------------------------------- logs


def test_train_line_is_short_and_shows_only_nonzero_counters():
    record = {
        "loss": 1.6441, "grad_norm": 3.433, "bce_like": 0.96, "ne_like": 1.436, "bce_love": 0.68,
        "ne_love": 1.416, "examples_per_s": 2.355, "tflops_per_s": 6.056e-07, "learning_rate": 0.005,
        "load_imbalance_mean": 0.0, "load_imbalance_max": 0.0, "slack_fraction": 0.07422,
        "embed/item/out_of_range": 0, "embed/item/overflow": 3, "embed/user/user/out_of_range": 0,
    }
    line = train_line(12, record, ["like", "love"])
    assert line == (
        "step 12: loss=1.6441 gnorm=3.43 lr=0.005 ne=1.436/1.416 ex/s=2.355 TFLOP/s=6.06e-07 "
        "imbalance=0.000/0.000 slack=7.4% embed/item/overflow=3"
    )


def test_an_undefined_ne_reads_n_a_in_the_lines_and_null_in_metrics_jsonl(tmp_path):
    """A window (or eval set) whose examples of a task are of one class has no NE: None, printed n/a, logged null."""
    record = {
        "loss": 0.7, "grad_norm": 1.0, "bce_like": 0.69, "ne_like": 1.355, "bce_love": 0.01, "ne_love": None,
        "examples_per_s": 2.0, "tflops_per_s": 1e-6, "learning_rate": 0.005,
        "load_imbalance_mean": 0.0, "load_imbalance_max": 0.0, "slack_fraction": 0.5,
    }
    assert train_line(3, record, ["like", "love"]).startswith("step 3: loss=0.7000 gnorm=1 lr=0.005 ne=1.355/n/a ex/s=2 ")
    evaluated = {"eval_examples": 4, "eval_positives_like": 2, "auc_like": 0.75, "ne_like": 0.9, "bce_like": 0.6,
                 "calibration_like": 1.0, "eval_positives_love": 0, "auc_love": None, "ne_love": None, "bce_love": 0.01,
                 "calibration_love": None}
    assert eval_line(8, evaluated, ["like", "love"]).splitlines() == [
        "step 8: auc_like=0.7500, ne_like=0.9000, bce_like=0.6000, calibration_like=1.0000, auc_love=n/a, ne_love=n/a, "
        "bce_love=0.0100, calibration_love=n/a",
        "step 8: eval: AUC and NE of task love are undefined: all 4 eval examples are labelled 0 (no positives)",
    ]
    logger = MetricLogger(tmp_path)
    logger.log(3, "train", record)
    logger.close()
    logged = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert logged["ne_love"] is None and logged["ne_like"] == 1.355


def test_learning_rate_schedule_warms_up_then_decays():
    schedule = learning_rate_schedule(OptimConfig(learning_rate=1e-2, warmup_steps=2, decay_steps=10))
    assert [float(schedule(k)) for k in (0, 1, 2)] == pytest.approx([0.0, 5e-3, 1e-2])
    assert float(schedule(12)) == pytest.approx(1e-3)


def test_resumed_logger_drops_records_of_replayed_steps(tmp_path):
    logger = MetricLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log(step, "train", {"loss": float(step)})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "kind": "tr')  # cut short by a kill
    MetricLogger(tmp_path, resume_step=2).close()
    assert [line[:11] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ['{"step": 1,', '{"step": 2,']
