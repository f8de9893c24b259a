"""The block-local work list: one record per 64-row block of a jagged batch, built on the device.

Sequence b is cut into `ceil(L_b / 64)` blocks starting at `offsets[b]` (the
last one partial); zero-length sequences contribute none. The slack rows
`[offsets[B], T)` form further blocks without keys, for which the kernels
write zeros, so every output row is written exactly once. Blocks are listed in
sequence order (all real blocks cost the same); the kernels' work items are
the blocks, each with all H heads, dealt to their persistent CTAs round-robin
(block `r * C + c` to CTA c in round r; `_mgpu.walk`). Slots past the live
count are never visited.

Static bound on the number of blocks, with no host sync:

    real blocks  <= sum_b ceil(L_b / 64) <= (T + 63 B) // 64
    slack blocks <= ceil(T / 64)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._src import work_list
from pallas_kernels.block_local_attention.config import BLOCK

# Columns of a block record (int32).
F_START = 0  # packed row of the block's first row
F_ROWS = 1  # rows in the block, 1..64
F_KEYS = 2  # 1 for a block of a real sequence, 0 for slack
NUM_FIELDS = 3


class Plan(NamedTuple):
    """Work list of one jagged batch.

    table: int32 `[NB, NUM_FIELDS]` block records; rows past `live` are unused.
    live: int32 `[1]` number of blocks (real and slack).
    end: int32 `[1]` `offsets[B]`, the first slack row.
    positions: float32 `[NB, 64]` RoPE position of each row of each block.
    """

    table: jax.Array
    live: jax.Array
    end: jax.Array
    positions: jax.Array


def num_block_slots(capacity: int, batch: int) -> int:
    """Static number of block slots NB for `capacity` rows and `batch` sequences."""
    return max((capacity + (BLOCK - 1) * batch) // BLOCK + -(-capacity // BLOCK), 1)


def build_plan(offsets: jax.Array, capacity: int, positions: jax.Array | None) -> Plan:
    """Builds the work list on the device.

    Args:
      offsets: int32 `[B+1]`, non-decreasing, `offsets[0] = 0`, `offsets[B] <= capacity`.
      capacity: static row count T of the packed buffers.
      positions: `[T]` RoPE position of each row, or None for each row's index
        inside its sequence.

    Returns:
      A `Plan`.
    """
    offsets = offsets.astype(jnp.int32)
    end = offsets[-1]
    starts = jnp.concatenate([offsets[:-1], end[None]])
    lengths = jnp.concatenate([jnp.maximum(offsets[1:] - offsets[:-1], 0), (capacity - end)[None]])
    has_keys = jnp.arange(starts.shape[0]) < starts.shape[0] - 1
    per_seq = (lengths + BLOCK - 1) // BLOCK
    last = work_list.running_total(per_seq)
    first = last - per_seq
    slots = num_block_slots(capacity, offsets.shape[0] - 1)
    t = jnp.arange(slots, dtype=jnp.int32)
    seq = work_list.segment_ids(first, slots)  # sequence of each slot
    live = t < last[-1]
    j = t - first[seq]
    start = jnp.where(live, starts[seq] + j * BLOCK, 0)
    rows = jnp.where(live, jnp.clip(lengths[seq] - j * BLOCK, 0, BLOCK), 0)
    keys = (has_keys[seq] & live).astype(jnp.int32)
    table = jnp.stack([start, rows, keys], axis=1).astype(jnp.int32)
    r = jnp.arange(BLOCK, dtype=jnp.int32)
    if positions is None:
        pos = (j[:, None] * BLOCK + r[None, :]).astype(jnp.float32)
    else:
        idx = jnp.clip(start[:, None] + r[None, :], 0, max(capacity - 1, 0))
        pos = positions.astype(jnp.float32)[idx] if capacity else jnp.zeros((slots, BLOCK), jnp.float32)
    pos = jnp.where(r[None, :] < rows[:, None], pos, 0.0)
    return Plan(table, jnp.sum(live.astype(jnp.int32))[None], end[None], pos)
