"""Checkpoint cost of a config's train state: size, disk preflight, blocking and write seconds, host memory.

Builds the config's sharded train state (`gem_jax.train.setup_training`) and drives the
trainer's `Checkpointer` as the training loop does, with a sleep of `--step-seconds`
standing in for each train step: `should_save` / `save` every step, `checkpoint.every_steps`
apart, then the final (forced) save and `wait`. Records:

- `checkpoint_bytes` (the estimate, `gem_jax.train.disk_space.checkpoint_bytes`) against
  `du` of every saved step (`du_bytes`), and the preflight lines;
- the `Checkpointer.report()` (saves, deferred saves, mean/max blocking seconds, write
  GB/s, the final save's write seconds) and every save's record;
- host memory: RSS before the first save, its peak while saving (sampled every 20 ms) and
  after the last; the staged copy (one at a time) and TensorStore's write buffers
  (bounded by `checkpoint.WRITE_BUFFER_FRACTION` of host RAM) are what it measures.

    PYTHONPATH=. python3 benchmarks/checkpoint_bench.py --config configs/gem_h200.py \
        --dir /tmp/ckpt_bench --steps 40 --step-seconds 0.5 --set checkpoint.every_steps=10 \
        optim.moments_dtype=bfloat16 --out benchmarks/results/checkpoint_gem_h200_bf16.json
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

from gem_jax.train import config_tree, disk_space
from gem_jax.train.checkpoint import Checkpointer, host_memory_bytes
from gem_jax.train.config import load_config
from gem_jax.train.setup import setup_training


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--dir", required=True, help="checkpoint folder (emptied first)")
    parser.add_argument("--steps", type=int, default=40, help="simulated train steps")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="sleep standing in for one train step")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, as gem-train --set")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    config = config_tree.apply_overrides(load_config(args.config), args.set)
    directory = Path(args.dir)
    shutil.rmtree(directory, ignore_errors=True)
    training, state = setup_training(config)
    abstract = training.state.abstract
    data = iter(grain.MapDataset.range(1 << 20).to_iter_dataset())
    checkpointer = Checkpointer(directory, config.checkpoint)
    preflight = checkpointer.preflight(abstract)
    for line in preflight:
        print(line, flush=True)
    rss_before = rss_bytes()
    with PeakRss() as peak:
        for step in range(1, args.steps + 1):
            time.sleep(args.step_seconds)
            next(data)
            if checkpointer.should_save(step):
                checkpointer.save(step, state, data)
        if checkpointer.latest_step() != args.steps:
            checkpointer.save(args.steps, state, data, force=True)
        checkpointer.wait()
    record = {
        "config": args.config,
        "overrides": args.set,
        "devices": [d.device_kind for d in jax.devices()],
        "host": platform.node(),
        "host_memory_bytes": host_memory_bytes(),
        "write_buffer_gb": checkpointer.write_buffer_gb,
        "steps": args.steps,
        "step_seconds": args.step_seconds,
        "every_steps": config.checkpoint.every_steps,
        "checkpoint_bytes_estimate": disk_space.checkpoint_bytes(abstract),
        "state_array_bytes": sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract)),
        "du_bytes": {step: du_bytes(checkpointer.step_path(step)) for step in checkpointer.all_steps()},
        "preflight": preflight,
        "report": checkpointer.report(),
        "saves": [dataclasses.asdict(s) for s in checkpointer.saves],
        "deferred": checkpointer.deferred,
        "rss_before_bytes": rss_before,
        "rss_peak_bytes": peak.peak,
        "rss_after_bytes": rss_bytes(),
    }
    checkpointer.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps(record["report"], indent=1))


if __name__ == "__main__":
    main()
