"""Mosaic GPU building blocks of the block-local forward and backward kernels, and their persistent walk.

Both kernels are persistent: a fixed grid of CTAs, each of W consumer
warpgroups (W = 1, or 2 in the backward at D=128; `config`), walks the 64-row
blocks `b = r * C + c` (CTA c, round r) of the work list, one work item being
one block with all its heads (`Step` is one head of it). Per block, the record
is read from the table once and RoPE's cos/sin tables (`Rope`) are computed
once per warpgroup that computes any of its heads, on its first step of the
block (head h < W), and kept in its registers for the block's other heads it
computes: they depend on the row's position and the column only, not on the
head. Shared memory holds one ring per CTA of S slots of one step's operands
(S = 2 forward, 3 backward; `config`); `walk` runs the software pipeline over
the CTA's steps `s = r * H + h` (block r's head h), across block boundaries,
warpgroup `s % W` computing step s:

    step s:  wait until this warpgroup's output stores of its steps <= s + 1 - S have
             read their slots
             issue the TMA loads of step s + 1 into slot (s + 1) % S (head h + 1 of
             this block, or head 0 of the next one; with the block's RoPE positions
             where step s + 1 is a warpgroup's first step of the block)
             on a warpgroup's first step of a block with keys: wait for its positions,
             compute the tables
             wait for step s's loads (slot s % S), compute, issue its output
             stores from the same slot, commit them as one bulk-copy group

so the loads of the next step run under the current step's compute, and with
three slots the stores of the previous step drain under it too (with two, a
step first waits until the previous step's stores have read its slot; nothing
else waits for a store).

A step is latency, not bandwidth: one warpgroup runs its phases in series.
Two steps are in flight per SM when two CTAs share it (`config`'s CTAs per
SM: the grid is that many times the SM count), each CTA this same walk with
its own ring, barriers and bulk-copy groups; or, where two CTAs' rings do not
fit an SM's shared memory (the backward at D=128), when two consumer
warpgroups share one CTA's ring, taking its steps alternately. Either way the
SM's warp schedulers interleave one step's serial phases (shared memory ->
registers -> RoPE -> swizzled rewrite, softmax, output staging) with the
other's loads and wgmmas. With W warpgroups and S - 1 a multiple of W, the
slot step s + 1 loads into was last used by step s + 1 - S, computed by the
warpgroup that issues the load (step s's): a slot's reuse waits for that
warpgroup's own reads (program order) and its own store groups, which are
per issuing thread, so per warpgroup; no other warpgroup has to signal it.
The hand-over of a slot to the other warpgroup is the step's TMA barrier
(the loader waited for the slot's stores before issuing); a slack step,
which loads nothing, is handed over by a barrier its loader arrives on. Every
barrier of the ring is indexed by slot and computing warpgroup (`Slot`), so
that one warpgroup waits for all of a barrier's phases: Mosaic GPU tracks a
barrier's phase parity per thread. Each warpgroup waits for the other only
through these barriers, so at most two steps compute at once and the third
slot loads. A separate producer warpgroup, as in the JFA and GDPA kernels,
pays off when a consumer streams many blocks per item and must not stall
between them; here it would issue one step's loads per step, which the
computing warpgroup does at the top of the step without waiting. Source:
persistent kernels with a TMA ring, as in FlashAttention-3 (Shah et al.,
2024).

A block starts at any packed row, so its operands are copied by TMA into plain
(untiled) shared memory, which takes any row start, and rewritten in registers
(RoPE applied, rows past the block zeroed) into the 128-byte swizzled layout
wgmma reads, over the same bytes of the same slot. Outputs leave through a
slot's plain view as TMA stores of 64 rows, or of 8 and 1 for a partial block
(`store_block`), so no row outside the block is ever written. Slack blocks (no
keys) load nothing and store zeros.
"""


from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import bounded_trig, manual_axes, mgpu_common
from pallas_kernels.block_local_attention import schedule
from pallas_kernels.block_local_attention.config import BLOCK
from pallas_kernels.jagged_flash_attention import schedule as jfa_schedule

LAYOUT = plgpu.Layout.WGMMA
WARPGROUP_AXIS = "wg"


def operand_ring(slots: int, head_dim: int, dtype) -> plgpu.RefUnion:
    """`[slots, 64, D]` shared memory with a plain view (TMA in and out) and a swizzled
    view (wgmma) of the same bytes; slot i of either view is the i-th `64 x D` run of bytes."""
    shape = (slots, BLOCK, head_dim)
    return plgpu.RefUnion(plgpu.SMEM(shape, dtype), mgpu_common.swizzled_smem(shape, dtype))


def ring_barriers(slots: int, warpgroups: int = 1) -> plgpu.Barrier:
    """One barrier per ring slot and computing warpgroup (`Slot.barrier`); each step that
    warpgroup computes in the slot completes one phase, and only that warpgroup waits on it."""
    return plgpu.Barrier(num_barriers=slots * warpgroups)


def warpgroup(warpgroups: int) -> jax.Array:
    """This warpgroup's index in its CTA (`launch`'s `warpgroups`; 0 with one)."""
    return lax.axis_index(WARPGROUP_AXIS) if warpgroups > 1 else jnp.int32(0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slot:
    """A step's ring slot `index` (`s % S`) and the `barrier` its loads arrive on: `index * W + s % W`
    with W warpgroups (`index` with one), so a barrier's phases are all waited for by the one
    warpgroup computing them (a warpgroup that skipped a phase would read the next one's parity)."""

    index: jax.Array
    barrier: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Step:
    """One step: one head of one block record (int32 scalars; see `schedule`)."""

    blk: jax.Array
    head: jax.Array
    start: jax.Array
    rows: jax.Array
    keys: jax.Array

    @classmethod
    def read(cls, table_ref, blk) -> Step:
        """Head 0 of block record `blk`."""
        field = lambda f: table_ref[blk, f]
        return cls(blk, jnp.int32(0), field(schedule.F_START), field(schedule.F_ROWS), field(schedule.F_KEYS))

    def at_head(self, head) -> Step:
        """The same block's step of head `head` (int32 scalar)."""
        return dataclasses.replace(self, head=head)


@dataclasses.dataclass(frozen=True)
class Rope:
    """A kernel's fused RoPE: a ring of block positions (`[S, 64]` float32 SMEM, barriers as
    `ring_barriers`, filled with each warpgroup's first step of a block: heads 0 .. W - 1), the
    frequencies (`[D/2]` float32 SMEM, loaded once per CTA) and the plan's positions `[NB, 64]` in GMEM.
    `bounded`: every angle (position x frequency) is at most `bounded_trig.MAX_ANGLE`, so the tables
    take `bounded_trig.sin_cos` instead of CUDA's general `sinf` / `cosf`."""

    pos_ref: jax.Array
    pos_ring: jax.Array
    pos_bars: jax.Array
    freq_smem: jax.Array
    bounded: bool

    def load(self, step: Step, slot: Slot) -> None:
        """Issues the TMA load of the step's block positions into ring slot `slot`."""
        plgpu.copy_gmem_to_smem(self.pos_ref.at[step.blk], self.pos_ring.at[slot.index], self.pos_bars.at[slot.barrier])

    def tables(self, slot: Slot) -> tuple[jax.Array, jax.Array]:
        """Waits for slot `slot`'s positions; `(cos, sin)` float32 `[64, D/2]` of `positions[row] * freq[col]`
        (accurate, not approximate, sin/cos: `bounded_trig.sin_cos` where `bounded`, else CUDA's)."""
        plgpu.barrier_wait(self.pos_bars.at[slot.barrier])
        pos = plgpu.load(self.pos_ring.at[slot.index], layout=LAYOUT.reduce(1))
        freq = plgpu.load(self.freq_smem, layout=LAYOUT.reduce(0))
        shape = (BLOCK, self.freq_smem.shape[0])
        angles = lax.broadcast_in_dim(pos, shape, [0]) * lax.broadcast_in_dim(freq, shape, [1])
        if self.bounded:
            sin, cos = bounded_trig.sin_cos(angles)
            return cos, sin
        return jnp.cos(angles), jnp.sin(angles)

    def empty(self) -> tuple[jax.Array, jax.Array]:
        """Zero tables: the loop carry's value before a CTA's first block with keys."""
        half = self.freq_smem.shape[0]
        return zeros(half), zeros(half)


def fused_rope(rope: bool, freq_ref, freq_smem, freq_bar, pos_ref, pos_ring, pos_bars,
               warpgroups: int = 1, *, bounded: bool = False) -> Rope | None:
    """The kernel's `Rope` (`bounded` as there) with its frequencies loaded into `freq_smem` (once per
    CTA: warpgroup 0 issues the copy, every warpgroup waits for its one phase), or None without RoPE."""
    if not rope:
        return None

    copy = lambda: plgpu.copy_gmem_to_smem(freq_ref, freq_smem, freq_bar)
    pl.when(True if warpgroups == 1 else warpgroup(warpgroups) == 0)(copy)
    plgpu.barrier_wait(freq_bar)
    return Rope(pos_ref, pos_ring, pos_bars, freq_smem, bounded)


def swizzle_loaded(operands, rotated, slot: Slot, rows, tables) -> list[jax.Array]:
    """Waits for each operand's loads into ring slot `slot` and rewrites it as its swizzled view
    (`swizzle_operand`; RoPE with `tables` where `rotated`); returns the swizzled slots, in order.

    `operands`: `(src_ref, tail_ref, ring, barriers)` per operand, as `load_operands` takes them.
    """
    swizzled = []
    for (_, _, ring, bars), rotate_it in zip(operands, rotated, strict=True):
        plgpu.barrier_wait(bars.at[slot.barrier])
        swizzled.append(swizzle_operand(ring, slot.index, rows, tables if rotate_it else None))
    return swizzled


def walk(table_ref, live_ref, heads: int, num_ctas: int, slots: int, *, load: Callable[[Step, Slot], None],
         attend: Callable[[Step, Slot, tuple[jax.Array, jax.Array] | None], None],
         slack: Callable[[Step, Slot], None], rope: Rope | None = None, warpgroups: int = 1,
         handoff: jax.Array | None = None) -> None:
    """The persistent, software-pipelined loop of a CTA over its blocks' steps (see the module docstring).

    Args:
      table_ref, live_ref: the plan's block records and live block count.
      heads: H, the steps of one block.
      num_ctas: C, the grid size.
      slots: S >= 2, the ring's slots (`operand_ring`, `ring_barriers`; the RoPE positions ring too).
      load: `load(step, slot)` issues the TMA loads of a step with keys into ring slot `slot`.
      attend: `attend(step, slot, tables)` waits for them, computes, and issues the step's output
        stores from `slot` (`store_block`); `tables` is the block's `Rope.tables`, or None without `rope`.
      slack: `slack(step, slot)` issues zero stores for a step without keys from `slot`.
      rope: the kernel's fused RoPE, or None.
      warpgroups: W, the CTA's consumer warpgroups (`launch`); warpgroup `s % W` computes step s.
        S - 1 must be a multiple of W, so that the slot step s + 1 loads into was last computed
        by the warpgroup issuing the load (step s's).
      handoff: with W > 1, `ring_barriers(S, W)`: the issuer of a slack step's (absent) loads
        arrives on its barrier once the slot is free, as a TMA load's completion would.
    """
    if (slots - 1) % warpgroups or (warpgroups > 1) != (handoff is not None):
        raise ValueError(f"{slots} slots for {warpgroups} warpgroups (handoff {handoff is not None})")
    wg = warpgroup(warpgroups)
    cta = lax.axis_index("cta")
    n_blocks = live_ref[0]
    rounds = lax.div(jnp.maximum(n_blocks - cta + (num_ctas - 1), 0), jnp.int32(num_ctas))
    last = jnp.maximum(n_blocks - 1, 0)  # reads past the CTA's last round stay inside the table
    block_at = lambda r: Step.read(table_ref, jnp.minimum(r * num_ctas + cta, last))
    # Before a warpgroup issues step s + 1's loads into slot (s + 1) % S, the output stores of its
    # step s + 1 - S (its own, the slot's last) must have read the slot: a warpgroup commits one
    # store group per step it computes, so those of its (S - 1) / W - 1 later steps may stay pending.
    pending = (slots - 1) // warpgroups - 1

    def slot_of(s) -> Slot:
        index = lax.rem(s, slots)
        return Slot(index, index if warpgroups == 1 else index * warpgroups + lax.rem(s, warpgroups))

    def computes(s, cond):
        """`cond` and step s is this warpgroup's."""
        return cond if warpgroups == 1 else cond & (lax.rem(s, warpgroups) == wg)

    def issue(when, step, slot, positions):
        """Where `when`: the step's loads into `slot` (its positions too where `positions`), or,
        with W > 1, a slack step's handoff."""

        @pl.when(when & (step.keys > 0))
        def _():
            load(step, slot)
            if rope is not None and positions is not False:
                pl.when(positions)(lambda: rope.load(step, slot))

        if warpgroups > 1:
            pl.when(when & (step.keys == 0))(lambda: plgpu.barrier_arrive(handoff.at[slot.barrier]))

    first = block_at(0)
    issue(computes(jnp.int32(0), rounds > 0), first, Slot(jnp.int32(0), jnp.int32(0)), True)  # step 0: slot 0, warpgroup 0

    def block_body(r, carry):
        block, tables = carry
        nxt = block_at(r + 1)

        def step_body(h, tables):
            s = r * heads + h
            slot, next_slot = slot_of(s), slot_of(s + 1)

            @pl.when(computes(s, True))
            def _():
                plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
                # Step s + 1: head h + 1 of this block (with its positions where it is a warpgroup's
                # first step of the block, h + 1 < W), or head 0 of the next block.
                issue(h + 1 < heads, block.at_head(h + 1), next_slot, False if warpgroups == 1 else h + 1 < warpgroups)
                issue((h + 1 == heads) & (r + 1 < rounds), nxt, next_slot, True)

            if rope is not None:  # a warpgroup's first step of a block with keys: heads 0 .. W - 1
                first_step = h == 0 if warpgroups == 1 else h < warpgroups
                tables = lax.cond(computes(s, first_step & (block.keys > 0)), lambda: rope.tables(slot),
                                  lambda: tables)
            step = block.at_head(h)
            pl.when(computes(s, block.keys > 0))(lambda: attend(step, slot, tables))

            @pl.when(computes(s, block.keys == 0))
            def _():
                if warpgroups > 1:
                    plgpu.barrier_wait(handoff.at[slot.barrier])
                slack(step, slot)

            pl.when(computes(s, True))(plgpu.commit_smem_to_gmem_group)
            return tables

        return nxt, lax.fori_loop(0, heads, step_body, tables)

    lax.fori_loop(0, rounds, block_body, (first, None if rope is None else rope.empty()))
    plgpu.wait_smem_to_gmem(0)


def launch(kernel, scratch, out_type, num_ctas: int, *operands, warpgroups: int = 1):
    """Runs `kernel(*refs, *scratch_refs)` as a persistent kernel of `num_ctas` CTAs of `warpgroups`
    warpgroups (axis `WARPGROUP_AXIS`), all sharing the CTA's scratch."""
    threads = {} if warpgroups == 1 else {"num_threads": warpgroups, "thread_name": WARPGROUP_AXIS}
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        **threads,
    )
    return manual_axes.call_kernel(call, *operands)


def copy_block_in(src_ref, tail_ref, step: Step, end, dst, barrier) -> None:
    """TMA packed rows `[start, start + 64)` of the step's head into the plain `dst`.

    A block that runs past `end` (the first slack row) is read from the
    zero-padded tail copy (`jagged_flash_attention.schedule.tail_rows`), so no
    slack row and no row past the buffer is loaded.
    """
    start, head = step.start, step.head
    crosses = start + BLOCK > end

    @pl.when(crosses)
    def _():
        plgpu.copy_gmem_to_smem(tail_ref.at[pl.ds(start - jfa_schedule.tail_base(end), BLOCK), head], dst, barrier)

    @pl.when(jnp.logical_not(crosses))
    def _():
        plgpu.copy_gmem_to_smem(src_ref.at[pl.ds(start, BLOCK), head], dst, barrier)


def load_operands(operands, step: Step, slot: Slot, end) -> None:
    """Issues the TMA loads of a step into ring slot `slot`.

    `operands`: `(src_ref, tail_ref, ring, barriers)` per operand (`operand_ring`, `ring_barriers`).
    """
    for src, tail, ring, bars in operands:
        copy_block_in(src, tail, step, end, ring[0].at[slot.index], bars.at[slot.barrier])


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


# The TMA box sizes, in rows, a partial block's rows leave in (`store_block`), largest first.
PARTIAL_BOXES = (8, 1)


def store_block(value: jax.Array, plain, dst_ref, step: Step) -> None:
    """Stores rows `[0, rows)` of a `[64, D]` value to `dst_ref[start + i, head]` through `plain`.

    TMA boxes have static sizes: a full block leaves as one store of 64 rows,
    any other as stores of 8 rows and then of 1 (`PARTIAL_BOXES`: at most 7 +
    7). Each box size is a code path of its own, and fewer of them leave the
    D=128 backward fewer registers to spill: with one store per set bit of
    `rows` (seven sizes) it spilled 612 bytes of stores a thread, with these
    three 340 (`scripts/kernel_resources.py`; benchmarks/long_history.md, "The
    backward's stores and registers"). The stores join the round's bulk-copy
    group (`walk` commits it and waits for it before `plain` is reused).
    """
    start, rows, head = step.start, step.rows, step.head
    plain[...] = value
    plgpu.commit_smem()

    def copy(first, size):
        plgpu.copy_smem_to_gmem(plain.at[pl.ds(first, size)], dst_ref.at[pl.ds(start + first, size), head],
                                commit_group=False)

    full = rows == BLOCK
    pl.when(full)(lambda: copy(0, BLOCK))

    @pl.when(jnp.logical_not(full))
    def _():
        done = jnp.int32(0)
        for size in PARTIAL_BOXES:
            count = lax.div(rows - done, jnp.int32(size))

            def store(i, carry, size=size, done=done):
                copy(done + i * size, size)
                return carry

            lax.fori_loop(0, count, store, jnp.int32(0))
            done = done + count * size


def zeros(cols: int) -> jax.Array:
    """float32 `[64, cols]` zeros in the kernels' register layout (an accumulator's start)."""
    return plgpu.layout_cast(jnp.zeros((BLOCK, cols), jnp.float32), LAYOUT)
