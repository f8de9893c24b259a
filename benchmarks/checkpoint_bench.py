"""Checkpoint cost of a config's train state: blocking, write and restore seconds of save variants, host memory.

Builds the config's sharded train state (`gem_jax.train.setup_training`; `--values random`
fills it with random values, which compress like trained ones rather than like the
zeros of fresh optimizer moments) and drives the trainer's `Checkpointer` as the
training loop does, once per variant: `--steps` steps of `--step-seconds` each (a
jitted chain of matmuls on the device, so that background copies compete with device
work as in a run; `--sleep` sleeps instead), `should_save` / `save` at every step,
`checkpoint.every_steps` apart, then the final (forced) save and `wait`; then a restore
of the last step onto the state's shardings, timed apart from its checksum verification.

Variants (`--variants`, each on top of `--set`):

- `blocking`: `checkpoint.snapshot=off`, `save` blocks for Orbax's device-to-host copy;
- `snapshot`: `checkpoint.snapshot=on`, an on-device copy saved from a background thread;
- `uncompressed`: the snapshot with `checkpoint.compression=False`;
- `pageable`: blocking with `checkpoint.pinned_host=off` (Orbax's copy to pageable memory);
- `small_files`: the snapshot with `checkpoint.data_file_bytes=268435456` (256 MiB OCDBT files).

Before the variants, `--warmup` times one blocking save on its own: the process's first
save (Orbax's set-up, the first pinned host allocation) apart from the steady ones.
With `--one-copy` (default) each save first deletes the steps already written, so the
checkpoint folder (on `/dev/shm`: host memory) holds at most the copy being written.
Each variant's folder is deleted before the next.

Records per variant: the `Checkpointer.report()` and every save's record, the seconds of
each step (`step_s_quiet_mean`: no save in flight; `step_s_during_save_mean`: a save
copying or writing), the wait at the end (`final_wait_s`: the final write and its
checksum manifest), the checkpoint's size on disk, host RSS (before, peak, after) and
`MemAvailable`, and the restore (`verify_s`, `restore_s`, `restore_gb_per_s` of the
state's array bytes).

GPU (H200, 128 GB host memory, /dev/shm 128 GB), one call of ~6-8 minutes:

    PYTHONPATH=. python3 benchmarks/checkpoint_bench.py --config configs/gem_h200.py --dir /dev/shm/ckpt_bench \\
        --set optim.moments_dtype=bfloat16 checkpoint.every_steps=80 checkpoint.max_to_keep=1 \\
        --steps 240 --step-seconds 0.2 --variants blocking snapshot uncompressed \\
        --out benchmarks/results/checkpoint_variants_gem_h200_bf16.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp

from gem_jax.train import config_tree, disk_space, integrity, snapshot
from gem_jax.train.checkpoint import Checkpointer, host_memory_bytes
from gem_jax.train.config import load_config
from gem_jax.train.setup import setup_training

VARIANTS = {
    "blocking": ["checkpoint.snapshot=off"],
    "snapshot": ["checkpoint.snapshot=on"],
    "uncompressed": ["checkpoint.snapshot=on", "checkpoint.compression=False"],
    "pageable": ["checkpoint.snapshot=off", "checkpoint.pinned_host=off"],
    "small_files": ["checkpoint.snapshot=on", "checkpoint.data_file_bytes=268435456"],
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


class PeakRss:
    """Samples this process's RSS every `interval` seconds in a thread; `.peak` is the largest seen."""

    def __init__(self, interval: float = 0.02):
        self.peak, self._interval, self._stop = rss_bytes(), interval, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def du_bytes(path: Path) -> int:
    return int(subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def randomize(state, seed: int = 0):
    """`state` with every floating array replaced by normal(0, 0.02) values (donated: in place), placed alike."""

    def fill(tree):
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        return jax.tree.unflatten(
            treedef,
            [
                (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
                for k, x in zip(keys, leaves, strict=True)
            ],
        )

    shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
    return jax.block_until_ready(jax.jit(fill, out_shardings=shardings, donate_argnums=0)(state))


def device_step(seconds: float, sleep: bool):
    """A callable that takes about `seconds` of device time (a chain of 4096^2 matmuls), or sleeps."""
    if sleep:
        return lambda: time.sleep(seconds)
    x = jnp.ones((4096, 4096), jnp.bfloat16)

    def chain(n):
        return jax.jit(lambda a: jax.lax.fori_loop(0, n, lambda _, b: (a @ b) * 0.5, a))

    probe = chain(8)
    jax.block_until_ready(probe(x))
    start = time.perf_counter()
    jax.block_until_ready(probe(x))
    per_matmul = (time.perf_counter() - start) / 8
    program = chain(max(1, round(seconds / per_matmul)))
    jax.block_until_ready(program(x))
    return lambda: jax.block_until_ready(program(x))


def drop_steps(checkpointer: Checkpointer) -> None:
    """Deletes the finished steps (`--one-copy`: at most the copy being written stays on disk). Only
    between saves (no save in flight): then no other thread uses the manager."""
    for step in checkpointer.all_steps():
        checkpointer.manager.delete(step)


def run_variant(name, config, state, abstract, directory: Path, args, step) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    checkpointer = Checkpointer(directory, config.checkpoint)
    preflight = checkpointer.preflight(abstract)
    data = iter(grain.MapDataset.range(1 << 20).to_iter_dataset())
    rss_before, available_before = rss_bytes(), mem_available_bytes()
    quiet, during = [], []
    with PeakRss() as peak:
        for n in range(1, args.steps + 1):
            start = time.perf_counter()
            step()
            next(data)
            in_flight = bool(checkpointer.saves) and checkpointer.saves[-1].write_s is None  # not seen finished yet
            due = checkpointer.should_save(n)
            if due and args.one_copy:
                drop_steps(checkpointer)
            if due:
                checkpointer.save(n, state, data)
            (during if in_flight or due else quiet).append(time.perf_counter() - start)
        if checkpointer.latest_step() != args.steps:
            if args.one_copy:
                checkpointer.wait()
                drop_steps(checkpointer)
            checkpointer.save(args.steps, state, data, force=True)
        start = time.perf_counter()
        checkpointer.wait()
        final_wait = time.perf_counter() - start
    available_after_saves = mem_available_bytes()
    last = checkpointer.latest_step()
    path = checkpointer.step_path(last)
    record = {
        "overrides": VARIANTS[name],
        "preflight": preflight,
        "report": checkpointer.report(),
        "saves": [dataclasses.asdict(s) for s in checkpointer.saves],
        "deferred": checkpointer.deferred,
        "step_s_quiet_mean": sum(quiet) / len(quiet) if quiet else None,
        "step_s_during_save_mean": sum(during) / len(during) if during else None,
        "steps_during_save": len(during),
        "final_wait_s": final_wait,
        "du_bytes": du_bytes(path),
        "rss_before_bytes": rss_before,
        "rss_peak_bytes": peak.peak,
        "rss_after_bytes": rss_bytes(),
        "mem_available_before_bytes": available_before,
        "mem_available_after_saves_bytes": available_after_saves,
    }
    checkpointer.close()

    start = time.perf_counter()
    problems = integrity.verify(path)
    record["verify_s"] = time.perf_counter() - start
    record["verify_problems"] = problems
    reader = Checkpointer(directory, config.checkpoint, read_only=True)
    start = time.perf_counter()
    restored = jax.block_until_ready(reader.restore(last, abstract, iter(grain.MapDataset.range(1 << 20).to_iter_dataset())))
    record["restore_s"] = time.perf_counter() - start
    record["restore_gb_per_s"] = disk_space.array_bytes(abstract) / record["restore_s"] / 1e9
    record["restore_rss_peak_bytes"] = rss_bytes()
    reader.close()
    for leaf in jax.tree.leaves(restored):
        leaf.delete()
    shutil.rmtree(directory, ignore_errors=True)
    print(f"{name}: " + json.dumps({k: v for k, v in record.items() if k not in ("saves", "preflight")}, default=str), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--dir", required=True, help="checkpoint folder (emptied first, deleted after each variant)")
    parser.add_argument("--steps", type=int, default=240, help="steps per variant")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="device time of one step")
    parser.add_argument("--sleep", action="store_true", help="steps sleep instead of running matmuls on the device")
    parser.add_argument("--set", nargs="*", action="extend", default=[], help="config overrides for every variant, as gem-train --set")
    parser.add_argument("--variants", nargs="+", default=["blocking", "snapshot", "uncompressed"], choices=sorted(VARIANTS))
    parser.add_argument("--values", choices=("random", "init"), default="random", help="state values: random, or as initialised")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the timed first save")
    parser.add_argument("--all-copies", dest="one_copy", action="store_false", help="keep finished steps as Orbax would (max_to_keep)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    base = config_tree.apply_overrides(load_config(args.config), args.set)
    directory = Path(args.dir)
    start = time.perf_counter()
    training, state = setup_training(base)
    if args.values == "random":
        state = randomize(state)
    setup_s = time.perf_counter() - start
    abstract = training.state.abstract.checkpointed()  # what a checkpoint holds: no compute copy
    step = device_step(args.step_seconds, args.sleep)
    record = {
        "config": args.config,
        "overrides": args.set,
        "devices": [d.device_kind for d in jax.devices()],
        "host": platform.node(),
        "jax_version": jax.__version__,
        "host_memory_bytes": host_memory_bytes(),
        "steps": args.steps,
        "step_seconds": args.step_seconds,
        "sleep": args.sleep,
        "values": args.values,
        "one_copy": args.one_copy,
        "setup_s": setup_s,
        "checkpoint_bytes_estimate": disk_space.checkpoint_bytes(abstract),
        "state_array_bytes": disk_space.array_bytes(abstract),
        "state_bytes_per_device": {str(d): b for d, b in snapshot.device_bytes(abstract).items()},
        "snapshot_fits_before_steps": snapshot.fits(state.checkpointed()),
        "variants": {},
    }
    print(json.dumps({k: v for k, v in record.items() if k != "variants"}, default=str), flush=True)
    if args.warmup:
        config = config_tree.apply_overrides(base, VARIANTS["blocking"])
        shutil.rmtree(directory, ignore_errors=True)
        checkpointer = Checkpointer(directory, config.checkpoint)
        checkpointer.save(1, state, iter(grain.MapDataset.range(8).to_iter_dataset()), force=True)
        checkpointer.close()
        record["warmup_save"] = dataclasses.asdict(checkpointer.saves[0])
        print(f"warmup: {record['warmup_save']}", flush=True)
        shutil.rmtree(directory, ignore_errors=True)
    for name in args.variants:
        config = config_tree.apply_overrides(base, VARIANTS[name])
        record["variants"][name] = run_variant(name, config, state, abstract, directory, args, step)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")  # what is done so far survives a timeout
    keys = ("checkpoint_blocking_s_mean", "checkpoint_blocking_s_max", "checkpoint_write_gb_per_s", "final_wait_s", "du_bytes", "restore_s", "verify_s")
    summary = {name: {key: v[key] if key in v else v["report"].get(key) for key in keys} for name, v in record["variants"].items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
