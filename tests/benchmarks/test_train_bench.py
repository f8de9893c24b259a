"""benchmarks/train_bench.py on the CPU: end to end with the tiny GEM-width layout, and --fit-batch with fake runs."""

import json

import numpy as np
import pytest


def test_train_bench_writes_comparable_json_with_peer_and_skipped_profile(repo_root, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import train_bench

    out = tmp_path / "step.json"
    train_bench.main([
        "--config", str(repo_root / "configs" / "gem_h200_tiny.py"), "--devices", "1", "--per-device-batch", "16",
        "--steps", "2", "--warmup", "1", "--attention", "xla", "padded", "--profile", "--out", str(out),
        "--set", "optim.learning_rate=0.002", "--set", "loop.log_every=7",  # repeated --set options all apply
    ])
    record = json.loads(out.read_text())
    for key in ("config", "model", "max_seq_len", "runs", "git_commit", "date", "time_to_first_step_s", "peers"):
        assert key in record, key
    assert record["attention"] == "xla" and record["max_seq_len"] == 16
    assert record["overrides"] == ["optim.learning_rate=0.002", "loop.log_every=7"]
    (run,) = record["runs"]
    for key in ("num_devices", "median_step_s", "mfu_per_device", "peak_bytes_in_use_device0", "slack_fraction_mean", "compile_s", "setup_to_first_step_s"):
        assert key in run, key
    assert run["num_devices"] == 1 and run["median_step_s"] > 0 and np.isfinite(run["loss_first_last"]).all()
    assert run["pipelined_step_s"] > 0 and run["pipelined_mfu_per_device"] is None and record["local_mfu_pipelined"] is None  # no CPU peak
    assert 0 < run["pipelined_dispatch_min_s"] <= run["pipelined_dispatch_s"] < 2 * run["pipelined_step_s"]  # over the 2 dispatched steps
    assert 0 < run["pipelined_steady_step_s"] < 2 * run["pipelined_step_s"]  # the second step alone, from the first's end
    assert run["remat_plan"] is None  # no rematerialization asked for
    assert run["per_device_batch"] == 16 and run["failed_tries"] == [] and record["fit_batch"] is False
    device = run["device_memory_bytes"]
    assert device["limit"] is None and device["resident"] is None  # the CPU reports no memory statistics
    assert 0 < device["gradients"] < run["compiled_memory_bytes"]["argument"]  # float32 gradients of part of the state
    assert 0 <= run["slack_fraction_mean"] <= run["slack_fraction_max"] < 1 and run["setup_to_first_step_s"] >= run["first_step_s"] > 0
    assert "need a GPU" in run["profile"]["skipped"]
    memory = run["compiled_memory_bytes"]
    assert memory["temp"] > 0 and memory["argument"] > 0
    assert memory["peak_estimate"] == memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    peer = record["peers"]["padded"]
    assert peer["attention_implementation"] == "cudnn"
    assert record["model"]["norm_implementation"] == peer["model"]["norm_implementation"] == "XLA"  # flax's RMSNorm
    assert peer["runs"] or peer["errors"]  # cuDNN attention needs a GPU: an error here, recorded
    assert all(error["failed_tries"] == [] for error in peer["errors"])  # not out of memory
    assert "--profile skipped" in capsys.readouterr().out


def test_speedup_is_peer_step_over_ours_for_shared_device_counts(repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import train_bench

    ours = [{"num_devices": 1, "median_step_s": 0.2, "pipelined_step_s": 0.19, "global_batch": 64}, {"num_devices": 2, "median_step_s": 0.25, "global_batch": 128}]
    peer = [{"num_devices": 1, "median_step_s": 0.5, "pipelined_step_s": 0.475, "global_batch": 64}]
    assert train_bench.speedups(ours, peer) == {"1": 2.5}
    assert train_bench.speedups(ours, peer, "pipelined_step_s") == {"1": pytest.approx(2.5)}
    peer = [{"num_devices": 1, "median_step_s": 0.5, "global_batch": 32}]
    assert train_bench.speedups(ours, peer) == {"1": None}  # step times of different batches are no speedup


# --fit-batch: reading XLA's out-of-memory messages, the batch derived from them, and the tries.

GB = 1_000_000_000


@pytest.fixture
def train_bench(repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import train_bench

    return train_bench


@pytest.fixture
def fit_batch(repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import _fit_batch

    return _fit_batch


@pytest.mark.parametrize(
    "message, expected",
    [
        # the GPU allocator's form (jaxlib 0.11); 27.81 * 2**30 = 29,860,760,125.44
        (
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 27.81GiB with allocator GPU_0_bfc on device 0.\n"
            "[executable_name='jit_train_step'] [tf-allocator-allocation-error='']",
            29_860_760_125,
        ),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 896.00MiB with allocator GPU_0_bfc on device 0.", 896 * 2**20),
        ("PJRT_Event_Await failed: Out of memory while trying to allocate 512.0KiB with allocator GPU_0_bfc on device 0.", 524_288),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.50TiB with allocator GPU_0_bfc on device 0.", 1_649_267_441_664),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1000B with allocator GPU_0_bfc on device 0.", 1000),
        # the byte form, followed by XLA's buffer-assignment report, whose sizes are not the allocation asked
        (
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4770354232 bytes.\nBufferAssignment OOM Debugging.\n"
            "BufferAssignment stats:\n             parameter allocation:  372.76MiB\n     preallocated temp allocation:    4.44GiB\n",
            4_770_354_232,
        ),
    ],
)
def test_asked_bytes_reads_the_allocation_xla_names(train_bench, message, expected, fit_batch):
    assert fit_batch.asked_bytes(message) == expected


@pytest.mark.parametrize(
    "message",
    [
        "RESOURCE_EXHAUSTED: Allocating 308153679872 bytes exceeds the memory limit of 4294967296 bytes.",
        "RESOURCE_EXHAUSTED: Out of memory",
        "INTERNAL: Failed to launch CUDA kernel",
    ],
)
def test_asked_bytes_refuses_a_message_without_an_allocation_naming_it(train_bench, message, fit_batch):
    with pytest.raises(ValueError, match="no allocation size in this out-of-memory message") as refused:
        fit_batch.asked_bytes(message)
    assert message[:40] in str(refused.value)


def test_largest_fitting_batch_by_hand(train_bench, fit_batch):
    memory = fit_batch.DeviceMemory(limit=1000, resident=300, gradients=100)
    # per example (900 - 100) / 64 = 12.5; (1000 - 300 - 100) / 12.5 = 48; with 5% headroom (950 - 400) / 12.5 = 44
    assert fit_batch.largest_fitting_batch(64, 900, memory, headroom=0.0) == 48
    assert fit_batch.largest_fitting_batch(64, 900, memory) == 44
    # an H200-sized case: 287 GiB asked at 1024 examples, 45 GB resident, 9 GB of gradients, a 135 GB limit:
    # per example (308,163,231,744 - 9e9) / 1024 = 292,152,249.5; 0.95 * 135e9 - 54e9 = 74.25e9; 74.25e9 / 292,152,249.5 = 254.15
    h200 = fit_batch.DeviceMemory(limit=135 * GB, resident=45 * GB, gradients=9 * GB)
    assert fit_batch.largest_fitting_batch(1024, 287 * 2**30, h200) == 254


def test_largest_fitting_batch_refuses_what_its_model_cannot_explain(train_bench, fit_batch):
    memory = fit_batch.DeviceMemory(limit=1000, resident=300, gradients=100)
    with pytest.raises(ValueError, match="no memory limit"):
        fit_batch.largest_fitting_batch(64, 900, fit_batch.DeviceMemory(limit=None, resident=None, gradients=100))
    with pytest.raises(ValueError, match="does not explain"):  # no larger than the gradients
        fit_batch.largest_fitting_batch(64, 100, memory)
    with pytest.raises(ValueError, match="does not explain"):  # 300 + 700 fits the limit
        fit_batch.largest_fitting_batch(64, 700, memory)
    with pytest.raises(ValueError, match="no batch fits"):  # 0.95 * 1000 - 900 - 40 = 10 < one example's 15.6
        fit_batch.largest_fitting_batch(64, 1040, fit_batch.DeviceMemory(limit=1000, resident=900, gradients=40))


def test_valid_batch_at_most_takes_the_job_s_own_batch_checks(train_bench, fit_batch):
    from gem_jax.data.config import BBSConfig, DataConfig

    plain, balanced = DataConfig(batch_size=8), DataConfig(batch_size=8, bbs=BBSConfig())
    assert fit_batch.valid_batch_at_most(273, 1, plain) == 273
    assert fit_batch.valid_batch_at_most(273, 2, plain) == 273
    assert fit_batch.valid_batch_at_most(273, 1, balanced) == 273  # one shard: BBS deals no pairs across devices
    assert fit_batch.valid_batch_at_most(273, 2, balanced) == 272  # BBS over 2 devices needs an even batch each
    with pytest.raises(ValueError, match="no per-device batch from 1 down to 1"):
        fit_batch.valid_batch_at_most(1, 2, balanced)


def _world(fit_batch, temp_bytes, step_s=0.5, hidden=0):
    """A fake `run` on a device of 140 GB (45 GB resident, 9 GB of gradients): its step at b examples asks
    `temp_bytes(b)` at once and runs out when resident + that + `hidden` (bytes the model cannot see) pass
    the limit, as XLA's allocator reports it; otherwise it returns a run of `step_s` seconds. `tries` lists
    the batches tried."""
    memory = fit_batch.DeviceMemory(limit=140 * GB, resident=45 * GB, gradients=9 * GB)
    tries = []

    def run(config, num_devices, per_device_batch, steps, warmup, num_batches, profile):
        tries.append(per_device_batch)
        asked = temp_bytes(per_device_batch)
        if memory.resident + asked + hidden > memory.limit:
            message = f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {asked} bytes."
            raise fit_batch.StepOutOfMemory(per_device_batch, message, memory)
        return {
            "num_devices": num_devices, "per_device_batch": per_device_batch, "global_batch": per_device_batch * num_devices,
            "median_step_s": step_s, "examples_per_s": per_device_batch * num_devices / step_s, "mfu_per_device": None,
            "pipelined_step_s": step_s, "pipelined_mfu_per_device": None,
            "loss_first_last": [1.0, 1.0], "process_age_at_first_step_s": 1.0,
        }

    return run, tries


def _args(fit_batch=True, per_device_batch=1024):
    import argparse

    return argparse.Namespace(per_device_batch=per_device_batch, fit_batch=fit_batch, steps=1, warmup=1, num_batches=1, profile=False)


def _tiny_config(repo_root):
    from gem_jax.train.config import load_config

    return load_config(repo_root / "configs" / "gem_h200_tiny.py")


def test_fit_retries_once_at_the_batch_derived_from_the_message(train_bench, repo_root, monkeypatch, fit_batch):
    run, tries = _world(fit_batch, lambda b: 9 * GB + 250_000_000 * b)
    monkeypatch.setattr(train_bench, "run", run)
    result = train_bench.run_fitting_batch(_tiny_config(repo_root), 1, _args())
    # 1024 asks 9e9 + 256e9 = 265e9 (45e9 + 265e9 > 140e9); per example 256e9 / 1024 = 250e6;
    # (0.95 * 140e9 - 45e9 - 9e9) / 250e6 = 79e9 / 250e6 = 316, which asks 88e9: 133e9 fits
    assert tries == [1024, 316] and result["per_device_batch"] == 316
    (failed,) = result["failed_tries"]
    assert failed["per_device_batch"] == 1024 and failed["asked_bytes"] == 265 * GB and failed["derived_per_device_batch"] == 316
    assert failed["device_memory_bytes"] == {"limit": 140 * GB, "resident": 45 * GB, "gradients": 9 * GB}


def test_fit_derives_again_from_the_second_message(train_bench, repo_root, monkeypatch, fit_batch):
    # above 250 examples the step takes 30 GB more (a larger token capacity, say): the first estimate misses it
    run, tries = _world(fit_batch, lambda b: 9 * GB + 250_000_000 * b + (30 * GB if b > 250 else 0))
    monkeypatch.setattr(train_bench, "run", run)
    result = train_bench.run_fitting_batch(_tiny_config(repo_root), 1, _args())
    # 1024 asks 295e9: per example 286e9 / 1024 = 279,296,875, 79e9 / that = 282.9 -> 282;
    # 282 asks 9e9 + 70.5e9 + 30e9 = 109.5e9 (154.5e9 > 140e9): per example 100.5e9 / 282 = 356,382,979, 79e9 / that = 221.7 -> 221
    assert tries == [1024, 282, 221] and result["per_device_batch"] == 221
    assert [(t["per_device_batch"], t["asked_bytes"], t["derived_per_device_batch"]) for t in result["failed_tries"]] == [
        (1024, 295 * GB, 282), (282, 109_500_000_000, 221),
    ]


def test_fit_stops_after_max_tries_or_where_nothing_follows(train_bench, repo_root, monkeypatch, fit_batch):
    config = _tiny_config(repo_root)
    run, tries = _world(fit_batch, lambda b: 9 * GB + 250_000_000 * b + (30 * GB if b > 250 else 0))
    monkeypatch.setattr(train_bench, "run", run)
    monkeypatch.setattr(train_bench, "MAX_TRIES", 2)
    with pytest.raises(fit_batch.BatchFitError, match=r"every per-device batch tried: 1024 \(asked 295 GB\), 282 \(asked 110 GB\)") as failed:
        train_bench.run_fitting_batch(config, 1, _args())
    assert tries == [1024, 282] and [t["per_device_batch"] for t in failed.value.failed_tries] == [1024, 282]

    # without --fit-batch: one try, its derived batch recorded but not run
    run, tries = _world(fit_batch, lambda b: 9 * GB + 250_000_000 * b)
    monkeypatch.setattr(train_bench, "run", run)
    with pytest.raises(fit_batch.BatchFitError) as failed:
        train_bench.run_fitting_batch(config, 1, _args(fit_batch=False))
    assert tries == [1024] and failed.value.failed_tries[0]["derived_per_device_batch"] == 316

    # 10 GB the model cannot see: 316 asks 88e9, and 45e9 + 88e9 fits the limit, so the message explains nothing
    run, tries = _world(fit_batch, lambda b: 9 * GB + 250_000_000 * b, hidden=10 * GB)
    monkeypatch.setattr(train_bench, "run", run)
    with pytest.raises(fit_batch.BatchFitError, match="does not explain running out") as failed:
        train_bench.run_fitting_batch(config, 1, _args())
    assert tries == [1024, 316] and failed.value.failed_tries[-1]["derived_per_device_batch"] is None

    # a message without a size: recorded, nothing derived
    def unreadable(config, num_devices, per_device_batch, *rest):
        message = "RESOURCE_EXHAUSTED: Allocating 308153679872 bytes exceeds the memory limit of 4294967296 bytes."
        raise fit_batch.StepOutOfMemory(per_device_batch, message, fit_batch.DeviceMemory(140 * GB, 45 * GB, 9 * GB))

    monkeypatch.setattr(train_bench, "run", unreadable)
    with pytest.raises(fit_batch.BatchFitError, match="no allocation size in this out-of-memory message") as failed:
        train_bench.run_fitting_batch(config, 1, _args())
    (record,) = failed.value.failed_tries
    assert record["asked_bytes"] is None and record["derived_per_device_batch"] is None and "Allocating 308153679872" in record["no_derived_batch"]


def test_the_record_compares_each_mode_at_the_batch_it_ran(train_bench, repo_root, tmp_path, monkeypatch, fit_batch):
    from pallas_kernels import Implementation

    ours, _ = _world(fit_batch, lambda b: 9 * GB + 50_000_000 * b, step_s=0.5)  # 1024 asks 60.2e9: fits
    peer, peer_tries = _world(fit_batch, lambda b: 9 * GB + 250_000_000 * b, step_s=0.4)  # fits at 316 (above)

    def run(config, *args):
        return (peer if config.model.attention_implementation == Implementation.CUDNN else ours)(config, *args)

    monkeypatch.setattr(train_bench, "run", run)
    out = tmp_path / "fit.json"
    train_bench.main([
        "--config", str(repo_root / "configs" / "gem_h200_tiny.py"), "--devices", "1", "--per-device-batch", "1024",
        "--attention", "xla", "padded", "--fit-batch", "--out", str(out),
    ])
    record = json.loads(out.read_text())
    assert record["fit_batch"] is True and peer_tries == [1024, 316]
    (our_run,) = record["runs"]
    (peer_run,) = record["peers"]["padded"]["runs"]
    assert our_run["per_device_batch"] == 1024 and our_run["failed_tries"] == []
    assert peer_run["per_device_batch"] == 316 and [t["asked_bytes"] for t in peer_run["failed_tries"]] == [265 * GB]
    # ours 1024 / 0.5 s = 2048 examples/s, the peer's 316 / 0.4 s = 790: 2.592x; no step-time speedup across batches
    assert record["examples_per_s_vs_padded_peer"] == {"1": pytest.approx(2048 / 790)}
    assert our_run["examples_per_s_vs_padded_peer"] == pytest.approx(2048 / 790)
    assert record["speedup_vs_padded_peer"] == {"1": None} and our_run["speedup_vs_padded_peer"] is None


def test_scaling_compares_device_counts_only_at_the_same_per_device_batch(train_bench):
    def run(n, batch, examples_per_s):
        return {"num_devices": n, "per_device_batch": batch, "examples_per_s": examples_per_s, "mfu_per_device": 0.4, "pipelined_mfu_per_device": 0.42}

    record = {"runs": [run(1, 1024, 1000.0), run(2, 1024, 1800.0), run(4, 512, 3000.0)]}
    train_bench.add_scaling(record)
    assert record["local_mfu"] == 0.4 and record["local_mfu_pipelined"] == 0.42
    assert record["scaling_ratio_2"] == pytest.approx(0.9) and record["e2e_mfu_2"] == pytest.approx(0.36)
    assert record["scaling_ratio_4"] is None and record["e2e_mfu_4"] is None


def test_both_step_times_give_their_mfu_from_the_same_flop_count(repo_root, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import train_bench

    peak = 1e12  # a made-up device peak (FLOP/s): the CPU has none
    monkeypatch.setattr(train_bench.flops_lib, "peak_flops", lambda *args: peak)
    out = tmp_path / "step.json"
    train_bench.main([
        "--config", str(repo_root / "configs" / "gem_h200_tiny.py"), "--devices", "1", "--per-device-batch", "16",
        "--steps", "2", "--warmup", "1", "--attention", "xla", "--out", str(out),
    ])
    record = json.loads(out.read_text())
    (run,) = record["runs"]
    flops = run["model_tflops_per_step"] * 1e12
    assert run["mfu_per_device"] == pytest.approx(flops / run["median_step_s"] / peak)
    assert run["pipelined_mfu_per_device"] == pytest.approx(flops / run["pipelined_step_s"] / peak)
    assert record["local_mfu"] == run["mfu_per_device"] and record["local_mfu_pipelined"] == run["pipelined_mfu_per_device"]


def test_idle_step_traces_steps_back_to_back_threading_the_state(train_bench, monkeypatch):
    calls = []

    def train_step(state, batch):
        calls.append((state, batch))
        return state + 1, {"loss": 0.0}

    def traced(run):  # no GPU here: a timeline of two kernels pairs with a gap between them
        return run(), [("fusion", 0.0, 100.0), ("nvjet_gemm", 100.0, 50.0), ("fusion", 400.0, 100.0), ("nvjet_gemm", 500.0, 50.0)]

    monkeypatch.setattr(train_bench._timing, "traced_device_activities", traced)
    state, idle = train_bench.idle_step(train_step, 10, ["a", "b"])
    assert calls == [(10, "a"), (11, "b"), (12, "a")][: train_bench.IDLE_STEPS] and state == 10 + train_bench.IDLE_STEPS
    assert idle["steps_traced"] == train_bench.IDLE_STEPS
    assert idle["span_ms"] == pytest.approx(0.55) and idle["idle_ms"] == pytest.approx(0.25)
    assert idle["longest_gaps"][0] == {"us": pytest.approx(250.0), "before": "nvjet_gemm", "after": "fusion"}


def test_time_when_ready_gives_when_the_tree_was_ready_or_raises_its_error(train_bench, monkeypatch):
    import time

    import jax.numpy as jnp

    before = time.perf_counter()
    join = train_bench.time_when_ready({"loss": jnp.ones(3) * 2})
    assert before <= join() <= time.perf_counter()

    def fail(tree):
        raise RuntimeError("the step failed")

    monkeypatch.setattr(train_bench.jax, "block_until_ready", fail)
    with pytest.raises(RuntimeError, match="the step failed"):
        train_bench.time_when_ready({"loss": jnp.ones(3)})()
