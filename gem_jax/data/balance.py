"""Data-parallel balance metrics a training step logs.

`shard_loads` sums each device's chunk of a global batch under a per-sample
workload (the model's training FLOPs, `gem_jax.model.flops.Workload`, or any
callable from lengths to costs); `load_imbalance` is GEM's BBS metric (the slowest
rank's excess over the mean); `padding_waste` the share of token slots that hold no
real token (logged as `slack_fraction`).
"""

from __future__ import annotations

import numpy as np


def shard_loads(workloads, num_shards: int) -> np.ndarray:
    """Total workload of each device's chunk of a global batch.

    Data parallelism gives device d the contiguous examples
    `d * B / D ... (d + 1) * B / D - 1` of a batch of B (`gem_jax.parallel.placement`).

    Args:
      workloads: float array-like `[B]`, each example's workload (0 for the
        padding examples that do no real work).
      num_shards: D, a positive int dividing B.

    Returns:
      float64 `[D]`, the sum of each chunk.

    Raises:
      ValueError: `workloads` is not 1-D, or D is not positive or does not divide B.
    """
    w = np.asarray(workloads, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"shard_loads: workloads must be 1-D, got shape {w.shape}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1 or w.size % num_shards:
        raise ValueError(f"shard_loads: num_shards must be a positive int dividing the batch of {w.size}, got {num_shards!r}")
    return w.reshape(num_shards, -1).sum(axis=1)


def load_imbalance(rank_loads) -> float:
    """The slowest rank's excess over the mean: max(load) / mean(load) - 1.

    With synchronous data parallelism every rank waits for the slowest one, so
    this is the fraction of the step lost to imbalance relative to a perfectly
    balanced step (GEM engineering description's BBS metric; 0 is perfect).

    Args:
      rank_loads: float array-like `[R]`, R >= 1, each >= 0 (e.g. from
        `shard_loads`).

    Returns:
      The imbalance, >= 0; 0.0 when every rank has zero load.

    Raises:
      ValueError: if `rank_loads` is empty, not 1-D, or has a negative or
        non-finite entry.
    """
    loads = np.asarray(rank_loads, dtype=np.float64)
    if loads.ndim != 1 or loads.size == 0:
        raise ValueError(f"load_imbalance: rank_loads must be a non-empty 1-D array, got shape {loads.shape}")
    if not np.all(np.isfinite(loads)) or np.any(loads < 0):
        raise ValueError(f"load_imbalance: rank_loads must be finite and >= 0, got {loads}")
    mean = loads.mean()
    if mean == 0:
        return 0.0
    return float(loads.max() / mean - 1.0)


def padding_waste(lengths, capacity: int) -> float:
    """Fraction of a batch's token slots that hold no real token.

    1 - sum(lengths) / capacity, where capacity is `B * max_len` for a padded
    dense batch, or the static token capacity `T_cap` of a jagged batch. For
    the stacked per-device layout (capacity `D * T_local`) this is the
    `slack_fraction` of the trainer's train records.

    Args:
      lengths: int array-like `[B]`, the real samples' history lengths.
      capacity: token slots of the batch, > 0.

    Returns:
      The waste in [0, 1].

    Raises:
      ValueError: if capacity is not positive, a length is negative, or the
        lengths exceed the capacity.
    """
    if capacity <= 0:
        raise ValueError(f"padding_waste: capacity must be > 0, got {capacity}")
    tokens = np.asarray(lengths, dtype=np.int64)
    if np.any(tokens < 0):
        raise ValueError(f"padding_waste: lengths must be >= 0, got {tokens[tokens < 0][:4]}")
    total = int(tokens.sum())
    if total > capacity:
        raise ValueError(f"padding_waste: {total} real tokens exceed the capacity of {capacity}")
    return 1.0 - total / capacity
