"""Train-loader throughput on the CPU: samples/s per process of the grain pipeline with BBS on.

Cases (each a config file's data and model, BBS over D devices):
  ml_demo      configs/movielens.py (ml-latest-small, B = 256, max_seq_len 128), D = 8
               (one 8-GPU host);
  gem_sharded  configs/gem_sharded.py (synthetic long-tailed histories, B = 32768,
               max_seq_len 1024), D = its topology's 32 devices; or, if that file is
               absent, Source.SYNTHETIC with B = 1024, max_seq_len 1024 and D = 8.

For each case, one process, timed over max(4, ceil(`--samples` / B)) batches after `--warmup`:
  - pipeline_bbs:    `Dataset.train_iterator()` (grain, the config's prefetch thread) yielding
                     `Batch`es, BBS on: what the trainer pulls per step;
  - pipeline_plain:  the same without BBS;
  - index_stage_bbs: `Dataset.train_indices()` alone (shuffled index batches + BBS order):
                     the metadata work every process must do for the global batch;
  - host_split:      `gem_jax.parallel.placement.stack_batch(batch, D, buckets)`, the host-side split into
                     per-device jagged batches that the trainer runs on its main thread
                     before the transfer (not part of the loader, reported beside it);
  - balance_bbs / balance_plain: mean per-device load imbalance and slack fraction of the
                     stacked layout (as the trainer logs them) over the first batches.
Samples are real examples (weight > 0). Each rate is given per wall second and per CPU
second of the process (all its threads): on a shared machine the second is the steadier
figure, the rate of one core of its own. The 1-minute load average before and after each
case is recorded.

If `benchmarks/results/train_*.json` holds H200 training throughput (examples/s), the ratio
loader / step consumption is computed; the goal is >= 10x.

Case `events_h200` (`--only events_h200`, not part of the default run): your own log's pipeline
(`Source.EVENTS`) at configs/gem_h200.py's shape (B = 1024, max_seq_len 1024, one device). A
Parquet log of `--events` events is written to `--events-data` (reused when there): users with
lognormal events per user, `floor(0.1 x 1024 x exp(N(0, 1)))` clipped to [1, 1024] (the
synthetic source's history-length law, `gem_jax.data.sources.synthetic`), increasing times per
user, 100,000 items, an action and a click label; it is converted (`gem-data convert`, split
time:0.9). Timed, after `--warmup` batches: `Dataset.train_iterator()` (one process, the
config's prefetch thread: the `Batch`es the train loop takes), the same dataset through grain
worker processes (`--workers`, `IterDataset.mp_prefetch`: per host), a cProfile of
`Dataset.train_batch` on the first batches (the top functions by cumulative time), and the
builder's stages by timer (record read, decode, whole call; `_stages`). Targets:
>= 16.5k examples/s per loader process (3x one H200's 5.5k at gem_h200), >= 30k per host.
Writes benchmarks/results/loader_throughput_events_h200.json.

Run: PYTHONPATH=. .venv/bin/python benchmarks/loader_bench.py [--samples 100000] [--warmup 2]
Writes benchmarks/results/loader_throughput.json.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import glob
import importlib.metadata
import io
import json
import os
import platform
import pstats
import time
from pathlib import Path

import grain
import jax
from absl import flags
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_jax.train.config import TrainConfig, load_config
from gem_jax.data.config import BBSConfig, DataConfig, Source
from gem_jax.data.ingest.convert import ConvertOptions, convert
from gem_jax.data.ingest.schema import EventSchema, LabelRule
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.pipeline import Dataset, load_dataset
from gem_jax.model.flops import Workload
from gem_jax.data.balance import load_imbalance, padding_waste, shard_loads
from gem_jax.model.config import ModelConfig
from gem_jax.jagged import TokenBuckets
from gem_jax.parallel.placement import stack_batch
from gem_jax.model.flops import train_workload

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
ML_DEMO_SHARDS = 8
EVENTS_MAX_SEQ_LEN, EVENTS_BATCH = 1024, 1024  # configs/gem_h200.py on one H200
EVENTS_NUM_ITEMS = 100_000
H200_EXAMPLES_PER_S = 5500  # one H200's train step at gem_h200 (benchmarks/step.md)


def cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def cases() -> list[tuple[str, str, TrainConfig, int]]:
    """(name, config source, config, D) of every case."""
    demo = load_config(REPO / "configs" / "movielens.py")
    out = [("ml_demo", "configs/movielens.py", demo, ML_DEMO_SHARDS)]
    sharded = REPO / "configs" / "gem_sharded.py"
    if sharded.is_file():
        config = load_config(sharded)
        out.append(("gem_sharded", "configs/gem_sharded.py", config, config.topology.num_devices))
    else:
        data = DataConfig(source=Source.SYNTHETIC, batch_size=1024, max_seq_len=1024)
        out.append(("gem_sharded", "Source.SYNTHETIC, B=1024, max_seq_len=1024", TrainConfig(data=data, model=ModelConfig()), 8))
    return out


def _rates(samples: int, seconds: float, cpu_seconds: float) -> dict:
    return {
        "samples": samples,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "samples_per_s": samples / seconds,
        "samples_per_cpu_s": samples / cpu_seconds,
    }


def _timed(make_iter, warmup: int, batches: int, count) -> dict:
    """Wall and process CPU time of `batches` items after `warmup`; `count(item)` real samples each."""
    it = make_iter()
    for _ in range(warmup):
        next(it)
    samples = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        samples += count(next(it))
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return {"batches": batches, **_rates(samples, seconds, cpu_seconds)}


def _real(batch) -> int:
    return int((np.asarray(batch.weights) > 0).sum())


def measure(dataset: Dataset, num_shards: int, warmup: int, batches: int) -> dict:
    plain = dataclasses.replace(dataset, bbs=None)
    row = {
        "pipeline_bbs": _timed(dataset.train_iterator, warmup, batches, _real),
        "pipeline_plain": _timed(plain.train_iterator, warmup, batches, _real),
    }
    indices = dataset.train_indices()
    row["index_stage_bbs"] = _timed(lambda: (indices[i] for i in range(10**9)), warmup, batches, len)
    it = dataset.train_iterator()
    host_batches = [next(it) for _ in range(min(batches, 4))]
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in host_batches:
        stack_batch(batch, num_shards, dataset.token_buckets)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    samples = sum(_real(b) for b in host_batches)
    row["host_split"] = {"batches": len(host_batches), **_rates(samples, seconds, cpu_seconds)}
    lengths = np.concatenate([np.diff(np.asarray(b.history.offsets))[np.asarray(b.weights) > 0] for b in host_batches])
    row["mean_history_length"] = float(lengths.mean())
    it = plain.train_iterator()
    for name, sample in (("bbs", host_batches), ("plain", [next(it) for _ in host_batches])):
        row[f"balance_{name}"] = balance(sample, num_shards, dataset.bbs.workload, dataset.token_buckets)
    return row


def balance(batches: list, num_shards: int, workload: Workload, buckets: TokenBuckets) -> dict:
    """Mean per-device load imbalance and slack fraction (of the stacked per-device layout) of `batches`."""
    imbalance, waste = [], []
    for batch in batches:
        lengths = np.diff(np.asarray(batch.history.offsets))
        real = np.asarray(batch.weights) > 0
        imbalance.append(load_imbalance(shard_loads(workload(lengths) * real, num_shards)))
        capacity = int(np.prod(stack_batch(batch, num_shards, buckets).history.values.shape[:-1]))
        waste.append(padding_waste(lengths[real], capacity))
    return {"batches": len(batches), "load_imbalance_mean": float(np.mean(imbalance)), "slack_fraction_mean": float(np.mean(waste))}


def train_results() -> list[dict]:
    """Training throughput rows of `benchmarks/train_bench.py` results (benchmarks/results/train_*.json)."""
    rows = []
    for path in sorted(glob.glob(str(RESULTS / "train_*.json"))):
        data = json.loads(Path(path).read_text())
        for run in data.get("runs", []):
            if "examples_per_s" in run and "num_devices" in run:
                rows.append(
                    {
                        "file": Path(path).name,
                        "device": data.get("device_kind"),
                        "max_seq_len": data.get("max_seq_len"),
                        "attention_implementation": data.get("attention_implementation"),
                        "num_devices": run["num_devices"],
                        "global_batch": run.get("global_batch"),
                        "examples_per_s": run["examples_per_s"],
                        "examples_per_s_per_device": run["examples_per_s"] / run["num_devices"],
                    }
                )
    return rows


def events_log(directory: Path, events: int, seed: int = 0) -> Path:
    """The converted log of the `events_h200` case (module docstring), written under `directory` unless there."""
    out = directory / f"converted_{events}"
    if (out / "manifest.json").is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    median = 0.1 * EVENTS_MAX_SEQ_LEN  # SyntheticConfig.median_length_fraction, length_sigma 1
    counts = np.zeros(0, np.int64)
    while counts.sum() < events:
        more = np.clip(np.floor(median * np.exp(rng.standard_normal(max(16, events // 100)))), 1, EVENTS_MAX_SEQ_LEN).astype(np.int64)
        counts = np.concatenate([counts, more])
    counts = counts[: np.searchsorted(np.cumsum(counts), events) + 1]
    counts[-1] -= counts.sum() - events
    n = int(counts.sum())
    user = np.repeat(np.arange(counts.size), counts)
    gaps = rng.integers(1, 3600, n)
    first = np.cumsum(counts) - counts
    time_ = 1_600_000_000 + np.cumsum(gaps) - np.repeat(np.cumsum(gaps)[first] - gaps[first], counts)  # increasing per user
    parquet = directory / f"events_{events}.parquet"
    pq.write_table(
        pa.table({
            "user_id": user,
            "item_id": rng.integers(0, EVENTS_NUM_ITEMS, n),
            "ts": time_,
            "action": rng.integers(0, 4, n),
            "click": rng.integers(0, 2, n),
        }),
        parquet,
        row_group_size=256_000,
    )
    schema = EventSchema(user="user_id", item="item_id", time="ts", labels=(LabelRule.parse("click"),), action="action")
    convert([parquet], out, schema, ConvertOptions(split=SplitRule.parse("time:0.9")), log=lambda _: None)
    return out


def _profile(dataset: Dataset, batches: int, top: int = 12) -> list[str]:
    """cProfile of `dataset.train_batch` on the first `batches` train batches (their indices drawn
    beforehand): the top functions by cumulative time."""
    indices = dataset.train_indices()
    plan = [indices[i] for i in range(batches)]
    profile = cProfile.Profile()
    profile.enable()
    for batch in plan:
        dataset.train_batch(batch)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return [line.rstrip() for line in lines[start : start + top + 1]]


def _stages(dataset: Dataset, batches: int) -> list[dict]:
    """Milliseconds per train batch of the EVENTS builder's stages, two passes over the same `batches`
    batches (the first may read from disk, the second from the page cache): the record read
    (`RecordReader.read`), their decoding (`RecordLayout.decode_many`), and the whole builder call
    (read, decode, gather and validate). cProfile loses the builder's frames when it calls the
    array_record reader (records not yet kept), hence these timers."""
    build = dataset.train_batch
    index, indices = build.index, dataset.train_indices()
    plan = [indices[i] for i in range(batches)]
    records = [np.unique(np.searchsorted(index.starts, build.examples.target_event[batch], side="right") - 1) for batch in plan]
    passes = []
    for _ in range(2):
        read = decode = whole = 0.0
        for batch, keys in zip(plan, records):
            t0 = time.perf_counter()
            raws = index.reader.read(keys)
            t1 = time.perf_counter()
            index.layout.decode_many(raws)
            t2 = time.perf_counter()
            build(batch)
            t3 = time.perf_counter()
            read, decode, whole = read + t1 - t0, decode + t2 - t1, whole + t3 - t2
        passes.append({
            "read_ms": 1e3 * read / batches,
            "decode_ms": 1e3 * decode / batches,
            "train_batch_ms": 1e3 * whole / batches,
            "records_per_batch": float(np.mean([len(keys) for keys in records])),
            "bytes_per_batch": float(np.mean([sum(map(len, index.reader.read(keys))) for keys in records[:4]])),
        })
    return passes


def measure_events(args) -> dict:
    """The `events_h200` case (module docstring)."""
    load_before = os.getloadavg()[0]
    directory = events_log(Path(args.events_data), args.events)
    config = DataConfig(source=Source.EVENTS, path=str(directory), max_seq_len=EVENTS_MAX_SEQ_LEN, batch_size=EVENTS_BATCH)
    t0, c0 = time.perf_counter(), time.process_time()
    dataset = load_dataset(config)
    load = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    batches = max(4, -(-args.samples // dataset.batch_size))
    row = {"pipeline_one_process": _timed(dataset.train_iterator, args.warmup, batches, _real)}
    row["load_average_1min_after_one_process"] = os.getloadavg()[0]
    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (their defaults)
    options = grain.MultiprocessingOptions(num_workers=args.workers, per_worker_buffer_size=2)
    workers = lambda: iter(dataset.train_dataset().to_iter_dataset().mp_prefetch(options))  # noqa: E731
    row[f"pipeline_{args.workers}_worker_processes"] = _timed(workers, args.warmup + args.workers, batches, _real)
    row["profile_train_batch"] = _profile(dataset, min(batches, 10))
    row["stages_cold_then_warm"] = _stages(dataset, min(batches, 20))
    it = dataset.train_iterator()
    lengths = np.concatenate([np.diff(np.asarray(b.history.offsets))[np.asarray(b.weights) > 0] for b in (next(it) for _ in range(4))])
    manifest = json.loads((directory / "manifest.json").read_text())
    return {
        "name": "events_h200",
        "config": f"Source.EVENTS at configs/gem_h200.py's shape: B={EVENTS_BATCH}, max_seq_len={EVENTS_MAX_SEQ_LEN}",
        "log": {"path": str(directory), "events": manifest["counts"]["events"], "users": manifest["counts"]["users"],
                "train_examples": dataset.info.num_train_examples, "shards": len(manifest["shards"]), "sequence_lengths": manifest["sequence_lengths"]},
        "batch_size": dataset.batch_size,
        "max_seq_len": dataset.spec.max_seq_len,
        "prefetch_batches": dataset.prefetch_batches,
        "mean_history_length": float(lengths.mean()),
        "load_dataset": load,
        **row,
        "targets_examples_per_s": {"per_process": 3 * H200_EXAMPLES_PER_S, "per_host": 30_000},
        "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000, help="timed samples per measurement (at least 4 batches)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", choices=("ml_demo", "gem_sharded", "events_h200"), default=None)
    parser.add_argument("--events", type=int, default=2_000_000, help="events_h200: events of the generated log")
    parser.add_argument("--events-data", default="/tmp/gem_loader_events", help="events_h200: where the log and its conversion are kept")
    parser.add_argument("--workers", type=int, default=2, help="events_h200: grain worker processes of the per-host rate")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPU cores (no accelerator used)",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "grain": importlib.metadata.version("grain"),
        "jax": jax.__version__,
        "cases": [],
    }
    if args.only == "events_h200":
        case = measure_events(args)
        out["cases"].append(case)
        out["machine_cpus"] = os.cpu_count()
        path = RESULTS / "loader_throughput_events_h200.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({k: v for k, v in case.items() if k != "profile_train_batch"}, indent=1))
        print("\n".join(case["profile_train_batch"]))
        print(f"wrote {path}")
        return
    for name, source, config, num_shards in cases():
        if args.only and name != args.only:
            continue
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        dataset = load_dataset(dataclasses.replace(config.data, bbs=BBSConfig()))
        load_seconds = time.perf_counter() - t0
        workload = train_workload(config.model, dataset.spec)
        dataset = dataset.resolve_bbs(num_shards=num_shards, workload=workload)
        batches = max(4, -(-args.samples // dataset.batch_size))
        row = measure(dataset, num_shards, args.warmup, batches)
        case = {
            "name": name,
            "config": source,
            "batch_size": dataset.batch_size,
            "max_seq_len": dataset.spec.max_seq_len,
            "num_shards": num_shards,
            "prefetch_batches": dataset.prefetch_batches,
            "workload": dataclasses.asdict(workload),
            "load_dataset_seconds": load_seconds,
            **row,
            "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
        }
        out["cases"].append(case)
        print(
            f"{name}: B={case['batch_size']} D={num_shards} mean L={case['mean_history_length']:.0f}: "
            + ", ".join(
                f"{k} {case[k]['samples_per_s']:,.0f}/s ({case[k]['samples_per_cpu_s']:,.0f}/cpu-s)"
                for k in ("pipeline_bbs", "pipeline_plain", "index_stage_bbs", "host_split")
            )
        )
    out["train_results"] = train_results()
    path = RESULTS / ("loader_throughput.json" if args.only is None else f"loader_throughput_{args.only}.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
