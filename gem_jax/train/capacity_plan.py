"""Which token capacities a run's batches take, and which of their programs pay for their build.

A batch's history rows are packed into one of the data set's token capacities
(`gem_jax.jagged.TokenBuckets`), and each capacity is its own program
(`gem_jax.train.programs`). Which ones a run takes is known before it starts: the batches'
example indices come from the shuffle seed, their history lengths from the data set's
metadata, so `run_capacities` replays the placement's choice (`gem_jax.parallel.placement`)
for every batch of the steps to run and of the eval set, without building a batch.
`capacities_worth_building` weighs a program built while the run trains against the device
time its steps would save.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import numpy as np

from gem_jax.jagged import TokenBuckets, pick_capacity
from gem_jax.train.setup import Training


def batch_capacity(lengths: np.ndarray, num_shards: int, buckets: TokenBuckets) -> int:
    """The token capacity the placement packs a global batch into.

    Args:
      lengths: int `[B]` history rows of each example in device order (0 for padding).
      num_shards: D, the devices the batch is split over (D divides B).
      buckets: the data set's token buckets.

    Returns:
      The smallest of `buckets.capacities(B/D)` holding the fullest device's rows.
    """
    per = lengths.shape[0] // num_shards
    return pick_capacity(int(lengths.reshape(num_shards, per).sum(axis=1).max()), buckets.capacities(per))


def run_capacities(
    indices, lengths: Callable[[np.ndarray], np.ndarray], batches: Iterable[int], batch_size: int, num_shards: int, buckets: TokenBuckets
) -> dict[int, int]:
    """How many of the batches `batches` of `indices` take each token capacity.

    Args:
      indices: a grain `MapDataset` of each batch's example indices (int64 `[<= B]`,
        `Dataset.train_indices()` or `eval_indices()`).
      lengths: example indices -> their history rows (`Dataset.train_lengths` / `eval_lengths`).
      batches: positions in `indices` (the steps a run takes).
      batch_size: B (a short batch is padded with examples of no rows).
      num_shards: D.
      buckets: the data set's token buckets.

    Returns:
      capacity -> number of batches, in increasing capacity.
    """
    taken: collections.Counter[int] = collections.Counter()
    padded = np.zeros(batch_size, np.int64)
    for k in batches:
        idx = np.asarray(indices[k], np.int64)
        padded[:] = 0
        padded[: idx.shape[0]] = lengths(idx)
        taken[batch_capacity(padded, num_shards, buckets)] += 1
    return dict(sorted(taken.items()))


def capacities_worth_building(
    counts: dict[int, int], ready: Iterable[int], step_s: float, build_s: float, steps_left: int
) -> list[int]:
    """The train capacities whose programs pay for their build, chosen greedily by saving.

    A step's device time is taken as proportional to its token capacity (an upper bound on
    what a smaller capacity saves: the per-example work, e.g. the DHEN, does not shrink).
    Without a program for capacity `c`, its batches run at the smallest chosen capacity
    above it. Adding `c` saves `step_s * n * (above - c) / largest` for each of the `n`
    batches it takes over from `above`, scaled by the share of the run still ahead once it
    is built (`steps_left - build_s / step_s` of `steps_left`); it is chosen while that
    saving exceeds `build_s`.

    Args:
      counts: capacity -> how many of the run's batches take it (`planned_capacities`).
      ready: capacities with a program already (at least the largest of `counts`).
      step_s: wall seconds of one step at the largest ready capacity (measured).
      build_s: seconds to lower and compile one program (the first one's, measured).
      steps_left: train steps still to run when the decision is made.

    Returns:
      The capacities to build, in the order chosen (largest saving first).

    Raises:
      ValueError: `ready` holds no capacity at or above the largest of `counts`.
    """
    chosen = sorted(set(ready))
    if counts and (not chosen or chosen[-1] < max(counts)):
        raise ValueError(f"capacities_worth_building: no ready capacity holds the largest batch ({max(counts)}); ready: {chosen}")
    if not counts or step_s <= 0:
        return []
    largest = chosen[-1]
    total = sum(counts.values())
    ahead = max(0.0, steps_left - build_s / step_s) / total

    def cost(capacities: list[int]) -> float:
        return sum(n * min(c for c in capacities if c >= d) for d, n in counts.items())

    picked: list[int] = []
    while True:
        base = cost(chosen)
        savings = {c: base - cost(sorted([*chosen, c])) for c in counts if c not in chosen}
        if not savings:
            return picked
        best = max(savings, key=lambda c: savings[c])
        if step_s * savings[best] / largest * ahead <= build_s:
            return picked
        chosen = sorted([*chosen, best])
        picked.append(best)


def planned_capacities(training: Training, train_steps: range, evaluates: bool) -> tuple[dict[int, int], tuple[int, ...]]:
    """How many train batches of `train_steps` take each token capacity (`run_capacities`), and,
    if `evaluates`, the eval step's capacity: the largest any eval batch takes (all of them are placed at it)."""
    dataset, num_shards, buckets = training.dataset, training.placement.num_shards, training.dataset.token_buckets
    train = run_capacities(dataset.train_indices(), dataset.train_lengths, train_steps, dataset.batch_size, num_shards, buckets)
    evals = (
        tuple(run_capacities(dataset.eval_indices(), dataset.eval_lengths, range(dataset.num_eval_batches), dataset.batch_size, num_shards, buckets))[-1:]
        if evaluates
        else ()
    )
    return train, evals
