"""Load imbalance of base batch shuffling (BBS) against random batching and a global partition.

Simulates R data-parallel ranks (8 and 64) that each take 1024 samples per step
from one shuffled example stream, and measures per step the imbalance
max(rank workload) / mean(rank workload) - 1 under:

  random      each rank takes its 1024 consecutive samples of the stream as they come;
  bbs_host    one loader per 8 ranks (a host of 8 GPUs) deals its own 8192
              consecutive samples to its 8 ranks with `base_batch_shuffle`;
              loaders never communicate;
  bbs_global  every loader reads the lengths of the whole step's R * 1024 samples
              and deals them to all R ranks with `balance_shards` (identical on
              every loader, so still no communication), keeping its own batches;
              this is what the train pipeline does (`DataConfig.bbs`): every
              process builds the same global batch;
  lpt         reference that needs communication: greedy longest-processing-time
              partition of the whole step's samples into R equal-count batches.

Lengths: (a) ml-latest-small, each rating's history length = the number of
earlier ratings of that user (by timestamp, ties in file order), capped at 200
(FeatureSpec.max_seq_len); the stream is a reshuffled pass over the 100,836
ratings per epoch. (b) lognormal with median 256 and sigma 1, rounded and
clipped to [1, 4096]. Workloads: the GEM model's training FLOPs from
`gem_jax.model.flops.flop_model` at the default `ModelConfig`, and pure
attention (L**2).

Also times `balance_shards` on one global batch (samples/s, one CPU process);
`benchmarks/loader_bench.py` times the whole train pipeline.

Run: PYTHONPATH=. .venv/bin/python benchmarks/bbs_bench.py [--steps 200] [--quick]
Writes benchmarks/results/bbs_*.json and benchmarks/figures/bbs_*.png.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import os
import platform
import time
from pathlib import Path

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gem_jax.batch import CategoricalFeature, FeatureSpec, Pooling  # noqa: E402
from gem_jax.data.bbs import balance_shards, base_batch_shuffle  # noqa: E402
from gem_jax.model.flops import Workload
from gem_jax.data.balance import load_imbalance  # noqa: E402
from gem_jax.model.config import ModelConfig  # noqa: E402
from gem_jax.model.flops import flop_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
FIGURES = REPO / "benchmarks" / "figures"
ML_SMALL = Path(os.environ.get("GEM_SHARED_DATA", REPO.parent / "shared" / "data")) / "ml-latest-small"

PER_RANK = 1024
RANKS_PER_HOST = 8
MINIBATCH_SIZE = 128
MINIBATCHES_PER_BATCH = PER_RANK // MINIBATCH_SIZE
ML_MAX_SEQ_LEN = FeatureSpec.__dataclass_fields__["max_seq_len"].default
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA, LONG_TAIL_MAX = 256.0, 1.0, 4096
METHODS = ("random", "bbs_host", "bbs_global", "lpt")


def cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def ml_small_history_lengths(directory: Path) -> np.ndarray:
    """Per rating: the number of earlier ratings by the same user (timestamp order, ties in file order)."""
    ratings = np.loadtxt(directory / "ratings.csv", delimiter=",", skiprows=1)
    user, timestamp = ratings[:, 0].astype(np.int64), ratings[:, 3].astype(np.int64)
    order = np.lexsort((np.arange(user.size), timestamp, user))
    sorted_user = user[order]
    first = np.r_[0, np.flatnonzero(np.diff(sorted_user)) + 1]
    run = np.diff(np.r_[first, user.size])
    lengths = np.empty(user.size, dtype=np.int64)
    lengths[order] = np.arange(user.size) - np.repeat(first, run)
    return lengths


def ml_small_feature_spec(directory: Path) -> FeatureSpec:
    """The schema of ml-latest-small as far as the FLOP count reads it (feature tokens, the genre projection, tasks)."""
    ratings = np.loadtxt(directory / "ratings.csv", delimiter=",", skiprows=1)
    genres = set()
    with open(directory / "movies.csv", encoding="utf-8") as f:
        next(f)
        for line in f:
            genres.update(line.rstrip("\n").rsplit(",", 1)[1].split("|"))
    return FeatureSpec(
        num_items=len(np.unique(ratings[:, 1])) + 1,
        num_actions=11,  # ten half-star ratings + PAD
        num_time_buckets=1,  # does not enter the FLOP count
        tasks=("like", "love"),
        user_features=(CategoricalFeature("user", len(np.unique(ratings[:, 0])) + 1),)
        + tuple(CategoricalFeature(name, 1) for name in ("age", "gender", "occupation")),
        item_features=(CategoricalFeature("genres", len(genres) + 1, len(genres), Pooling.MULTI_HOT),),
    )


class Stream:
    """Lengths in training order: reshuffled passes over a pool (ml), or i.i.d. draws (lognormal)."""

    def __init__(self, rng: np.random.Generator, pool: np.ndarray | None):
        self._rng, self._pool, self._buffer = rng, pool, np.empty(0, np.int64)

    def take(self, n: int) -> np.ndarray:
        while self._buffer.size < n:
            if self._pool is None:
                fresh = np.rint(self._rng.lognormal(np.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA, size=max(n, 1 << 16)))
                fresh = np.clip(fresh, 1, LONG_TAIL_MAX).astype(np.int64)
            else:
                fresh = self._pool[self._rng.permutation(self._pool.size)]
            self._buffer = np.concatenate([self._buffer, fresh])
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out


def lpt_partition(workloads: np.ndarray, parts: int) -> np.ndarray:
    """Greedy LPT into `parts` equal-count parts: heaviest first, to the lightest part with room. Returns loads."""
    capacity = workloads.size // parts
    heap = [(0.0, p) for p in range(parts)]
    loads, counts = np.zeros(parts), np.zeros(parts, np.int64)
    for w in np.sort(workloads)[::-1]:
        load, p = heapq.heappop(heap)
        loads[p], counts[p] = load + w, counts[p] + 1
        if counts[p] < capacity:
            heapq.heappush(heap, (loads[p], p))
    return loads


def bbs_host_loads(w: np.ndarray, ranks_per_loader: int, seed) -> np.ndarray:
    """Per-rank loads when each loader deals its own ranks_per_loader * PER_RANK consecutive samples."""
    window = ranks_per_loader * PER_RANK
    loads = []
    for j, start in enumerate(range(0, w.size, window)):
        part = w[start : start + window]
        batches = base_batch_shuffle(
            part, minibatch_size=MINIBATCH_SIZE, minibatches_per_batch=MINIBATCHES_PER_BATCH, seed=(*seed, j)
        )
        loads += [part[b].sum() for b in batches]
    return np.array(loads)


def simulate(lengths_stream: Stream, workload: Workload, ranks: int, steps: int, seed: int) -> dict:
    """Per-step imbalance and per-rank load / step mean for every method."""
    imbalance = {m: [] for m in METHODS}
    relative = {m: [] for m in METHODS}
    for step in range(steps):
        w = workload(lengths_stream.take(ranks * PER_RANK))
        loads = {
            "random": w.reshape(ranks, PER_RANK).sum(axis=1),
            "bbs_host": bbs_host_loads(w, RANKS_PER_HOST, (seed, step)),
            "bbs_global": w[balance_shards(w, ranks, minibatch_size=MINIBATCH_SIZE, seed=(seed, step, 0))]
            .reshape(ranks, PER_RANK)
            .sum(axis=1),
            "lpt": lpt_partition(w, ranks),
        }
        for m, rank_loads in loads.items():
            assert np.isclose(rank_loads.sum(), w.sum(), rtol=1e-9), m
            imbalance[m].append(load_imbalance(rank_loads))
            relative[m].append(rank_loads / rank_loads.mean() - 1.0)
    summary = {
        m: {
            "mean": float(np.mean(v)),
            "median": float(np.median(v)),
            "p95": float(np.percentile(v, 95)),
            "max": float(np.max(v)),
        }
        for m, v in imbalance.items()
    }
    return {"imbalance": summary, "relative_rank_load": {m: np.concatenate(v) for m, v in relative.items()}}


def time_balance_shards(ranks: int, repeats: int, rng: np.random.Generator) -> dict:
    """Samples/s of `balance_shards` on one global batch of ranks * PER_RANK samples (median of repeats)."""
    w = Workload(1.0, 1.0)(np.clip(rng.lognormal(np.log(256), 1.0, ranks * PER_RANK), 1, 4096).astype(np.int64))
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        balance_shards(w, ranks, minibatch_size=MINIBATCH_SIZE, seed=r)
        times.append(time.perf_counter() - t0)
    median = float(np.median(times[1:]))
    return {"ranks": ranks, "batch_samples": w.size, "median_s": median, "samples_per_s": w.size / median}


METHOD_LABELS = {
    "random": "random",
    "bbs_host": "BBS, 1 loader / 8 ranks",
    "bbs_global": "BBS, global window",
    "lpt": "global LPT (comm.)",
}


def plot(results: dict, workload_name: str, path: Path) -> None:
    """Per-rank workload relative to the step mean, pooled over steps: one panel per (lengths, ranks)."""
    cells = [c for c in results if c["workload"] == workload_name]
    fig, axes = plt.subplots(2, 2, figsize=(10, 9))
    for ax, cell in zip(axes.ravel(), cells):
        data = [100.0 * cell["relative_rank_load"][m] for m in METHODS]
        ax.boxplot(data, whis=(0, 100), widths=0.6)
        ax.set_xticks(range(1, len(METHODS) + 1), [METHOD_LABELS[m] for m in METHODS], rotation=30, ha="right")
        ax.axhline(0.0, color="grey", lw=0.6)
        means = " / ".join(f"{cell['imbalance'][m]['mean'] * 100:.2g}" for m in METHODS)
        ax.set_title(f"{cell['lengths']}, {cell['ranks']} ranks\nmean imbalance per step, %: {means}", fontsize=9)
        ax.set_ylabel("rank workload / step mean - 1  [%]")
    fig.suptitle(f"Per-rank workload, {PER_RANK} samples per rank per step; workload model: {workload_name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lengths(lengths: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.2))
    for ax, (name, sample) in zip(axes, lengths.items()):
        step = max(1, -(-(int(sample.max()) + 1) // 80))  # integer-aligned bins, no aliasing
        ax.hist(sample, bins=np.arange(0, sample.max() + step + 1, step), log=True)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("history length L")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="simulated steps per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="10 steps, few timing repeats (smoke run)")
    parser.add_argument("--part", choices=("all", "imbalance", "throughput"), default="all")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    rng = np.random.default_rng(args.seed)
    RESULTS.mkdir(parents=True, exist_ok=True)
    FIGURES.mkdir(parents=True, exist_ok=True)

    spec = ml_small_feature_spec(ML_SMALL)
    model_config = ModelConfig()
    fm = flop_model(model_config, spec)
    workloads = {
        "gem_default": fm.scaled(3),
        "attention_only": Workload(per_token=0.0, per_token_pair=1.0),
    }
    ml_lengths = np.minimum(ml_small_history_lengths(ML_SMALL), ML_MAX_SEQ_LEN)
    length_sources = {
        f"ml-latest-small (cap {ML_MAX_SEQ_LEN})": ml_lengths,
        f"lognormal (median {LOGNORMAL_MEDIAN:g}, sigma {LOGNORMAL_SIGMA:g}, max {LONG_TAIL_MAX})": None,
    }

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPU cores (no accelerator used)",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "jax": jax.__version__,
        "per_rank_samples": PER_RANK,
        "minibatch_size": MINIBATCH_SIZE,
        "minibatches_per_batch": MINIBATCHES_PER_BATCH,
        "ranks_per_host": RANKS_PER_HOST,
        "seed": args.seed,
        "model_config": {k: str(v) for k, v in vars(model_config).items()},
        "workloads": {k: vars(v) for k, v in workloads.items()},
    }
    if args.part in ("all", "imbalance"):
        run_imbalance(meta, workloads, length_sources, steps, args.seed)
    if args.part in ("all", "throughput"):
        run_throughput(meta, args.quick, rng)


def run_imbalance(meta: dict, workloads: dict, length_sources: dict, steps: int, seed: int) -> None:
    cells = []
    for wname, workload in workloads.items():
        for lname, pool in length_sources.items():
            for ranks in (8, 64):
                t0 = time.perf_counter()
                stream = Stream(np.random.default_rng([seed, ranks, len(cells)]), pool)
                out = simulate(stream, workload, ranks, steps, seed)
                cells.append(dict(workload=wname, lengths=lname, ranks=ranks, steps=steps, **out))
                line = "  ".join(f"{m} {out['imbalance'][m]['mean'] * 100:7.3f}/{out['imbalance'][m]['max'] * 100:7.3f}" for m in METHODS)
                print(f"{wname:15s} {lname[:22]:22s} R={ranks:3d}  mean/max imbalance %: {line}  ({time.perf_counter() - t0:.1f}s)")

    for wname in workloads:
        plot(cells, wname, FIGURES / f"bbs_rank_workloads_{wname}.png")
    samples = {name: pool if pool is not None else Stream(np.random.default_rng(seed), None).take(200_000)
               for name, pool in length_sources.items()}
    plot_lengths(samples, FIGURES / "bbs_lengths.png")
    imbalance_json = dict(
        meta,
        imbalance_metric="max over ranks of workload / mean workload - 1, per step",
        cells=[{k: v for k, v in c.items() if k != "relative_rank_load"} for c in cells],
    )
    (RESULTS / "bbs_imbalance.json").write_text(json.dumps(imbalance_json, indent=2) + "\n")


def run_throughput(meta: dict, quick: bool, rng: np.random.Generator) -> None:
    repeats = 3 if quick else 20
    load_before = os.getloadavg()
    timing = {"balance_shards": [time_balance_shards(r, repeats, rng) for r in (8, 32, 64)]}
    timing["load_average_1min_before_after"] = [load_before[0], os.getloadavg()[0]]
    for row in timing["balance_shards"]:
        print(f"balance_shards, {row['ranks']} ranks x {PER_RANK}: {row['samples_per_s'] / 1e6:.2f} M samples/s")
    (RESULTS / "bbs_throughput.json").write_text(json.dumps(dict(meta, **timing), indent=2) + "\n")


if __name__ == "__main__":
    main()
