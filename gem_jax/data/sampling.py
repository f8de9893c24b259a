"""A grain source of per-epoch shuffled batches of example indices.

Element i of `ShuffledBatchIndices` is the int64 array of example indices of
batch i: epoch `e = i // steps_per_epoch` is a seeded permutation of all
examples (`numpy.random.default_rng([seed, e]).permutation`), cut into
batches of B; the last batch of an epoch is short (the batch builder pads
it with weight-0 examples), so every example appears exactly once per epoch
and no batch mixes epochs. Because element i depends only on (seed, i), a
grain iterator over it is restored exactly by `set_state`, and grain worker
processes (`mp_prefetch`) yield the same batches for any worker count.

A whole-epoch numpy permutation replaces `MapDataset.shuffle`, whose
per-element index shuffle costs about 40 us an element in Python (10 ms per
256-example batch on one CPU core, several times the cost of building the
batch itself). A permutation of 100M examples takes ~5 s, so each epoch's is
computed once per process, in a thread (numpy releases the GIL), and shared by
every `ShuffledBatchIndices` of the same examples and seed (the run's capacity
plan and its loader); `prefetch_epoch_order` starts it before it is needed.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading

import grain
import numpy as np

# (num_examples, seed, epoch) -> the future of that epoch's order, the `_KEPT_ORDERS` used last.
_ORDERS: dict[tuple[int, int, int], concurrent.futures.Future] = {}
_ORDERS_LOCK = threading.Lock()
_KEPT_ORDERS = 2  # two epochs: 1.6 GB at 100M examples


def _forget_after_fork() -> None:
    """A forked process has none of its parent's threads (an order being computed never arrives)
    and may have forked while one held the lock: it starts with no orders and a free lock."""
    global _ORDERS_LOCK
    _ORDERS_LOCK = threading.Lock()
    _ORDERS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _compute_order(num_examples: int, seed: int, epoch: int, future: concurrent.futures.Future) -> None:
    try:
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        order.flags.writeable = False  # shared by every reader of the epoch
        future.set_result(order)
    except BaseException as error:  # handed to whoever waits for the order
        future.set_exception(error)


def prefetch_epoch_order(num_examples: int, seed: int, epoch: int) -> concurrent.futures.Future:
    """The future of int64 `[num_examples]` (read-only), epoch `epoch`'s order for `seed`: computing in
    a thread unless an earlier call started it (the order of `ShuffledBatchIndices.epoch_order`).
    Its `.result()` raises what computing it raised (numpy's error for a bad size or seed)."""
    key = (num_examples, seed, epoch)
    with _ORDERS_LOCK:
        future = _ORDERS.pop(key, None)
        started = future is None
        if started:
            future = concurrent.futures.Future()
        _ORDERS[key] = future  # the most recently used last
        while len(_ORDERS) > _KEPT_ORDERS:
            del _ORDERS[next(iter(_ORDERS))]
    if started:
        threading.Thread(target=_compute_order, args=(*key, future), name="epoch-order", daemon=True).start()
    return future


class ShuffledBatchIndices(grain.MapDataset):
    """Batches of example indices, reshuffled every epoch.

    Args:
      num_examples: examples per epoch, >= 1.
      batch_size: B, >= 1.
      seed: shuffle seed, in [0, 2**32); None keeps the natural order.
      num_epochs: None repeats forever.

    Raises:
      ValueError: a non-positive size or epoch count, or a bad seed.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int | None, num_epochs: int | None = None):
        super().__init__()
        if num_examples < 1 or batch_size < 1:
            raise ValueError(f"num_examples and batch_size must be >= 1, got {num_examples}, {batch_size}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
        if seed is not None and not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.num_epochs = num_epochs
        self.steps_per_epoch = -(-num_examples // batch_size)

    def __len__(self) -> int:
        return sys.maxsize if self.num_epochs is None else self.num_epochs * self.steps_per_epoch

    def __str__(self) -> str:
        return f"ShuffledBatchIndices(num_examples={self.num_examples}, batch_size={self.batch_size}, seed={self.seed})"

    def epoch_order(self, epoch: int) -> np.ndarray:
        """int64 `[num_examples]`: the example order of `epoch` (shared, do not modify)."""
        if self.seed is None:
            return np.arange(self.num_examples, dtype=np.int64)
        return prefetch_epoch_order(self.num_examples, self.seed, epoch).result()

    def prefetch(self, index: int) -> None:
        """Starts computing, in a thread, the order of the epoch of batch `index` (no-op unshuffled)."""
        if self.seed is not None:
            prefetch_epoch_order(self.num_examples, self.seed, index // self.steps_per_epoch)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range [0, {len(self)})")
        epoch, step = divmod(index, self.steps_per_epoch)
        return self.epoch_order(epoch)[step * self.batch_size : (step + 1) * self.batch_size]
