"""Mosaic GPU building blocks of the JFA forward, dQ and dK/dV kernels (`walk` is their shared shape).

A work item (`Item`: one head of one 128-row tile of one sequence, read from the
sorted work list of `schedule`), the zigzag deal of items to CTAs, TMA copies
that never load slack rows, wgmma products into fresh or running accumulators,
the in-register masks (sequence edges, causal, sliding window) and the steps a
sliding window visits.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import mgpu_common
from pallas_kernels.jagged_flash_attention import schedule
from pallas_kernels.jagged_flash_attention.config import ROW_ALIGN, TILE_ROWS, WG_ROWS

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def matmul_acc(acc: jax.Array, a: jax.Array, b, staging) -> jax.Array:
    """`acc + a @ b` with `a` in registers (wgmma's register A operand); waits for it.

    The Mosaic GPU interpreter multiplies only SMEM operands into zeroed
    accumulators, so under interpretation `a` goes through `staging` (a
    swizzled SMEM buffer of its shape) and the sum is formed in registers.
    """
    if staging is None:
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))
    staging[...] = a
    plgpu.commit_smem()
    return acc + mgpu_common.matmul(staging, b, acc.shape)


@dataclasses.dataclass(frozen=True)
class Item:
    """One work item: one head of one tile record (int32 scalars; see `schedule`)."""

    head: jax.Array
    row0: jax.Array
    base: jax.Array
    lo: jax.Array
    hi: jax.Array
    keys: jax.Array
    tile: jax.Array
    canon: jax.Array
    first: jax.Array

    @classmethod
    def read(cls, table_ref, p, heads: int) -> Item:
        """Item `p` of the sorted list: record `p // heads`, head `p % heads`."""
        t = lax.div(p, jnp.int32(heads))
        field = lambda f: table_ref[t, f]
        return cls(
            head=lax.rem(p, jnp.int32(heads)),
            row0=pl.multiple_of(field(schedule.F_ROW0), ROW_ALIGN),
            base=pl.multiple_of(field(schedule.F_BASE), ROW_ALIGN),
            lo=field(schedule.F_LO),
            hi=field(schedule.F_HI),
            keys=field(schedule.F_KEYS),
            tile=field(schedule.F_TILE),
            canon=field(schedule.F_CANON),
            first=field(schedule.F_FIRST),
        )

    def wg_rows(self, wg) -> tuple[jax.Array, jax.Array]:
        """Range `[lo, hi)` (within 0..64) of the rows owned by compute warpgroup `wg`."""
        pos = self.tile * TILE_ROWS + wg * WG_ROWS
        return jnp.clip(self.lo - pos, 0, WG_ROWS), jnp.clip(self.hi - pos, 0, WG_ROWS)


def zigzag_rounds(n_items, num_ctas: int, cta) -> jax.Array:
    """How many items CTA `cta` takes from a list of `n_items` dealt in a zigzag."""
    c = jnp.int32(num_ctas)
    full, rem = lax.div(n_items, c), lax.rem(n_items, c)
    position = jnp.where(lax.rem(full, 2) == 0, cta, c - 1 - cta)
    return full + (position < rem).astype(jnp.int32)


def zigzag_item(r, num_ctas: int, cta) -> jax.Array:
    """Index of the item CTA `cta` takes in round `r`."""
    c = jnp.int32(num_ctas)
    return r * c + jnp.where(lax.rem(r, 2) == 0, cta, c - 1 - cta)


def copy_rows_in(src_ref, tail_ref, row, rows: int, head, end, dst, barrier) -> None:
    """TMA `rows` packed rows of one head, from `row` (a multiple of 8), into `dst`.

    A window that crosses `end` (the first slack row) is read from the
    zero-padded tail copy instead, so no slack row and no row past the buffer
    is ever loaded. Windows that start at or past `end` are never requested.
    """
    crosses = row + rows > end

    @pl.when(crosses)
    def _():
        tail_row = pl.multiple_of(row - schedule.tail_base(end), ROW_ALIGN)
        plgpu.copy_gmem_to_smem(tail_ref.at[pl.ds(tail_row, rows), head], dst, barrier)

    @pl.when(jnp.logical_not(crosses))
    def _():
        plgpu.copy_gmem_to_smem(src_ref.at[pl.ds(pl.multiple_of(row, ROW_ALIGN), rows), head], dst, barrier)


def row_vector(value: float, n: int) -> jax.Array:
    """A `[n]` f32 vector in the layout of one value per wgmma accumulator row."""
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def zeros_tile(rows: int, cols: int) -> jax.Array:
    """float32 `[rows, cols]` zeros in the WGMMA register layout (an accumulator's start)."""
    return plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), plgpu.Layout.WGMMA)


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
    """int32 `shape` index along `dim` of each element, in the WGMMA register layout."""
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def visible(q_pos: jax.Array, k_pos: jax.Array, item: Item, causal: bool, window=None, *, inside: str = "keys") -> jax.Array:
    """Which (query, key) window positions attend: `inside` ("keys" or "queries")
    the sequence, causal, and inside the sliding `window = (left, right)`
    (`q - left <= k <= q + right`; None: unbounded).

    The other side is left unmasked: its rows are never stored.
    """
    pos = k_pos if inside == "keys" else q_pos
    mask = (pos >= item.lo) & (pos < item.hi)
    if causal:
        mask = mask & (k_pos <= q_pos)
    if window is not None:
        mask = mask & (k_pos >= q_pos - window[0]) & (k_pos <= q_pos + window[1])
    return mask


def window_steps(item: Item, block: int, causal: bool, window, *, rows: str) -> tuple[jax.Array, jax.Array]:
    """`(first, n)`: the `block`-row blocks of the other side that a sliding-window item visits.

    `rows` names what the item's 128 rows are ("queries" or "keys"); the other
    side's rows it needs are those within `window = (left, right)` of its own
    rows inside the sequence (right taken as 0 when `causal`). Blocks wholly
    outside the window are skipped.
    """
    left, right = window[0], (0 if causal else window[1])
    own_lo = jnp.maximum(item.tile * TILE_ROWS, item.lo)
    own_hi = jnp.minimum(item.tile * TILE_ROWS + TILE_ROWS, item.hi)
    if rows == "queries":  # keys k with q - left <= k <= q + right
        lo, hi = own_lo - left, own_hi + right
    else:  # queries q with k - right <= q <= k + left
        lo, hi = own_lo - right, own_hi + left
    lo, hi = jnp.maximum(lo, item.lo), jnp.minimum(hi, item.hi)
    first = lo // block
    return first, jnp.maximum((hi + block - 1) // block - first, 0) * item.keys


def copy_vector_in(src_ref, head, start, size: int, dst, barrier) -> None:
    """TMA `src_ref[head, start:start+size]` (f32, tile space) into `dst`."""
    plgpu.copy_gmem_to_smem(src_ref.at[head, pl.ds(start, size)], dst, barrier)


def load_row_vector(ref) -> jax.Array:
    """A `[64]` f32 SMEM vector, one value per accumulator row."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def load_col_vector(ref) -> jax.Array:
    """A `[64]` f32 SMEM vector, one value per accumulator column."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0))


def loop(lo, hi, body, carry):
    """`lax.fori_loop` over a dynamic range (possibly empty)."""
    return lax.fori_loop(lo, jnp.maximum(lo, hi), body, carry)
