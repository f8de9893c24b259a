"""Per-process input: each process builds only its devices' part of every global batch.

The example order of a run is global and known to every process without reading
any example: the epoch permutation comes from the shuffle seed and the example
count, and base batch shuffling (`gem_jax.data.bbs`) orders each global batch
from the examples' history lengths, which are metadata of the split. Data
parallelism gives device d the contiguous chunk d of B/D examples of that order
(`gem_jax.parallel.placement`), so a process with devices at chunk positions
`shard.chunks` builds exactly those examples: it gathers history rows and
features for its own share only, and `jax.make_array_from_process_local_data`
assembles the global batch. Together the processes build every example of a
batch once; the global batch is the one a single process would build, so BBS
still balances all devices, across hosts as well as inside one.

The last, short batch of an epoch holds its real examples at the front and
padding (weight 0) behind (`gem_jax.data.sampling`), so a process whose chunks
lie behind the last real example builds a batch of padding only: every process
runs every step, and no process runs out of data before another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from gem_jax.batch import Batch, BatchShard, LocalBatch
from gem_jax.data.collate import batch_indices


class LocalBatchBuilder:
    """Maps the example indices of a global batch to this process's `LocalBatch` (a grain map function).

    Args:
      build: `(indices, batch_size=b) -> Batch` of those examples padded to b
        (`gem_jax.data.collate.BatchBuilder`, `SyntheticBatchBuilder`).
      lengths: int64 example indices `[n]` -> their history lengths `[n]` (the
        rows `build` packs for them).
      batch_size: B, the examples of a global batch.
      shard: the chunks this process builds.

    Raises:
      ValueError: D = `shard.num_chunks` does not divide B.
    """

    def __init__(self, build: Callable[..., Batch], lengths: Callable[[np.ndarray], np.ndarray], batch_size: int, shard: BatchShard):
        if batch_size % shard.num_chunks:
            raise ValueError(f"a global batch of {batch_size} examples does not split into {shard.num_chunks} equal chunks")
        self.build = build
        self.lengths = lengths
        self.batch_size = batch_size
        self.shard = shard

    def __call__(self, indices: Sequence[int]) -> LocalBatch:
        """The `LocalBatch` of a global batch whose example `indices` (int64 `[<= B]`) are in device order.

        Returns:
          `batch`: the examples of `shard.chunks` (`len(chunks) * B/D`, real
          ones first, then padding); `lengths` `[B]` and `num_real` of the
          global batch.

        Raises:
          ValueError: more than B indices.
        """
        idx = batch_indices(indices, self.batch_size)
        b, n = self.batch_size, idx.shape[0]
        per = b // self.shard.num_chunks
        lengths = np.zeros(b, np.int64)
        lengths[:n] = self.lengths(idx)
        # Real examples hold global positions 0..n-1, so those of the local chunks come first locally too.
        local = np.concatenate([idx[c * per : (c + 1) * per] for c in self.shard.chunks])
        batch = self.build(local, batch_size=len(self.shard.chunks) * per)
        return LocalBatch(batch=batch, shard=self.shard, lengths=lengths, num_real=n)
