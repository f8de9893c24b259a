"""What per-user sequence lengths mean for batch layouts: padding, jagged slack, GPU balance.

`layout_report` estimates, from the sequence lengths of a log, the padding a
padded layout would waste, the slack of the trainer's jagged token capacities
(`gem_jax.jagged.TokenBuckets`) and the per-GPU load imbalance of data
parallelism with and without base batch shuffling
(`gem_jax.data.bbs.balance_shards`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from gem_jax.data.balance import load_imbalance, padding_waste, shard_loads
from gem_jax.data.bbs import balance_shards, check_shard_split
from gem_jax.jagged import TokenBuckets, pick_capacity


def transformer_workload(width: int = 1024, layers: int = 4) -> Callable[[np.ndarray], np.ndarray]:
    """float64 forward FLOPs of histories of lengths L (int array) through `layers` causal
    self-attention blocks of width d = `width`.

    Per block: 24 d^2 per event (QKV and output projections, a 4x MLP; 2 FLOPs
    per multiply-add) and 2 d per unit of L^2 (QK^T and PV cost 4 d per causal
    pair, of which there are about L^2 / 2): the quadratic + linear form of the
    model's own `gem_jax.model.flops.Workload`, which may be passed instead.
    """
    per_token, per_pair = 24.0 * width * width * layers, 2.0 * width * layers
    return lambda lengths: per_token * np.asarray(lengths, np.float64) + per_pair * np.asarray(lengths, np.float64) ** 2


@dataclasses.dataclass(frozen=True)
class LayoutReport:
    """Means over random global batches (`layout_report`).

    Attributes:
      padded_waste: share of token slots that are padding with every history
        padded to `max_seq_len` (`B x max_seq_len` slots).
      padded_to_longest_waste: the same, padding each batch to its longest history.
      jagged_slack: share of slack rows under the trainer's token capacities
        (each device's rows packed into the capacity `TokenBuckets` picks for
        the batch's fullest device, for all D devices).
      imbalance: per-GPU load imbalance (max / mean - 1 of each device's
        workload) with batches dealt in arrival order.
      imbalance_bbs: the same after base batch shuffling.
      batches: how many batches were drawn.
    """

    padded_waste: float
    padded_to_longest_waste: float
    jagged_slack: float
    imbalance: float
    imbalance_bbs: float
    batches: int


def layout_report(lengths, batch_size: int, gpus: int, max_seq_len: int | None = None, *, workload: Callable[[np.ndarray], np.ndarray] | None = None, batches: int = 64, seed: int = 0, where: str = "layout_report") -> LayoutReport:
    """Padding and balance of batches of sequences with these lengths.

    Each user's sequence (cut to its last `max_seq_len` events) is one sample;
    `batches` global batches of `batch_size` samples are drawn at random
    (without replacement inside a batch) and split into `gpus` contiguous
    per-device chunks as data parallelism does.

    Args:
      lengths: int `[u]`, the sequence lengths, u >= 1.
      batch_size: B, the global batch, a multiple of `gpus` with B / gpus even.
      gpus: D, data-parallel devices.
      max_seq_len: the longest history kept; None: the longest length.
      workload: maps int lengths `[n]` to float FLOPs `[n]` (default `transformer_workload()`;
        `gem_jax.model.flops.train_workload(...)` fits).
      where: what the errors name as the settings given (e.g. "--batch-size 10 on --gpus 4").

    Raises:
      ValueError: no lengths, or a batch that does not split (`check_shard_split`).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise ValueError(f"{where}: no sequences")
    check_shard_split(batch_size, gpus, where)
    max_seq_len = int(max_seq_len or lengths.max())
    lengths = np.minimum(lengths, max_seq_len)
    workload = workload or transformer_workload()
    buckets = TokenBuckets.from_lengths(lengths, max_seq_len)
    capacities = buckets.capacities(batch_size // gpus)
    rng = np.random.default_rng(seed)
    results = []
    for _ in range(batches):
        batch = lengths[rng.choice(lengths.size, batch_size, replace=lengths.size < batch_size)]
        device_tokens = batch.reshape(gpus, -1).sum(axis=1)
        cost = workload(batch)
        order = balance_shards(cost, gpus, seed=int(rng.integers(1 << 31)))
        results.append((
            padding_waste(batch, batch_size * max_seq_len),
            padding_waste(batch, batch_size * int(batch.max())),
            padding_waste(batch, gpus * pick_capacity(int(device_tokens.max()), capacities)),
            load_imbalance(shard_loads(cost, gpus)),
            load_imbalance(shard_loads(cost[order], gpus)),
        ))
    means = np.mean(results, axis=0)
    return LayoutReport(*map(float, means), batches=batches)
