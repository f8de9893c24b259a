"""Training throughput of the GEM-like sharded config on 1 and N GPUs of one host; scaling ratio.

Weak scaling: every GPU gets the same number of examples per step
(`--per-device-batch`), so perfect scaling doubles the throughput from 1 to 2 GPUs.
Scaling ratio = throughput(N) / (N x throughput(1)); GEM reports
E2E MFU = Local MFU x Scaling Ratio. FLOPs are the jagged-aware model count of
`gem_jax.model.flops` (real tokens only); MFU is per GPU against the dense bf16 peak.

The job is built by the trainer's own `gem_jax.train.setup_training`. The data are the
synthetic source's batches (`gem_jax.data.sources.synthetic`, long-tailed lengths, built
directly, without grain): a few global batches are built on the host and
put on the devices once, then cycled, so the timing is the device step (host pipeline
excluded). Each step is timed on its own (dispatch to
`block_until_ready`); the median is reported.

    PYTHONPATH=. python3 benchmarks/train_bench.py --devices 1 2 --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from gem_jax.train.config import TrainConfig, load_config
from gem_jax.nn.embeddings import check_lookup_stats
from gem_jax.mesh import Topology
from gem_jax.train.setup import setup_training
from gem_jax.model import flops as flops_lib

REPO = Path(__file__).resolve().parent.parent


def topology_for(num_devices: int, experts_per_node: int) -> Topology:
    """One zone, one node of `num_devices` GPUs; as many expert slots as the config asks, if they fit."""
    slots = experts_per_node if num_devices % experts_per_node == 0 else 1
    return Topology(zones=1, nodes_per_zone=1, gpus_per_node=num_devices, experts_per_node=slots)


def run(config: TrainConfig, num_devices: int, per_device_batch: int, steps: int, warmup: int, num_batches: int) -> dict:
    """Trains `steps` timed steps on the first `num_devices` devices; returns the measurements."""
    topology = topology_for(num_devices, config.topology.experts_per_node)
    batch_size = per_device_batch * num_devices
    config = dataclasses.replace(config, topology=topology, data=dataclasses.replace(config.data, batch_size=batch_size))
    t0 = time.perf_counter()
    training, state = setup_training(config, devices=jax.devices()[:num_devices])
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    mesh, placement, train_step, workload, setup = training.mesh, training.placement, training.train_step, training.workload, training.state
    build = training.dataset.train_batch

    host = [build(range(i * batch_size, (i + 1) * batch_size)) for i in range(num_batches)]
    flops, examples, tokens = [], [], []
    for b in host:
        real = np.asarray(b.weights) > 0
        lengths = np.diff(np.asarray(b.history.offsets))[real]
        flops.append(workload.total(lengths))
        examples.append(int(real.sum()))
        tokens.append(int(lengths.sum()))
    batches = [placement.put(b) for b in host]
    local_capacities = sorted({int(b.history.values.shape[1]) for b in batches})
    slack = [1.0 - t / math.prod(b.history.values.shape[:2]) for t, b in zip(tokens, batches)]

    t0 = time.perf_counter()
    for i in range(max(warmup, num_batches)):  # every batch once: each capacity compiles before the timing
        state, metrics = train_step(state, batches[i % num_batches])
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    check_lookup_stats(jax.device_get(metrics), setup.plan.tables, where="warm-up")

    times, losses = [], []
    for i in range(steps):
        batch = batches[i % num_batches]
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
    fetched = jax.device_get(metrics)
    check_lookup_stats(fetched, setup.plan.tables, where="timed steps")
    order = [i % num_batches for i in range(steps)]
    step_flops = float(np.mean([flops[i] for i in order]))
    step_examples = float(np.mean([examples[i] for i in order]))
    median = float(np.median(times))
    peak = flops_lib.peak_flops(mesh.devices.flat[0])
    result = {
        "num_devices": num_devices,
        "topology": dataclasses.asdict(topology),
        "mesh_shape": dict(mesh.shape),
        "global_batch": batch_size,
        "mean_tokens_per_step": float(np.mean(tokens)),
        "local_capacities": local_capacities,
        "slack_fraction_mean": float(np.mean(slack)),
        "slack_fraction_max": float(np.max(slack)),
        "init_s": init_s,
        "compile_and_warmup_s": compile_s,
        "step_times_s": times,
        "median_step_s": median,
        "examples_per_s": step_examples / median,
        "model_tflops_per_step": step_flops / 1e12,
        "tflops_per_s_per_device": step_flops / median / num_devices / 1e12,
        "mfu_per_device": (step_flops / median / num_devices / peak) if peak else None,
        "loss_first_last": [losses[0], losses[-1]],
        "overflow": {k: int(v) for k, v in fetched.items() if k.endswith("/overflow")},
        "tables": {k: p.generation.name for k, p in setup.plan.tables.items()},
    }
    stats = mesh.devices.flat[0].memory_stats() or {}
    result["peak_bytes_in_use_device0"] = stats.get("peak_bytes_in_use")
    del state, batches, train_step
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "gem_sharded.py"))
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--per-device-batch", type=int, default=1024)
    parser.add_argument("--max-seq-len", type=int, default=None, help="override the config's history bound")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps; at least one per built batch")
    parser.add_argument("--num-batches", type=int, default=4)
    parser.add_argument("--attention", choices=["auto", "xla", "pallas"], default="auto", help="auto: pallas on Hopper, falls back to xla if it fails")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    base = load_config(args.config)
    if args.max_seq_len is not None:
        base = dataclasses.replace(base, data=dataclasses.replace(base.data, max_seq_len=args.max_seq_len))
    record = {
        "benchmark": "train_scaling",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "num_visible_devices": jax.device_count(),
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "config": args.config,
        "per_device_batch": args.per_device_batch,
        "max_seq_len": base.data.max_seq_len,
        "synthetic": dataclasses.asdict(base.data.synthetic),
        "steps": args.steps,
        "runs": [],
        "errors": [],
    }
    # A failed or non-finite implementation is recorded under "errors" (with its runs) and the next one is tried.
    implementations = {"auto": [None, "xla"], "xla": ["xla"], "pallas": ["pallas"]}[args.attention]
    for impl in implementations:
        config = dataclasses.replace(base, model=dataclasses.replace(base.model, attention_implementation=impl))
        record["attention_implementation"] = impl or "auto (pallas on Hopper)"
        record["model"] = dataclasses.asdict(config.model)
        record["runs"] = []
        try:
            for n in args.devices:
                print(f"--- {n} device(s), attention {impl or 'auto'}", flush=True)
                result = run(config, n, args.per_device_batch, args.steps, args.warmup, args.num_batches)
                print(json.dumps({k: v for k, v in result.items() if k != "step_times_s"}), flush=True)
                record["runs"].append(result)
                if not all(np.isfinite(result["loss_first_last"])):
                    raise FloatingPointError(f"non-finite loss on {n} device(s): {result['loss_first_last']}")
            break
        except Exception as exc:  # a kernel that does not compile or run: try the next implementation
            record["errors"].append({"attention_implementation": impl, "error": repr(exc)[:2000], "runs": record["runs"]})
            traceback.print_exc()
            gc.collect()
    by_n = {r["num_devices"]: r for r in record["runs"]}
    if 1 in by_n:
        record["local_mfu"] = by_n[1]["mfu_per_device"]
        for n, r in by_n.items():
            if n > 1:
                ratio = r["examples_per_s"] / (n * by_n[1]["examples_per_s"])
                record[f"scaling_ratio_{n}"] = ratio
                if by_n[1]["mfu_per_device"] is not None:
                    record[f"e2e_mfu_{n}"] = by_n[1]["mfu_per_device"] * ratio
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k not in ("runs", "model", "synthetic")}, indent=2))
    if not record["runs"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
