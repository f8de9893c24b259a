"""benchmarks/train_bench.py end to end on the CPU with the tiny GEM-width layout."""

import json

import numpy as np


def test_train_bench_writes_comparable_json_with_peer_and_skipped_profile(repo_root, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import train_bench

    out = tmp_path / "step.json"
    train_bench.main([
        "--config", str(repo_root / "configs" / "gem_h200_tiny.py"), "--devices", "1", "--per-device-batch", "16",
        "--steps", "2", "--warmup", "1", "--attention", "xla", "padded", "--profile", "--out", str(out),
        "--set", "optim.learning_rate=0.002",
    ])
    record = json.loads(out.read_text())
    for key in ("config", "model", "max_seq_len", "runs", "git_commit", "date", "time_to_first_step_s", "peers"):
        assert key in record, key
    assert record["attention"] == "xla" and record["max_seq_len"] == 16
    assert record["overrides"] == ["optim.learning_rate=0.002"]
    (run,) = record["runs"]
    for key in ("num_devices", "median_step_s", "mfu_per_device", "peak_bytes_in_use_device0", "slack_fraction_mean", "compile_s", "setup_to_first_step_s"):
        assert key in run, key
    assert run["num_devices"] == 1 and run["median_step_s"] > 0 and np.isfinite(run["loss_first_last"]).all()
    assert run["remat_plan"] is None  # no rematerialization asked for
    assert 0 <= run["slack_fraction_mean"] <= run["slack_fraction_max"] < 1 and run["setup_to_first_step_s"] >= run["first_step_s"] > 0
    assert "need a GPU" in run["profile"]["skipped"]
    memory = run["compiled_memory_bytes"]
    assert memory["temp"] > 0 and memory["argument"] > 0
    assert memory["peak_estimate"] == memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    peer = record["peers"]["padded"]
    assert peer["attention_implementation"] == "cudnn"
    assert peer["runs"] or peer["errors"]  # cuDNN attention needs a GPU: an error here, recorded
    assert "--profile skipped" in capsys.readouterr().out


def test_speedup_is_peer_step_over_ours_for_shared_device_counts(repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import train_bench

    ours = [{"num_devices": 1, "median_step_s": 0.2}, {"num_devices": 2, "median_step_s": 0.25}]
    peer = [{"num_devices": 1, "median_step_s": 0.5}]
    assert train_bench.speedups(ours, peer) == {"1": 2.5}
