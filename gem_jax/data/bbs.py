"""Base batch shuffling (BBS): balanced per-device batches without communication.

Source: GEM engineering description (Meta, 2025). A data loader takes its next
window of samples, cuts it into minibatches of 128 consecutive samples, sorts
each minibatch by workload, pairs the heaviest sample with the lightest, the
second heaviest with the second lightest, and so on, and deals the pairs to the
full per-device batches (8 or more minibatches each) so that every batch
carries about the same total workload. It needs no communication between
loaders: a loader balances the batches it feeds.

`base_batch_shuffle` is the algorithm on one window of workloads;
`balance_shards` orders one global batch so that its contiguous per-device
chunks are balanced; `BalancedBatchOrder` is that ordering as a grain
`map_with_index` function over batches of example indices (the train
pipeline's BBS stage, `gem_jax.data.pipeline.Dataset.train_indices`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

_NO_PARTNER = -1


def _check_positive_int(where: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")


def _check_minibatch_size(where: str, minibatch_size) -> None:
    _check_positive_int(where, "minibatch_size", minibatch_size)
    if minibatch_size % 2:
        raise ValueError(f"{where}: minibatch_size must be even to pair samples, got {minibatch_size}")


def _workloads(where: str, workloads) -> np.ndarray:
    """float64 `[N]` of `workloads`; ValueError unless 1-D, finite and >= 0."""
    w = np.asarray(workloads, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"{where}: workloads must be 1-D, got shape {w.shape}")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: workload {float(w[i])} at index {i} is not finite and >= 0")
    return w


def _pair_minibatch(workloads: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Heaviest-with-lightest pairs of one minibatch (1-D), as global indices.

    Returns (first, second): the heavier and the lighter sample of each pair;
    an odd-sized minibatch leaves its median sample alone, with second = -1.
    """
    order = np.argsort(workloads, kind="stable") + start
    half = order.size // 2
    first = order[::-1][: order.size - half]
    second = np.full(first.size, _NO_PARTNER, dtype=np.int64)
    second[:half] = order[:half]
    return first, second


def _deal(w: np.ndarray, minibatch_size: int, num_batches: int, seed) -> np.ndarray:
    """Steps 1 to 3 of `base_batch_shuffle`: int64 `[N]`, the batch of every sample."""
    # Step 1 and 2: full minibatches at once, then the short last one.
    n = w.size
    n_full = n - n % minibatch_size
    order = np.argsort(w[:n_full].reshape(-1, minibatch_size), axis=1, kind="stable")
    order += np.arange(0, n_full, minibatch_size)[:, None]
    half = minibatch_size // 2
    first = [order[:, ::-1][:, :half].ravel()]
    second = [order[:, :half].ravel()]
    if n_full < n:
        tail_first, tail_second = _pair_minibatch(w[n_full:], n_full)
        first.append(tail_first)
        second.append(tail_second)
    first = np.concatenate(first)
    second = np.concatenate(second)
    paired = second != _NO_PARTNER
    unit_load = w[first] + np.where(paired, w[np.where(paired, second, 0)], 0.0)

    # Step 3: rounds of num_batches pairs, heaviest pair to the lightest batch. Loads are kept in
    # tie order (position j is batch tie_order[j]); the short last round is padded with empty units.
    rng = np.random.default_rng(seed)
    tie_order = rng.permutation(num_batches)
    by_load = np.argsort(-unit_load, kind="stable")
    rounds = -(-by_load.size // num_batches)
    round_loads = np.zeros(rounds * num_batches)
    round_loads[: by_load.size] = unit_load[by_load]
    round_loads = round_loads.reshape(rounds, num_batches)
    slot = np.empty((rounds, num_batches), dtype=np.int64)
    load = np.zeros(num_batches)
    for r in range(rounds):
        lightest = load.argsort(kind="stable")
        slot[r] = lightest
        load[lightest] += round_loads[r]
    batch_of_unit = np.empty(by_load.size, dtype=np.int64)
    batch_of_unit[by_load] = tie_order[slot.ravel()[: by_load.size]]

    batch_of_sample = np.empty(n, dtype=np.int64)
    batch_of_sample[first] = batch_of_unit
    batch_of_sample[second[paired]] = batch_of_unit[paired]
    return batch_of_sample


def base_batch_shuffle(
    workloads,
    *,
    minibatch_size: int = 128,
    minibatches_per_batch: int = 8,
    seed: int | Sequence[int] = 0,
    num_batches: int | None = None,
) -> list[np.ndarray]:
    """Deals a window of samples to per-device batches of equal workload.

    GEM's base batch shuffling (GEM engineering description, Meta 2025):

    1. The window (samples in arrival order) is cut into minibatches of
       `minibatch_size` consecutive samples.
    2. Each minibatch is sorted by workload and its heaviest sample is paired
       with its lightest, its second heaviest with its second lightest, etc.
    3. All pairs of the window, heaviest pair first, are dealt in rounds of
       `num_batches`: in each round the heaviest pair goes to the batch with
       the lowest workload so far, the next to the second lowest, and so on.
       Every batch receives one pair per round, so a full window gives every
       batch exactly `minibatch_size * minibatches_per_batch` samples.

    The seed only breaks ties between batches of equal workload (in the first
    round, all of them), i.e. it decides which batch label gets which pairs;
    the result is a pure function of (workloads, sizes, seed).

    Remainder policy. Without `num_batches`, the window must be a positive
    multiple of `B = minibatch_size * minibatches_per_batch` samples and
    `num_batches = len(workloads) / B`; anything else is a ValueError. With
    `num_batches`, the window may be shorter than `num_batches * B` (the end of
    a finite stream): the samples are cut the same way (the last minibatch is
    short; if its size is odd its median sample is dealt alone) and dealt to
    `num_batches` batches of at most B samples each; batches may be short or
    empty, and the caller pads them (zero-weight samples). No sample is dropped.

    Args:
      workloads: float array-like `[N]`, each sample's workload (e.g. FLOPs from
        `gem_jax.data.balance.Workload`), finite and >= 0, in arrival order.
      minibatch_size: samples per minibatch, a positive even int.
      minibatches_per_batch: minibatches per per-device batch, positive.
      seed: an int or a sequence of ints (as `np.random.default_rng` takes).
      num_batches: per-device batches to deal to; None infers it from N.

    Returns:
      `num_batches` int64 arrays of sample indices into `workloads`, each
      sorted ascending; together they hold every index in range(N) exactly
      once.

    Raises:
      ValueError: on a non-1-D or non-finite or negative workload, a bad size,
        or a window that does not fit (see the remainder policy).
    """
    where = "base_batch_shuffle"
    _check_minibatch_size(where, minibatch_size)
    _check_positive_int(where, "minibatches_per_batch", minibatches_per_batch)
    w = _workloads(where, workloads)
    batch_size = minibatch_size * minibatches_per_batch
    n = w.size
    if num_batches is None:
        if n == 0 or n % batch_size:
            raise ValueError(
                f"{where}: a window of {n} samples is not a positive multiple of "
                f"minibatch_size * minibatches_per_batch = {batch_size}; pass num_batches to deal a short window"
            )
        num_batches = n // batch_size
    else:
        _check_positive_int(where, "num_batches", num_batches)
        if n > num_batches * batch_size:
            raise ValueError(f"{where}: a window of {n} samples exceeds num_batches * batch size = {num_batches} * {batch_size}")
    batch_of_sample = _deal(w, minibatch_size, num_batches, seed)
    grouped = np.argsort(batch_of_sample, kind="stable")
    counts = np.bincount(batch_of_sample, minlength=num_batches)
    return np.split(grouped, np.cumsum(counts)[:-1])


def check_shard_split(batch_size: int, num_shards: int, where: str = "balance_shards") -> None:
    """Checks that BBS can deal a global batch of `batch_size` to `num_shards` equal chunks.

    Raises:
      ValueError: `num_shards` is not a positive int or does not divide
        `batch_size`, or (with more than one shard) the chunk size
        `batch_size / num_shards` is odd (BBS deals pairs of samples).
    """
    _check_positive_int(where, "num_shards", num_shards)
    if batch_size % num_shards:
        raise ValueError(f"{where}: a batch of {batch_size} samples does not split into {num_shards} equal shards")
    if num_shards > 1 and (batch_size // num_shards) % 2:
        raise ValueError(
            f"{where}: the shard size {batch_size} / {num_shards} = {batch_size // num_shards} is odd; "
            "BBS deals pairs of samples, so it must be even"
        )


def balance_shards(workloads, num_shards: int, *, minibatch_size: int = 128, seed: int | Sequence[int] = 0) -> np.ndarray:
    """Orders a global batch so that its contiguous per-device chunks carry equal workload.

    Data parallelism cuts a global batch of N samples into `num_shards` = D
    contiguous chunks of N / D, chunk d for device d. This deals the batch,
    in arrival order, with base batch shuffling (`base_batch_shuffle`'s steps
    1 to 3 with D batches and minibatches of `minibatch_size`; GEM engineering
    description, Meta 2025) and returns the order that puts batch d in chunk d.
    Every chunk gets exactly N / D samples: the N / 2 pairs are dealt in
    rounds of one pair per batch. The spread between the heaviest and the
    lightest chunk is at most the heaviest pair's workload.

    Args:
      workloads: float array-like `[N]`, each sample's workload (FLOPs),
        finite and >= 0, in arrival order.
      num_shards: D, a positive int dividing N with N / D even (or D = 1).
      minibatch_size: samples per minibatch, a positive even int; it need not
        divide N (the last minibatch is short).
      seed: an int or a sequence of ints; it only decides which chunk gets
        which of the dealt batches (ties of the first round).

    Returns:
      int64 `[N]`, a permutation of range(N): device d takes samples
      `order[d * N / D : (d + 1) * N / D]`, in arrival order within the chunk.
      With D = 1 the identity, at no cost.

    Raises:
      ValueError: on a non-1-D, non-finite or negative workload, a bad size,
        or a batch that does not split (`check_shard_split`).
    """
    where = "balance_shards"
    _check_minibatch_size(where, minibatch_size)
    w = _workloads(where, workloads)
    check_shard_split(w.size, num_shards, where)
    if num_shards == 1:
        return np.arange(w.size, dtype=np.int64)
    return np.argsort(_deal(w, minibatch_size, num_shards, seed), kind="stable")


@dataclasses.dataclass(frozen=True)
class BalancedBatchOrder:
    """BBS as a grain `map_with_index` function over batches of example indices.

    Maps (batch index i, int64 example indices `[B]` of a global batch) to the
    same indices reordered by `balance_shards` with seed `(seed, i)`, so that
    the `num_shards` contiguous per-device chunks carry equal workload. It is a
    pure function of (i, indices): placed on a grain `MapDataset` of index
    batches (`gem_jax.data.sampling.ShuffledBatchIndices`) before the batch
    builder, its output does not depend on the number of worker processes
    and a restored iterator position gives the same batches.

    A short batch (fewer than `batch_size` indices, the last of an epoch)
    keeps its order: the batch builder pads it at the end, so its chunks hold
    different numbers of real samples whatever the order.

    Attributes:
      lengths: maps int64 example indices `[n]` to their int history lengths `[n]`.
      workload: maps int lengths `[n]` to float workloads `[n]`, e.g. a
        `gem_jax.data.balance.Workload`.
      num_shards: D, the devices a global batch is split over.
      batch_size: B, the full global batch size.
      minibatch_size: BBS minibatch size (even).
      seed: the pipeline seed.

    Raises:
      ValueError: at construction, on sizes `balance_shards` rejects; at call,
        on an index batch longer than `batch_size`.
    """

    lengths: Callable[[np.ndarray], np.ndarray]
    workload: Callable[[np.ndarray], np.ndarray]
    num_shards: int
    batch_size: int
    minibatch_size: int = 128
    seed: int = 0

    def __post_init__(self):
        _check_minibatch_size("BalancedBatchOrder", self.minibatch_size)
        _check_positive_int("BalancedBatchOrder", "batch_size", self.batch_size)
        check_shard_split(self.batch_size, self.num_shards, "BalancedBatchOrder")

    def __call__(self, index: int, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.shape[0] > self.batch_size:
            raise ValueError(f"BalancedBatchOrder: batch {index} has {indices.shape[0]} examples, more than B = {self.batch_size}")
        if indices.shape[0] < self.batch_size or self.num_shards == 1:
            return indices
        workloads = self.workload(self.lengths(indices))
        order = balance_shards(workloads, self.num_shards, minibatch_size=self.minibatch_size, seed=(self.seed, int(index)))
        return indices[order]
