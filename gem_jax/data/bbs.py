"""Base batch shuffling (BBS): balanced per-device batches without communication.

Source: GEM engineering description (Meta, 2025). A data loader takes its next
window of samples, cuts it into minibatches of 128 consecutive samples, sorts
each minibatch by workload, pairs the heaviest sample with the lightest, the
second heaviest with the second lightest, and so on, and deals the pairs to the
full per-device batches (8 or more minibatches each) so that every batch
carries about the same total workload. It needs no communication between
loaders: a loader balances the batches it feeds.

`base_batch_shuffle` is the algorithm on one window of workloads;
`BaseBatchShuffleIterDataset` is the same algorithm as a grain stage over a
stream of examples, with a checkpointable position.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

_NO_PARTNER = -1


def _check_positive_int(where: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")


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
        `gem_jax.data.workload.Workload`), finite and >= 0, in arrival order.
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
    _check_positive_int("base_batch_shuffle", "minibatch_size", minibatch_size)
    _check_positive_int("base_batch_shuffle", "minibatches_per_batch", minibatches_per_batch)
    if minibatch_size % 2:
        raise ValueError(f"base_batch_shuffle: minibatch_size must be even to pair samples, got {minibatch_size}")
    w = np.asarray(workloads, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"base_batch_shuffle: workloads must be 1-D, got shape {w.shape}")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"base_batch_shuffle: workload {float(w[i])} at index {i} is not finite and >= 0")
    batch_size = minibatch_size * minibatches_per_batch
    n = w.size
    if num_batches is None:
        if n == 0 or n % batch_size:
            raise ValueError(
                f"base_batch_shuffle: a window of {n} samples is not a positive multiple of "
                f"minibatch_size * minibatches_per_batch = {batch_size}; pass num_batches to deal a short window"
            )
        num_batches = n // batch_size
    else:
        _check_positive_int("base_batch_shuffle", "num_batches", num_batches)
        if n > num_batches * batch_size:
            raise ValueError(
                f"base_batch_shuffle: a window of {n} samples exceeds num_batches * batch size = "
                f"{num_batches} * {batch_size}"
            )

    # Step 1 and 2: full minibatches at once, then the short last one.
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
    grouped = np.argsort(batch_of_sample, kind="stable")
    counts = np.bincount(batch_of_sample, minlength=num_batches)
    return np.split(grouped, np.cumsum(counts)[:-1])


def record_length(record: Mapping[str, Any]) -> int:
    """The default length accessor: `record["length"]`."""
    return record["length"]


class BaseBatchShuffleIterDataset(grain.IterDataset):
    """BBS as a grain stage: examples in, balanced per-device batches out.

    Reads windows of `num_batches * minibatch_size * minibatches_per_batch`
    consecutive examples from `parent`, deals each window with
    `base_batch_shuffle` (seeded with `(seed, window index)`), and yields the
    window's per-device batches one after the other, batch 0 first, each as a
    list of the parent's examples in arrival order. A consumer that feeds
    `num_batches` devices per step takes `num_batches` consecutive elements.

    Placement: BBS turns many examples into one batch, so it must come after
    `mp_prefetch` (grain's `mp_prefetch` warns that many-to-one and stateful
    transformations before it change the output with the worker count). After
    it, the output depends only on the parent's element order, which
    `mp_prefetch` keeps for any worker count.

    End of a finite parent: the last, short window is dealt under
    `base_batch_shuffle`'s remainder policy, so its batches may be short or
    empty (all `num_batches` are still yielded, so every device gets a batch
    in every step); the batch builder pads them with zero-weight examples.

    Loaders that each balance only their own devices leave the loaders'
    totals unbalanced. `keep_batches` lets every loader read the same global
    stream of light records (e.g. example id and length), deal it to all
    devices with identical results, and keep only its own batches; still no
    communication. See benchmarks/bbs.md for both layouts' imbalance.

    Checkpointing: the state is the parent's state at the start of the current
    window, the window index and the number of batches already taken from it;
    `set_state` re-reads that window, so a resumed iterator yields the same
    stream as an uninterrupted one.

    Args:
      parent: an IterDataset of examples.
      workload: maps an int array of lengths to float workloads, e.g. a
        `gem_jax.data.workload.Workload`.
      num_batches: per-device batches per window, positive.
      minibatch_size, minibatches_per_batch: as in `base_batch_shuffle`.
      seed: int seed; window w is dealt with seed `(seed, w)`.
      length_of: maps an example to its history length (default
        `record["length"]`).
      keep_batches: batch ids in [0, num_batches) to yield, in this order;
        None yields all.

    Raises:
      TypeError: if `parent` is not an IterDataset.
      ValueError: on a bad size or `keep_batches`.
    """

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        workload: Callable[[np.ndarray], np.ndarray],
        num_batches: int,
        minibatch_size: int = 128,
        minibatches_per_batch: int = 8,
        seed: int = 0,
        length_of: Callable[[Any], int] = record_length,
        keep_batches: Sequence[int] | None = None,
    ):
        if not isinstance(parent, grain.IterDataset):
            raise TypeError(
                f"BaseBatchShuffleIterDataset: parent must be a grain.IterDataset, got {type(parent).__name__}"
                " (call .to_iter_dataset() on a MapDataset)"
            )
        for name, value in (
            ("num_batches", num_batches),
            ("minibatch_size", minibatch_size),
            ("minibatches_per_batch", minibatches_per_batch),
        ):
            _check_positive_int("BaseBatchShuffleIterDataset", name, value)
        if minibatch_size % 2:
            raise ValueError(f"BaseBatchShuffleIterDataset: minibatch_size must be even, got {minibatch_size}")
        keep = tuple(range(num_batches)) if keep_batches is None else tuple(int(b) for b in keep_batches)
        if not keep or len(set(keep)) != len(keep) or not all(0 <= b < num_batches for b in keep):
            raise ValueError(
                f"BaseBatchShuffleIterDataset: keep_batches must be distinct ids in [0, {num_batches}), got {keep_batches}"
            )
        super().__init__(parent)
        self._workload = workload
        self._num_batches = num_batches
        self._minibatch_size = minibatch_size
        self._minibatches_per_batch = minibatches_per_batch
        self._seed = int(seed)
        self._length_of = length_of
        self._keep = keep

    def __iter__(self) -> _BaseBatchShuffleIterator:
        return _BaseBatchShuffleIterator(self._parent.__iter__(), self)

    def __str__(self) -> str:
        return (
            f"BaseBatchShuffleIterDataset(num_batches={self._num_batches}, minibatch_size={self._minibatch_size},"
            f" minibatches_per_batch={self._minibatches_per_batch}, seed={self._seed}, keep_batches={self._keep})"
        )


class _BaseBatchShuffleIterator(grain.DatasetIterator):
    """Iterator of `BaseBatchShuffleIterDataset`; see there for the state."""

    def __init__(self, parent: grain.DatasetIterator, spec: BaseBatchShuffleIterDataset):
        super().__init__(parent)
        self._spec = spec
        self._window_size = spec._num_batches * spec._minibatch_size * spec._minibatches_per_batch
        self._window_start = copy.deepcopy(parent.get_state())
        self._window_index = 0
        self._position = 0
        self._batches: list[list[Any]] | None = None

    def _read_window(self) -> list[list[Any]]:
        """Reads the next window from the parent and deals it; [] at the end."""
        examples = []
        for example in self._parent:
            examples.append(example)
            if len(examples) == self._window_size:
                break
        if not examples:
            return []
        spec = self._spec
        lengths = np.fromiter((spec._length_of(e) for e in examples), dtype=np.int64, count=len(examples))
        indices = base_batch_shuffle(
            spec._workload(lengths),
            minibatch_size=spec._minibatch_size,
            minibatches_per_batch=spec._minibatches_per_batch,
            seed=(spec._seed, self._window_index),
            num_batches=spec._num_batches,
        )
        return [[examples[i] for i in indices[b]] for b in spec._keep]

    def __next__(self) -> list[Any]:
        self._assert_not_closed()
        if self._batches is None:
            self._batches = self._read_window()
        if self._position == len(self._batches):
            if not self._batches:
                raise StopIteration
            self._window_start = copy.deepcopy(self._parent.get_state())
            self._window_index += 1
            self._position = 0
            self._batches = self._read_window()
            if not self._batches:
                raise StopIteration
        batch = self._batches[self._position]
        self._position += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": copy.deepcopy(self._window_start),
            "window_index": self._window_index,
            "position": self._position,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        missing = {"parent", "window_index", "position"} - set(state)
        if missing:
            raise ValueError(f"BaseBatchShuffleIterDataset: state lacks {sorted(missing)}")
        position = int(state["position"])
        if not 0 <= position <= len(self._spec._keep):
            raise ValueError(
                f"BaseBatchShuffleIterDataset: state position {position} is outside [0, {len(self._spec._keep)}]"
            )
        self._parent.set_state(copy.deepcopy(state["parent"]))
        self._window_start = copy.deepcopy(state["parent"])
        self._window_index = int(state["window_index"])
        self._position = position
        self._batches = None

    def __str__(self) -> str:
        return f"_BaseBatchShuffleIterator({self._spec})"
