"""Two CPU processes through `jax.distributed` on loopback (gloo): train, checkpoint, restore, replay; per-process
input (each process builds its share of every batch; different data sets are refused; uneven epochs and eval
sets end on both processes; the same losses as one process).

Every process runs under `timeout -k 5` (conftest): a hang fails the test."""

import json
import socket

import numpy as np
import pytest

from event_logs import convert_event_log, write_event_log

pytestmark = pytest.mark.multidevice


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_envs() -> list[dict]:
    """The GEM_* variables of two `jax.distributed` processes on loopback."""
    port = free_port()
    return [{"GEM_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "GEM_NUM_PROCESSES": "2", "GEM_PROCESS_ID": str(pid)} for pid in range(2)]


def test_two_processes_train_checkpoint_and_restore(start_worker, tmp_path):
    outs = [tmp_path / f"process{pid}.json" for pid in range(2)]
    procs = [start_worker("process", out, tmp_path / "ckpt", devices=2, **env) for out, env in zip(outs, process_envs())]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    reports = [json.loads(o.read_text()) for o in outs]
    for pid, r in enumerate(reports):
        assert r["source"] == "explicit" and r["process_index"] == pid and r["process_count"] == 2
        assert r["devices"] == 4 and r["local_devices"] == 2
        assert len(r["losses"]) == 3 and np.isfinite(r["losses"]).all()
        assert r["replay"] == r["losses"][2:]  # step 3 after restoring step 2: bit-exact
    assert reports[0]["losses"] == reports[1]["losses"]  # one global computation


def test_processes_with_different_data_sets_are_refused(start_cli, repo_root, tmp_path):
    """Process 1's data set has 70 train examples, process 0's 80: both stop at start-up with exit 2, naming process 1."""
    procs = [
        start_cli(
            "--config", repo_root / "configs" / "gem_sharded_tiny.py", "--workdir", tmp_path / "run", "--no-progress", "--compile-cache", "off",
            "--set", "topology.zones=1", f"data.synthetic.num_train_examples={n}", devices=2, timeout=300, **env,
        )
        for n, env in zip((80, 70), process_envs())
    ]
    logs = [p.communicate(timeout=330)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 2, log[-4000:]
        assert "the processes hold different data sets" in log
        assert "process 1: fingerprint differs, num_train_examples 70 (process 0: 80)" in log
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_force_new_moves_the_earlier_run_once(start_cli, repo_root, tmp_path):
    """Two processes sharing a workdir with `--force-new`: process 0 moves the earlier run, once, before either
    reads the workdir (both then stop at the data-set check, which differing data sets make them fail fast)."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "run.json"):
        (run / name).write_text("{}\n")
    procs = [
        start_cli(
            "--config", repo_root / "configs" / "gem_sharded_tiny.py", "--workdir", run, "--no-progress", "--compile-cache", "off", "--force-new",
            "--set", "topology.zones=1", f"data.synthetic.num_train_examples={n}", devices=2, timeout=300, **env,
        )
        for n, env in zip((80, 70), process_envs())
    ]
    logs = [p.communicate(timeout=330)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 2 and "the processes hold different data sets" in log, log[-4000:]
    (archive,) = (run / "previous_runs").iterdir()
    assert sorted(p.name for p in archive.iterdir()) == ["metrics.jsonl", "run.json"]
    assert "was moved to" in logs[0] and "was moved to" not in logs[1]


@pytest.mark.parametrize("source", ["synthetic", "events"])
def test_two_processes_run_an_uneven_epoch_like_one_process(start_worker, run_worker, tmp_path, source):
    """One epoch of 70 examples in global batches of 32 (the last batch's 6 real examples all on process 0's
    devices) and an eval set of 52 (the last batch 20): both processes finish every step and eval batch; each
    built a disjoint share of the examples, together all of them; the losses and eval metrics are those of one
    process running the same global batches on 4 devices. The synthetic source, and an own event log of 70
    train and 52 eval events converted into 3 shard files (each process reads only the records of its own examples)."""
    data = []
    if source == "events":
        write_event_log(tmp_path / "events", num_train=70, num_eval=52)
        data = [convert_event_log(tmp_path / "events", tmp_path / "converted").out]
    outs = [tmp_path / f"loop{pid}.json" for pid in range(2)]
    procs = [start_worker("loop", out, tmp_path / "two", *data, devices=2, timeout=600, **env) for out, env in zip(outs, process_envs())]
    logs = [p.communicate(timeout=630)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    reports = [json.loads(o.read_text()) for o in outs]
    one = run_worker("loop", tmp_path, tmp_path / "one", *data, devices=4, timeout=600)

    assert [r["process_index"] for r in reports] == [0, 1] and one["process_count"] == 1
    for kind, total, calls in (("train", 70, 3), ("eval", 52, 2)):
        shares = [np.concatenate([np.asarray(c, np.int64) for c in r[kind]]) for r in reports]
        assert [len(r[kind]) for r in reports] == [calls, calls]  # every step on both processes
        assert not set(shares[0].tolist()) & set(shares[1].tolist())
        np.testing.assert_array_equal(np.sort(np.concatenate(shares)), np.arange(total))
    assert [len(c) for c in reports[1]["train"]] == [16, 16, 0]  # padding only in the last batch
    assert [len(c) for c in reports[1]["eval"]] == [16, 4]

    two_train, one_train = (train_losses(tmp_path / name) for name in ("two", "one"))
    assert len(two_train) == 3
    # The same global batch and parameters, so the same per-device sums: the loss is psum(weighted BCE) /
    # psum(weight) over the 4 devices, and the cross-process all-reduce may add the 4 positive partial sums in
    # another order than the in-process one. Each order is within 3u of the exact sum (u = 2^-24), so the two
    # differ by at most 6u in the numerator and 6u in the denominator: 12u in the loss (measured: 1 ulp, 2u,
    # with the event log's weights on one CPU; bit for bit with the synthetic source's on it).
    np.testing.assert_allclose(two_train[0], one_train[0], rtol=12 * np.finfo(np.float32).eps / 2, atol=0)
    # Later steps: gradient sums in another order (float32, a few u per parameter) move the loss by ~1e-7 per step.
    np.testing.assert_allclose(two_train, one_train, rtol=1e-5, atol=0)
    for key in ("eval_examples", "auc_click", "ne_click", "baseline_auc_click"):
        assert reports[0]["summary"][key] == reports[1]["summary"][key]
        np.testing.assert_allclose(reports[0]["summary"][key], one["summary"][key], rtol=1e-6)  # float64 metric sums
    assert reports[0]["summary"]["eval_examples"] == 52


def train_losses(workdir) -> list[float]:
    """The train records' losses of `workdir/metrics.jsonl`, in step order (written by process 0 alone)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    return [r["loss"] for r in train]
