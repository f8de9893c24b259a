"""The JFA work list: real (sequence, tile) items, sorted by work, built on the device.

A jagged batch has no padded `[B, N]` grid. Each sequence b is viewed through
a window that starts at `base_b = offsets[b] - offsets[b] % 8` (TMA loads into
wgmma-tiled shared memory need 8-aligned row starts); inside it the sequence
occupies window positions `[lo_b, hi_b) = [offsets[b] % 8, lo_b + L_b)`. The
window is cut into `ceil(hi_b / 128)` tiles of 128 rows; zero-length sequences
contribute no tile. Rows of the buffer past `offsets[B]` (slack) form one more
window whose tiles have no keys: the kernels write zeros there, so every row of
an output is written exactly once, and only by the tile that owns it.

Everything is computed with jnp from `offsets` inside jit, with a static bound
on the number of tiles, so building the list needs no host sync:

    real tiles  <= sum_b ceil((L_b + 7) / 128) <= (T + 134 B) // 128
    slack tiles <= ceil((T + 7) / 128)

Tiles are sorted by their number of inner-loop steps, largest first (ties keep
sequence order), and the kernels deal the sorted list to their persistent CTAs
in a zigzag: round r hands item `r * C + c` to CTA `c` when r is even and to
CTA `C - 1 - c` when r is odd (`_mgpu.zigzag_item`). Slots past the live count
are never visited.

Source: GEM engineering description (Meta, 2025), jagged flash attention work
list; the zigzag dealing of sorted tiles follows the GDPA varlen scheduler in
facebookresearch/ads_model_kernel_library (`precompute_for_varline_load_balancing`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._src import work_list
from pallas_kernels.jagged_flash_attention.config import ROW_ALIGN, TAIL_BEFORE, TAIL_ROWS, TILE_ROWS

# Columns of a tile record (int32). Window positions count rows from F_BASE.
F_ROW0 = 0  # first packed row of the tile's window (multiple of ROW_ALIGN)
F_BASE = 1  # first packed row of the sequence's window (multiple of ROW_ALIGN)
F_LO = 2  # window position of the sequence's first row
F_HI = 3  # window position one past the sequence's last row
F_KEYS = 4  # 1 when the tile attends (a real sequence), 0 for slack tiles
F_TILE = 5  # index j of the tile in its window: it covers positions [128 j, 128 j + 128)
F_CANON = 6  # canonical tile index, in sequence order (addresses lse and delta)
F_FIRST = 7  # canonical index of tile 0 of the same window
NUM_FIELDS = 8

META_LIVE_TILES = 0  # tiles that own at least one row (real or slack)
META_END = 1  # offsets[B]: first slack row
META_SIZE = 2


class Plan(NamedTuple):
    """Work list of one jagged batch (all int32).

    q_table:  `[NT, NUM_FIELDS]` tile records sorted by forward / dQ work.
    kv_table: `[NT, NUM_FIELDS]` the same records sorted by dK/dV work.
    meta:     `[META_SIZE]` live tile count and `offsets[B]`.
    row0, lo, hi: `[NT]` each canonical tile's first window row and the range
      `[lo, hi)` of its 128 rows that belong to its sequence.
    """

    q_table: jax.Array
    kv_table: jax.Array
    meta: jax.Array
    row0: jax.Array
    lo: jax.Array
    hi: jax.Array


def num_tile_slots(capacity: int, batch: int) -> int:
    """Static number of tile slots NT for `capacity` rows and `batch` sequences."""
    real = (capacity + batch * (TILE_ROWS + ROW_ALIGN - 2)) // TILE_ROWS
    slack = -(-(capacity + ROW_ALIGN - 1) // TILE_ROWS)
    return max(real + slack, 1)


def _cdiv(a, b):
    return (a + b - 1) // b


def build_plan(offsets: jax.Array, capacity: int, *, causal: bool) -> Plan:
    """Builds the sorted work list of a jagged batch on the device.

    Args:
      offsets: int32 `[B+1]`, non-decreasing, `offsets[0] = 0`, `offsets[B] <= capacity`.
      capacity: static row count T of the packed buffers.
      causal: whether each query sees only keys at or before its position
        (changes the per-tile work used for sorting).

    Returns:
      A `Plan`; see its docstring for shapes.
    """
    offsets = offsets.astype(jnp.int32)
    end = offsets[-1]
    # The slack rows [end, T) are appended as one more window without keys.
    starts = jnp.concatenate([offsets[:-1], end[None]])
    lengths = jnp.concatenate([jnp.maximum(offsets[1:] - offsets[:-1], 0), (capacity - end)[None]])
    has_keys = jnp.arange(starts.shape[0]) < starts.shape[0] - 1
    lo_seq = starts % ROW_ALIGN
    hi_seq = lo_seq + lengths
    tiles_per_seq = jnp.where(lengths > 0, _cdiv(hi_seq, TILE_ROWS), 0)
    last_tile = work_list.running_total(tiles_per_seq)  # inclusive
    first_tile = last_tile - tiles_per_seq

    slots = num_tile_slots(capacity, offsets.shape[0] - 1)
    t = jnp.arange(slots, dtype=jnp.int32)
    # Window of tile t: the last window whose first tile is <= t.
    seq = work_list.segment_ids(first_tile, slots)
    live = t < last_tile[-1]
    j = t - first_tile[seq]
    base = starts[seq] - lo_seq[seq]
    keys = (has_keys[seq] & live).astype(jnp.int32)
    hi = jnp.where(live, hi_seq[seq], 0)
    records = jnp.stack([base + j * TILE_ROWS, base, lo_seq[seq], hi, keys, j, t, first_tile[seq]], axis=1)
    records = records.astype(jnp.int32)
    windows = tiles_per_seq[seq]
    if causal:
        q_work, kv_work = j + 1, windows - j
    else:
        q_work = kv_work = windows
    q_table = _sorted_by_work(records, q_work * keys, live)
    kv_table = _sorted_by_work(records, kv_work * keys, live)
    meta = jnp.stack([jnp.sum(live.astype(jnp.int32)), end])
    tile_lo = jnp.clip(lo_seq[seq] - j * TILE_ROWS, 0, TILE_ROWS)
    tile_hi = jnp.clip(hi - j * TILE_ROWS, 0, TILE_ROWS)
    return Plan(q_table, kv_table, meta, records[:, F_ROW0], tile_lo, jnp.maximum(tile_lo, tile_hi))


def _sorted_by_work(records: jax.Array, work: jax.Array, live: jax.Array) -> jax.Array:
    return work_list.heaviest_first(records, jnp.where(live, work, -1))


def tail_base(end: jax.Array) -> jax.Array:
    """First packed row held by `tail_rows` (may be negative)."""
    return end - end % ROW_ALIGN - TAIL_BEFORE


def tail_rows(x: jax.Array, end: jax.Array) -> jax.Array:
    """Rows `[tail_base(end), tail_base(end) + TAIL_ROWS)` of `x [T, ...]`, zero outside `[0, end)`.

    A kernel window that starts before `end` and runs past it is read from this
    copy instead of `x`, so slack rows (which may hold anything, NaN included)
    and rows past the buffer never reach a matrix product.
    """
    rows = tail_base(end) + jnp.arange(TAIL_ROWS, dtype=jnp.int32)
    valid = (rows >= 0) & (rows < end)
    gathered = x[jnp.clip(rows, 0, x.shape[0] - 1)]
    mask = valid.reshape((TAIL_ROWS,) + (1,) * (x.ndim - 1))
    return jnp.where(mask, gathered, jnp.zeros((), x.dtype))


def to_tile_space(values: jax.Array, plan: Plan) -> jax.Array:
    """Packed per-row values `[T, H]` -> `[H, NT * TILE_ROWS]` in canonical tile order.

    Window row r of canonical tile t lands at column `t * TILE_ROWS + r`; rows
    outside the tile's sequence are 0.
    """
    r = jnp.arange(TILE_ROWS, dtype=jnp.int32)
    rows = plan.row0[:, None] + r[None, :]
    valid = (r[None, :] >= plan.lo[:, None]) & (r[None, :] < plan.hi[:, None])
    gathered = values[jnp.clip(rows, 0, values.shape[0] - 1)]  # [NT, TILE, H]
    gathered = jnp.where(valid[..., None], gathered, jnp.zeros((), values.dtype))
    return gathered.reshape(-1, values.shape[1]).T

