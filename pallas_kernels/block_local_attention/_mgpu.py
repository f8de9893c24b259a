"""Mosaic GPU building blocks of the block-local forward and backward kernels, and their persistent walk.

Both kernels are persistent: a fixed grid of CTAs (the GPU's SM count), each
one warpgroup, walks the work items `p = r * C + c` (CTA c, round r) of the
work list, one item being one head of one 64-row block (`Item`). Shared memory
holds a ring of `NUM_SLOTS` = 3 slots of the block operands; `walk` runs the
software pipeline

    round r:  wait until the output stores of items <= r - 2 have read their slots
              issue the TMA loads of item r + 1 into slot (r + 1) % 3
              wait for item r's loads (slot r % 3), compute, issue its output
              stores from the same slot, commit them as one bulk-copy group

so the loads of the next item run under the current item's compute and the
stores of the previous item drain under it too: nothing waits for a store
except a slot's reuse two rounds later. One warpgroup suffices because the
work per item is fixed and small (two or five 64-row wgmmas): a separate
producer warpgroup, as in the JFA and GDPA kernels, pays off when a consumer
streams many blocks per item and must not stall between them; here the
producer would issue one item's loads per round, which the computing
warpgroup does at the top of the round without waiting. Source: persistent
kernels with a TMA ring, as in FlashAttention-3 (Shah et al., 2024).

A block starts at any packed row, so its operands are copied by TMA into plain
(untiled) shared memory, which takes any row start, and rewritten in registers
(RoPE applied, rows past the block zeroed) into the 128-byte swizzled layout
wgmma reads, over the same bytes of the same slot. Outputs leave through a
slot's plain view as TMA stores of 64, 32, ..., 1 rows, so no row outside the
block is ever written. Slack blocks (no keys) load nothing and store zeros.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import manual_axes, mgpu_common
from pallas_kernels.block_local_attention import schedule
from pallas_kernels.block_local_attention.config import BLOCK, NUM_SLOTS
from pallas_kernels.jagged_flash_attention import schedule as jfa_schedule

LAYOUT = plgpu.Layout.WGMMA


def operand_ring(head_dim: int, dtype) -> plgpu.RefUnion:
    """`[NUM_SLOTS, 64, D]` shared memory with a plain view (TMA in and out) and a swizzled
    view (wgmma) of the same bytes; slot i of either view is the i-th `64 x D` run of bytes."""
    shape = (NUM_SLOTS, BLOCK, head_dim)
    return plgpu.RefUnion(plgpu.SMEM(shape, dtype), mgpu_common.swizzled_smem(shape, dtype))


def ring_barriers() -> plgpu.Barrier:
    """One TMA barrier per ring slot; each use of a slot completes one phase."""
    return plgpu.Barrier(num_barriers=NUM_SLOTS)


@dataclasses.dataclass(frozen=True)
class Item:
    """One work item: one head of one block record (int32 scalars; see `schedule`)."""

    blk: jax.Array
    head: jax.Array
    start: jax.Array
    rows: jax.Array
    keys: jax.Array

    @classmethod
    def read(cls, table_ref, p, heads: int) -> Item:
        """Item `p`: block record `p // heads`, head `p % heads`."""
        blk = lax.div(p, jnp.int32(heads))
        field = lambda f: table_ref[blk, f]
        return cls(blk, lax.rem(p, jnp.int32(heads)), field(schedule.F_START), field(schedule.F_ROWS),
                   field(schedule.F_KEYS))


def walk(table_ref, live_ref, heads: int, num_ctas: int, *, load: Callable[[Item, jax.Array], None],
         attend: Callable[[Item, jax.Array], None], slack: Callable[[Item, jax.Array], None]) -> None:
    """The persistent, software-pipelined loop of a CTA over its items (see the module docstring).

    Args:
      table_ref, live_ref: the plan's block records and live block count.
      heads: H; there are `live * H` items.
      num_ctas: C, the grid size.
      load: `load(item, slot)` issues the TMA loads of an item with keys into ring slot `slot`.
      attend: `attend(item, slot)` waits for them, computes, and issues the item's output stores
        from `slot` (`store_block`).
      slack: `slack(item, slot)` issues zero stores for an item without keys from `slot`.
    """
    cta = lax.axis_index("cta")
    n_items = live_ref[0] * heads
    rounds = lax.div(jnp.maximum(n_items - cta + (num_ctas - 1), 0), jnp.int32(num_ctas))
    last = jnp.maximum(n_items - 1, 0)  # reads past the CTA's last round stay inside the table
    item_at = lambda r: Item.read(table_ref, jnp.minimum(r * num_ctas + cta, last), heads)

    first = item_at(0)

    @pl.when((rounds > 0) & (first.keys > 0))
    def _():
        load(first, jnp.int32(0))

    def round_body(r, carry):
        slot = lax.rem(r, NUM_SLOTS)
        # One store group per round: at most item r - 1's may still read its slot, so
        # slot (r + 1) % 3 (item r - 2's) and slot r % 3 (item r - 3's) are free.
        plgpu.wait_smem_to_gmem(NUM_SLOTS - 2, wait_read_only=True)
        nxt = item_at(r + 1)

        @pl.when((r + 1 < rounds) & (nxt.keys > 0))
        def _():
            load(nxt, lax.rem(r + 1, NUM_SLOTS))

        item = item_at(r)

        @pl.when(item.keys > 0)
        def _():
            attend(item, slot)

        @pl.when(item.keys == 0)
        def _():
            slack(item, slot)

        plgpu.commit_smem_to_gmem_group()
        return carry

    lax.fori_loop(0, rounds, round_body, None)
    plgpu.wait_smem_to_gmem(0)


def launch(kernel, scratch, out_type, num_ctas: int, *operands):
    """Runs `kernel(*refs, *scratch_refs)` as a persistent kernel of `num_ctas` one-warpgroup CTAs."""
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(approx_math=False),
    )
    return manual_axes.call_kernel(call, *operands)


def copy_block_in(src_ref, tail_ref, item: Item, end, dst, barrier) -> None:
    """TMA packed rows `[start, start + 64)` of the item's head into the plain `dst`.

    A block that runs past `end` (the first slack row) is read from the
    zero-padded tail copy (`jagged_flash_attention.schedule.tail_rows`), so no
    slack row and no row past the buffer is loaded.
    """
    start, head = item.start, item.head
    crosses = start + BLOCK > end

    @pl.when(crosses)
    def _():
        plgpu.copy_gmem_to_smem(tail_ref.at[pl.ds(start - jfa_schedule.tail_base(end), BLOCK), head], dst, barrier)

    @pl.when(jnp.logical_not(crosses))
    def _():
        plgpu.copy_gmem_to_smem(src_ref.at[pl.ds(start, BLOCK), head], dst, barrier)


def load_operands(operands, item: Item, slot, end, pos=None) -> None:
    """Issues the TMA loads of an item into ring slot `slot`.

    `operands`: `(src_ref, tail_ref, ring, barriers)` per operand (`operand_ring`,
    `ring_barriers`); `pos`: `(pos_ref, pos_ring, barriers)` for the block's RoPE
    positions, or None.
    """
    for src, tail, ring, bars in operands:
        copy_block_in(src, tail, item, end, ring[0].at[slot], bars.at[slot])
    if pos is not None:
        pos_ref, pos_ring, bars = pos
        plgpu.copy_gmem_to_smem(pos_ref.at[item.blk], pos_ring.at[slot], bars.at[slot])


def rope_tables(pos_smem, freq_smem, half: int) -> tuple[jax.Array, jax.Array]:
    """`(cos, sin)` float32 `[64, D/2]` of `positions[row] * freq[col]` (accurate, not approximate, sin/cos)."""
    pos = plgpu.load(pos_smem, layout=LAYOUT.reduce(1))
    freq = plgpu.load(freq_smem, layout=LAYOUT.reduce(0))
    shape = (BLOCK, half)
    angles = lax.broadcast_in_dim(pos, shape, [0]) * lax.broadcast_in_dim(freq, shape, [1])
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, tables, *, inverse: bool = False) -> jax.Array:
    """Rotate-half RoPE of a float32 `[64, D]` tile, or its transpose (the backward) when `inverse`."""
    cos, sin = tables
    half = x.shape[1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    if inverse:
        return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)


def row_iota(cols: int) -> jax.Array:
    """int32 `[64, cols]` row index of each element, in the kernels' register layout."""
    return plgpu.broadcasted_iota(jnp.int32, (BLOCK, cols), 0, layout=LAYOUT)


def col_iota(cols: int) -> jax.Array:
    """int32 `[64, cols]` column index of each element, in the kernels' register layout."""
    return plgpu.broadcasted_iota(jnp.int32, (BLOCK, cols), 1, layout=LAYOUT)


def swizzle_operand(ring, slot, rows, tables=None):
    """Rewrites the loaded plain `[64, D]` operand of ring slot `slot` in place as its swizzled view.

    Rows at or past `rows` (other sequences' rows) become 0; with `tables`,
    RoPE is applied first (in float32, rounded once to the operand dtype, as
    the unfused `rope` does). Returns the swizzled slot; the caller commits
    shared memory before wgmma reads it.
    """
    plain, swizzled = ring[0].at[slot], ring[1].at[slot]
    x = plgpu.load(plain, layout=LAYOUT, optimized=False).astype(jnp.float32)
    if tables is not None:
        x = rotate(x, tables)
    x = jnp.where(row_iota(x.shape[1]) < rows, x, 0.0)
    plgpu.commit_smem()  # every thread has read the plain view before the swizzled view overwrites it
    swizzled[...] = x.astype(plain.dtype)
    return swizzled


def mask_keys(s: jax.Array, rows, *, axis: int) -> jax.Array:
    """`s` with the entries of keys (along `axis`) at or past `rows` set to -inf."""
    pos = col_iota(s.shape[1]) if axis == 1 else row_iota(s.shape[1])
    return jnp.where(pos < rows, s, -jnp.inf)


def matmul(a, b, shape: tuple[int, int]) -> jax.Array:
    """`a @ b` of two shared-memory operands into a fresh float32 accumulator."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def store_block(value: jax.Array, plain, dst_ref, item: Item) -> None:
    """Stores rows `[0, rows)` of a `[64, D]` value to `dst_ref[start + i, head]` through `plain`.

    TMA boxes have static sizes, so the rows leave as stores of 64, 32, ..., 1
    rows (one per set bit of `rows`). The stores join the round's bulk-copy
    group (`walk` commits it and waits for it before `plain` is reused).
    """
    start, rows, head = item.start, item.rows, item.head
    plain[...] = value
    plgpu.commit_smem()
    done = 0
    size = BLOCK
    while size:

        @pl.when(lax.bitwise_and(rows, jnp.int32(size)) != 0)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(plain.at[pl.ds(done, size)], dst_ref.at[pl.ds(start + done, size), head],
                                    commit_group=False)

        done = done + lax.bitwise_and(rows, jnp.int32(size))
        size //= 2


def zeros(cols: int) -> jax.Array:
    """float32 `[64, cols]` zeros in the kernels' register layout (an accumulator's start)."""
    return plgpu.layout_cast(jnp.zeros((BLOCK, cols), jnp.float32), LAYOUT)
