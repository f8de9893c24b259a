"""The train steps since the last train record: their metrics, FLOPs, examples and balance, turned into one record."""

from __future__ import annotations

import math

import jax
import numpy as np

from gem_jax.batch import Batch, LocalBatch
from gem_jax.data.balance import load_imbalance, padding_waste, shard_loads
from gem_jax.model.flops import Workload
from gem_jax.nn.embeddings import check_lookup_stats


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
          loss, grad_norm, bce_<task>, ne_<task> (window means), examples_per_s,
          tflops_per_s, mfu (with a peak), learning_rate, load_imbalance_mean/max,
          slack_fraction and the lookup counters (`lookup_counters`).

        Raises:
          EmbeddingLookupError: out-of-range ids reached a table that refuses them
            (`gem_jax.nn.embeddings.check_lookup_stats`, the step named).
        """
        for offset, metrics in enumerate(fetched):
            check_lookup_stats(metrics, self.tables, where=f"train step {step - len(fetched) + offset + 1}")
        mean = {k: np.mean([np.asarray(m[k]) for m in fetched], axis=0) for k in ("loss", "grad_norm", "bce", "ne")}
        record = {"loss": float(mean["loss"]), "grad_norm": float(mean["grad_norm"])}
        for k, name in enumerate(self.task_names):
            record[f"bce_{name}"] = float(mean["bce"][k])
            record[f"ne_{name}"] = float(mean["ne"][k])
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


def lookup_counters(window: list[dict]) -> dict[str, int | float]:
    """The embedding lookups' `<table>/overflow` and `<table>/out_of_range` counts, summed over the window,
    and their exchanges' `<table>/sent_rows` and `<table>/sent_bytes`, per step (the window's mean)."""
    counts = {k: int(sum(int(m[k]) for m in window)) for k in window[0] if k.endswith(("/overflow", "/out_of_range"))}
    return counts | {k: float(np.mean([m[k] for m in window])) for k in window[0] if k.endswith(("/sent_rows", "/sent_bytes"))}
