"""GDPA work list, built on the device: non-empty items only, sorted by work, dealt in a zigzag.

A work item is `(sequence b, head h, row tiles [t0, t1))` of one engine call
(at most `row_tiles_per_item` row tiles per item, so resident columns are
loaded once per item).

Tiles are aligned to 8 rows: Mosaic GPU's TMA moves whole 8-row tiles of the
swizzled SMEM layout, so every copy starts at a multiple of 8. A sequence that
starts at row s is cut into tiles starting at `s - delta`, `delta = s % 8`; its
rows sit at `[delta, delta + L)` of that tile grid. All operands on one side of
a pass share `delta` (they share offsets, or start at multiples of 8).
Sequences without rows give no item. Output rows past the real data (slack)
form one extra pseudo-sequence with no columns, whose items write zeros, so
every output row is written exactly once.

The list has a static bound, so no host sync is needed under jit:

    items per head <= sum_b ceil((L_b + 7) / (R K)) <= (T + (B + 1) (R K + 6)) // (R K)

with T the output rows, R the rows per tile and K the tiles per item. Items are
sorted by `row tiles x (column steps + 1)` (column steps capped at the static
bound), heaviest first (ties keep sequence order), and dealt to the persistent
CTAs in a zigzag: round r gives sorted item `r C + c` to CTA c when r is even
and to CTA `C - 1 - c` when r is odd, so every CTA gets one of the heaviest and
one of the lightest items of each pair of rounds. Unused slots hold an empty
item (t0 = t1). With `group_sequences` the items are sorted by their
sequence's work instead, each sequence's items together, so the CTAs side by
side work on one sequence's row tiles and stream its columns at about the same
time (`benchmarks/gdpa_schedule_stats.py` reads the lists' working sets).

The list is small integer work whose cost on a GPU is its launches: it is built
from `work_list`'s compare-and-sums over all pairs (the running total of items
over sequences, each item's sequence, each item's rank heaviest first), eight
XLA kernels on the benchmark's dense shapes where cumulative sums and a
counting sort took 8 to 14 (`benchmarks/gdpa_launches.py`). Past about 2,000
items per head the pairs' work would outgrow those launches and `work_list`
takes the scan and sort forms; such a call's attention runs for milliseconds.

Source: GEM engineering description (Meta, 2025), GDPA tile scheduling; the
sorted zigzag dealing follows `precompute_for_varline_load_balancing` in
facebookresearch/ads_model_kernel_library (gdpa/src/interface.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._src import work_list
from pallas_kernels.gdpa import config

# Columns of a schedule record.
F_SEQ, F_HEAD, F_T0, F_T1 = range(4)
NUM_FIELDS = 4
# Columns of the per-sequence table; the operands' 8-aligned start rows follow.
S_ROW_LEN, S_COL_LEN, S_ROW_DELTA, S_COL_DELTA = 0, 1, 2, 3
S_STARTS = 4
ALIGN = config.ALIGN


class Plan(NamedTuple):
    """Device-side work list of one engine call (all int32).

    sched: `[C, S, NUM_FIELDS]` the items of CTA c, in the order it runs them.
    seqs:  `[B + 1, S_STARTS + n]` per sequence (the last is the slack): row
      length, column length, row and column alignment deltas, then per-operand
      columns (see `build`).
    """

    sched: jax.Array
    seqs: jax.Array


def items_per_head_bound(out_rows: int, batch: int, rows_per_item: int) -> int:
    """Static bound on the items of one head (see the module docstring)."""
    return max(1, (out_rows + (batch + 1) * (rows_per_item - 1 + ALIGN - 1)) // rows_per_item)


def steps(length: jax.Array, delta: jax.Array, block: int) -> jax.Array:
    """Tiles of `block` rows covering `[delta, delta + length)`; none for an empty sequence."""
    return jnp.where(length > 0, (length + delta + block - 1) // block, 0)


def build(
    row_lens: jax.Array,
    col_lens: jax.Array,
    row_delta: jax.Array,
    col_delta: jax.Array,
    columns: jax.Array,
    *,
    out_rows: int,
    heads: int,
    rows_per_tile: int,
    tiles_per_item: int,
    block_cols: int,
    max_col_steps: int,
    num_ctas: int,
    causal: str | None = None,
    group_sequences: bool = False,
) -> Plan:
    """Sorted, zigzag-dealt work list.

    Args:
      row_lens, col_lens: int32 `[B + 1]` rows and columns of each sequence; the
        last entry is the slack pseudo-sequence (its rows, no columns).
      row_delta, col_delta: int32 `[B + 1]` in [0, 8): sequence start mod 8.
      columns: int32 `[B + 1, n]` further per-sequence columns (aligned operand
        starts and the like) copied into `seqs`.
      out_rows: static T, the sum of `row_lens` at most (output capacity).
      heads: H.
      rows_per_tile, tiles_per_item, block_cols: tile geometry.
      max_col_steps: static bound on a sequence's column steps (a longer one is
        ordered as if it had this many).
      num_ctas: persistent CTAs C.
      causal: None, or a `Causal` mode: an
        item's work then counts only the column steps each of its row tiles
        visits (`causal_col_steps`).
      group_sequences: order items by their sequence's work (the sum of its
        items'), heaviest sequence first, each sequence's items together in row
        order (an item's H heads side by side), instead of by their own work: a
        sequence's items then go to neighbouring CTAs of one round, or of two
        where the round ends (the zigzag turns back along the same CTAs), one
        sequence and head on every H-th of them.

    Returns:
      A `Plan`.
    """
    row_lens = row_lens.astype(jnp.int32)
    col_lens = col_lens.astype(jnp.int32)
    n_seq = row_lens.shape[0]
    rows_per_item = rows_per_tile * tiles_per_item
    per_head = items_per_head_bound(out_rows, n_seq - 1, rows_per_item)

    tiles = steps(row_lens, row_delta, rows_per_tile)
    items = -(-tiles // tiles_per_item)
    last = work_list.running_total(items)  # items up to sequence b
    i = jnp.arange(per_head, dtype=jnp.int32)
    seq = jnp.minimum(work_list.counts_at_or_below(last, per_head), n_seq - 1)  # first b with last[b] > i
    t0 = (i - (last[seq] - items[seq])) * tiles_per_item
    t1 = jnp.minimum(t0 + tiles_per_item, tiles[seq])
    live = i < last[-1]
    t0 = jnp.where(live, t0, 0)
    t1 = jnp.where(live, t1, 0)
    col_steps = jnp.minimum(steps(col_lens[seq], col_delta[seq], block_cols), max_col_steps)
    if causal is None:
        work = (t1 - t0) * (col_steps + 1)
    else:
        work = sum(
            jnp.where(t0 + k < t1, causal_col_steps(causal, t0 + k, col_steps, rows_per_tile, block_cols) + 1, 0)
            for k in range(tiles_per_item)
        )
    work = jnp.where(live, work, -1)
    if group_sequences:
        # Each item takes its sequence's summed work (differences of the running total at the sequence's
        # first and last item); items are in sequence order, so a stable sort keeps each sequence together.
        total = work_list.running_total(jnp.maximum(work, 0))
        before = jnp.concatenate([jnp.zeros(1, jnp.int32), total])  # before[j]: the work of items below j
        seq_work = before[last] - before[last - items]
        work = jnp.where(live, seq_work[seq], -1)

    # Sorted heaviest first, item (i, h) is at position p = rank(i) H + h: the heads of one item
    # share its work and are adjacent in (i, h) order, as a stable sort keeps them.
    by_work = work_list.heaviest_first(jnp.stack([seq, t0, t1], axis=1), work)
    n_items = per_head * heads
    slots = -(-n_items // num_ctas)
    rnd = jnp.arange(slots, dtype=jnp.int32)[None, :]
    cta = jnp.arange(num_ctas, dtype=jnp.int32)[:, None]
    p = rnd * num_ctas + jnp.where(rnd % 2 == 0, cta, num_ctas - 1 - cta)  # the zigzag deal
    seq_t0_t1 = by_work[jnp.minimum(p // heads, per_head - 1)]
    sched = jnp.concatenate([seq_t0_t1[..., :1], (p % heads)[..., None], seq_t0_t1[..., 1:]], axis=-1)
    sched = jnp.where((p < n_items)[..., None], sched, 0)  # past the last item: the empty item

    head_cols = [row_lens, col_lens, row_delta.astype(jnp.int32), col_delta.astype(jnp.int32)]
    seqs = jnp.concatenate([jnp.stack(head_cols, axis=1), columns.astype(jnp.int32)], axis=1)
    return Plan(sched=sched.astype(jnp.int32), seqs=seqs)


class Causal:
    """Causal passes of self-attention (rows and columns of one sequence, one position grid).

    KEYS_UP_TO_ROW: rows are queries, columns keys; column c is kept for row r when c <= r.
    QUERIES_FROM_ROW: rows are keys, columns queries; column c is kept for row r when c >= r.
    Column steps wholly on the other side of a row tile are skipped.
    """

    KEYS_UP_TO_ROW = "keys_up_to_row"
    QUERIES_FROM_ROW = "queries_from_row"


def causal_col_steps(causal: str, t, n_col, rows_per_tile: int, block_cols: int):
    """How many of its `n_col` column steps row tile `t` visits under `causal` (a `Causal` mode).

    KEYS_UP_TO_ROW visits the first ones, QUERIES_FROM_ROW the last ones. Used
    by the kernels (non-negative int32 scalars) and by the work estimate.
    """
    c = jnp.int32(block_cols)
    if causal == Causal.KEYS_UP_TO_ROW:
        return jnp.minimum(n_col, lax.div(t * rows_per_tile + rows_per_tile - 1, c) + 1)
    return n_col - jnp.minimum(lax.div(t * rows_per_tile, c), n_col)


def tail_base(end: jax.Array, block: int) -> jax.Array:
    """First row of the tail window: the multiple of 8 at or below `end - block`."""
    return ((end - block) // ALIGN) * ALIGN


def tail_window(x: jax.Array, end: jax.Array, block: int) -> jax.Array:
    """Rows `[base, base + 2 block + 8)` of `x [T, ...]` (base = `tail_base`), zero outside `[0, end)`.

    A column window of `block` rows that starts (8-aligned) before `end`, the
    first slack row, and runs past it is read from this copy, so slack rows
    (which may hold anything, NaN included) never enter a matrix product. Such a
    window starts above `end - block` and at most `block + 7` rows past `base`.
    """
    n = 2 * block + ALIGN
    rows = tail_base(end, block) + jnp.arange(n, dtype=jnp.int32)
    valid = (rows >= 0) & (rows < end)
    gathered = x[jnp.clip(rows, 0, x.shape[0] - 1)]
    mask = valid.reshape((n,) + (1,) * (x.ndim - 1))
    return jnp.where(mask, gathered, jnp.zeros((), x.dtype))
