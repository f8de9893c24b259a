"""The train steps since the last train record: their metrics, FLOPs, examples and balance, turned into one record."""

from __future__ import annotations

import math

import jax
import numpy as np

from gem_jax.batch import Batch, LocalBatch
from gem_jax.data.balance import load_imbalance, padding_waste, shard_loads
from gem_jax.model.flops import Workload
from gem_jax.nn.embeddings import check_lookup_stats
from gem_jax.train.metrics import pooled_normalized_entropy


class TrainWindow:
    """Accumulates the steps of one log window; `fetch` then `record` turn them into a train record.

    Args:
      workload: training FLOPs per example as a function of its history length.
      num_shards: D, the devices each batch is split over (for the load imbalance).
      task_names: the tasks' names (K of them), for the per-task keys.
      tables: the embedding tables' placements (`ShardingPlan.tables`), whose lookup
        counters are checked at every record.
      peak: the devices' peak FLOP/s (None: no MFU).
    """

    def __init__(self, workload: Workload, num_shards: int, task_names, tables, peak: float | None):
        self.workload, self.num_shards, self.task_names, self.tables, self.peak = workload, num_shards, task_names, tables, peak
        self._reset()

    def _reset(self) -> None:
        self.metrics: list[dict] = []  # device arrays until `fetch`
        self.flops, self.examples, self.imbalance, self.slack = 0.0, 0, [], []

    def __len__(self) -> int:
        return len(self.metrics)

    def add(self, local: LocalBatch, placed: Batch, metrics: dict) -> None:
        """One step: its batch (this process's part and the placed global batch) and its metrics (not fetched)."""
        lengths = local.lengths[local.real]  # of the global batch
        self.flops += self.workload.total(lengths)
        self.examples += local.num_real
        # Balance across the devices' contiguous chunks; slack: 1 - real rows / placed rows (D x T_local).
        self.imbalance.append(load_imbalance(shard_loads(self.workload(local.lengths) * local.real, self.num_shards)))
        self.slack.append(padding_waste(lengths, math.prod(placed.history.values.shape[:-1])))
        self.metrics.append(metrics)

    def fetch(self) -> list[dict]:
        """The window's metrics on the host: blocks until its steps have run."""
        return jax.device_get(self.metrics)

    def record(self, fetched: list[dict], step: int, seconds: float, learning_rate: float) -> dict:
        """The train record of the window ending at `step`, then starts a new window.

        Args:
          fetched: `fetch()`'s result.
          step: the window's last step (1-based).
          seconds: the window's train-step and data-wait time, for the throughput keys.
          learning_rate: at the window's last step.

        Returns:
          loss, grad_norm (window means), bce_<task> and ne_<task> (pooled over the window's
          examples, `pooled_task_metrics`: ne_<task> is None where the window holds one class), examples_per_s,
          tflops_per_s, mfu (with a peak), learning_rate, load_imbalance_mean/max,
          slack_fraction and the lookup counters (`lookup_counters`).

        Raises:
          EmbeddingLookupError: out-of-range ids reached a table that refuses them
            (`gem_jax.nn.embeddings.check_lookup_stats`, the step named).
        """
        for offset, metrics in enumerate(fetched):
            check_lookup_stats(metrics, self.tables, where=f"train step {step - len(fetched) + offset + 1}")
        mean = {k: np.mean([np.asarray(m[k]) for m in fetched], axis=0) for k in ("loss", "grad_norm")}
        record = {"loss": float(mean["loss"]), "grad_norm": float(mean["grad_norm"])}
        record.update(pooled_task_metrics(fetched, self.task_names))
        record["examples_per_s"] = self.examples / seconds
        record["tflops_per_s"] = self.flops / seconds / 1e12
        if self.peak:
            record["mfu"] = self.flops / seconds / self.peak
        record.update(
            learning_rate=learning_rate,
            load_imbalance_mean=float(np.mean(self.imbalance)),
            load_imbalance_max=float(np.max(self.imbalance)),
            slack_fraction=float(np.mean(self.slack)),
        )
        record.update(lookup_counters(fetched))
        self._reset()
        return record


def pooled_task_metrics(window: list[dict], task_names) -> dict[str, float | None]:
    """`bce_<task>` and `ne_<task>` of a log window's train steps, pooled over the window's examples.

    `bce_<task>`: the window's mean BCE per example (each step's mean BCE weighted by its
    examples' weight); `ne_<task>`: that over the entropy of the window's base rate (its
    positives over its examples), not a mean of per-step NEs, which a batch without a
    positive would blow up. Where the window's examples are all of one class (rate exactly
    0 or 1) NE is undefined: None (`metric_log.train_line` prints n/a). A window without a
    real example has None for both.
    """
    examples = np.array([float(np.asarray(m["examples"])) for m in window], np.float64)
    bce = np.array([np.asarray(m["bce"], np.float64) for m in window])  # [steps, K]
    positives = np.sum([np.asarray(m["positives"], np.float64) for m in window], axis=0)
    negatives = np.sum([np.asarray(m["negatives"], np.float64) for m in window], axis=0)
    total = examples.sum()
    # a step's BCE is its weighted BCE sum over max(its weight, 1) (`gem_jax.model.loss.weighted_bce`)
    bce_sums = (bce * np.maximum(examples, 1.0)[:, None]).sum(axis=0)
    record: dict[str, float | None] = {}
    for k, name in enumerate(task_names):
        mean_bce = float(bce_sums[k] / total) if total > 0 else None
        record[f"bce_{name}"] = mean_bce
        record[f"ne_{name}"] = None if mean_bce is None else pooled_normalized_entropy(mean_bce, float(positives[k]), float(negatives[k]))
    return record


def lookup_counters(window: list[dict]) -> dict[str, int | float]:
    """The embedding lookups' `<table>/overflow` and `<table>/out_of_range` counts, summed over the window,
    and their exchanges' `<table>/sent_rows` and `<table>/sent_bytes`, per step (the window's mean)."""
    counts = {k: int(sum(int(m[k]) for m in window)) for k in window[0] if k.endswith(("/overflow", "/out_of_range"))}
    return counts | {k: float(np.mean([m[k] for m in window])) for k in window[0] if k.endswith(("/sent_rows", "/sent_bytes"))}
