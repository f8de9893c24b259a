"""The persistent, warp-specialised walk that the JFA forward, dQ and dK/dV kernels share.

All three kernels are persistent: `C` CTAs each walk their share of the sorted
work list (`schedule`) with three warpgroups, two computing on 64 rows each and
one issuing TMA copies. `run_pass` is that walk, the same for every pass; what a
pass does with its operands is a `Pass` (its steps, loads, per-step math and
outputs: the shape of GDPA's `engine.EngineSpec`), `block_stream` the ring
stream of the forward and dQ passes, and `launch` starts the kernel. Sources:
FlashAttention-3 (Shah et al., 2024) for the warp specialisation and the TMA
ring; GEM engineering description (Meta, 2025), jagged flash attention.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import manual_axes, mgpu_common
from pallas_kernels.jagged_flash_attention import schedule
from pallas_kernels.jagged_flash_attention._mgpu import Item, copy_rows_in, loop, zigzag_item, zigzag_rounds
from pallas_kernels.jagged_flash_attention.config import (
    COMPUTE_REGISTERS,
    MEMORY_REGISTERS,
    NUM_COMPUTE_WGS,
    NUM_STAGES,
    ROW_ALIGN,
    TILE_ROWS,
    WG_ROWS,
)


@dataclasses.dataclass(frozen=True)
class Share:
    """A compute warpgroup's share of one work item: what `Pass.compute` and `Pass.finish` see.

    item: the item. wg: the warpgroup (0 or 1). gstep: the global ring step of
    the item's first step. first_block, n: the first block of the other side the
    item visits and its ring steps (`Pass.steps`). pos0: the window position of
    the warpgroup's first row. lo, hi: the warpgroup's rows of the item, `[lo, hi)`
    within 0..64 (int32 scalars).
    """

    item: Item
    wg: jax.Array
    gstep: jax.Array
    first_block: jax.Array
    n: jax.Array
    pos0: jax.Array
    lo: jax.Array
    hi: jax.Array

    def run_steps(self, step, carry, head_masked, tail_masked):
        """`carry` through `step(i, carry, masked)` for the item's steps `[0, n)`.

        The first `head_masked` and the last `tail_masked` steps run with the
        in-register mask (`masked=True`), the steps between without it.
        """
        plain_lo, plain_hi = _step_segments(self.n, head_masked, tail_masked)
        carry = loop(0, plain_lo, functools.partial(step, masked=True), carry)
        carry = loop(plain_lo, plain_hi, functools.partial(step, masked=False), carry)
        return loop(plain_hi, self.n, functools.partial(step, masked=True), carry)

    def store(self, value: jax.Array, staging, dst_ref) -> None:
        """Stores the warpgroup's rows `[lo, hi)` of a `[64, D]` value to its item's rows of `dst_ref`."""
        row = self.item.row0 + self.wg * WG_ROWS
        mgpu_common.store_rows(value, staging, self.wg, dst_ref, row, self.item.head, self.lo, self.hi)


Barriers = Any  # a `plgpu.Barrier` scratch ref: one barrier, or an array of them indexed with `.at[i]`


@dataclasses.dataclass(frozen=True)
class Pass:
    """One JFA kernel pass as an instance of the shared persistent walk (`run_pass`).

    The memory warpgroup, per item: waits for `item_free` (the previous item's own
    rows are no longer read), runs `load_rows`, signals `item_go`, runs `stream`.
    Each compute warpgroup, per item: waits for `item_go` (so it never waits on a
    row barrier before its load is issued), then, if it has rows, waits for its
    entry of each `item_ready` barrier (when the item has steps), runs `compute`,
    releases `item_free` and runs `finish`.

    Attributes:
      steps: `steps(item) -> (first_block, n)`: the first block of the other side
        and the ring steps the item visits (int32 scalars).
      load_rows: memory warpgroup, `load_rows(item, w, end_row)`: TMA the item's
        own rows for compute warpgroup w (run when w has rows and n > 0).
      stream: memory warpgroup, `stream(item, gstep, n, end_row)`: issue the
        item's n ring steps from global ring step gstep.
      item_ready: barrier arrays `[NUM_COMPUTE_WGS]` that `load_rows` signals.
      ring_ready, ring_free: the ring's barrier arrays `[NUM_STAGES]`, signalled
        by the memory warpgroup (a slot loaded) and by the compute warpgroups (a
        slot read); a warpgroup without rows in an item passes its steps through
        both, so the barrier phases stay in lockstep.
      item_free: one barrier, `NUM_COMPUTE_WGS` arrivals per item.
      item_go: one barrier, signalled once per item.
      compute: `compute(share) -> carry`: the warpgroup's ring steps of an item
        (`Share.run_steps`); reads the item's own rows.
      finish: `finish(share, carry)`: the warpgroup's outputs. It runs after
        `item_free` is released, so it must not read the item's own rows' SMEM.
    """

    steps: Callable[[Item], tuple[jax.Array, jax.Array]]
    load_rows: Callable[[Item, int, jax.Array], None]
    stream: Callable[[Item, jax.Array, jax.Array, jax.Array], None]
    item_ready: Sequence[Barriers]
    ring_ready: Sequence[Barriers]
    ring_free: Sequence[Barriers]
    item_free: Barriers
    item_go: Barriers
    compute: Callable[[Share], Any]
    finish: Callable[[Share, Any], None]


def block_stream(steps, block: int, operands, freed) -> Callable:
    """A `Pass.stream` that issues an item's ring steps as `block`-row blocks of each operand.

    The item's blocks start at its window row `item.base` plus `steps(item)[0]`
    blocks. Step i is global step `g = gstep + i` and uses ring slot
    `g % NUM_STAGES`. For each operand `(src_ref, tail_ref, smem, loaded)` in turn
    it waits for the compute warpgroups to release the slot (`freed[k]`, from the
    ring's second lap on), then loads rows `[base + i * block, + block)` of one
    head (`copy_rows_in`) and signals `loaded[slot]`.
    """

    def stream(item: Item, gstep, n, end_row) -> None:
        base = pl.multiple_of(item.base + steps(item)[0] * block, ROW_ALIGN)

        def step(i, carry):
            g = gstep + i
            slot = lax.rem(g, NUM_STAGES)
            row = base + i * block
            for (src_ref, tail_ref, smem, loaded), free in zip(operands, freed):

                @pl.when(g >= NUM_STAGES)
                def _(free=free):
                    plgpu.barrier_wait(free.at[slot])

                copy_rows_in(src_ref, tail_ref, row, block, item.head, end_row, smem.at[slot], loaded.at[slot])
            return carry

        lax.fori_loop(0, n, step, None)

    return stream


def run_pass(spec: Pass, table_ref, meta_ref, heads: int, num_ctas: int) -> None:
    """The kernel body of a pass: the memory warpgroup's and the compute warpgroups' walks.

    Each CTA takes its items of the sorted list in a zigzag (`zigzag_item`); the
    order of waits and signals is `Pass`'s.
    """
    cta, wg, rounds, end_row = _walk_start(meta_ref, heads, num_ctas)

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory_wg():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        steps = _issue_items(spec, table_ref, heads, num_ctas, cta, rounds, end_row)
        _drain_rings(steps, *spec.ring_free)

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute_wg():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

        def item_body(r, gstep):
            item = Item.read(table_ref, zigzag_item(r, num_ctas, cta), heads)
            first_block, n = spec.steps(item)
            lo_w, hi_w = item.wg_rows(wg)
            plgpu.barrier_wait(spec.item_go)
            share = Share(item, wg, gstep, first_block, n, item.tile * TILE_ROWS + wg * WG_ROWS, lo_w, hi_w)

            @pl.when(hi_w > lo_w)
            def _work():
                @pl.when(n > 0)
                def _():
                    for barrier in spec.item_ready:
                        plgpu.barrier_wait(barrier.at[wg])

                carry = spec.compute(share)
                plgpu.barrier_arrive(spec.item_free)
                spec.finish(share, carry)

            @pl.when(hi_w <= lo_w)
            def _idle():
                _skip_steps(gstep, n, spec.ring_ready, spec.ring_free)
                plgpu.barrier_arrive(spec.item_free)

            return gstep + n

        lax.fori_loop(0, rounds, item_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)


def launch(kernel, scratch: Sequence, out_type, num_ctas: int, *operands):
    """Runs `kernel(*refs, scratch_refs)` as a persistent kernel of `num_ctas` CTAs of three warpgroups.

    `refs` are the operands' and outputs' GMEM refs, `scratch_refs` those of
    `scratch` (SMEM buffers and barriers, shared by the warpgroups of a CTA).
    Returns the outputs of `out_type`.
    """

    def entry(*refs):
        pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, collective_axes="wg")

    call = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    return manual_axes.call_kernel(call, *operands)


def _walk_start(meta_ref, heads: int, num_ctas: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`(cta, wg, rounds, end_row)`: this thread's CTA and warpgroup, its CTA's item count, the first slack row."""
    cta = lax.axis_index("cta")
    n_items = meta_ref[schedule.META_LIVE_TILES] * heads
    return cta, lax.axis_index("wg"), zigzag_rounds(n_items, num_ctas, cta), meta_ref[schedule.META_END]


def _step_segments(n, head_masked, tail_masked) -> tuple[jax.Array, jax.Array]:
    """Splits steps `[0, n)` into masked `[0, a)`, plain `[a, b)`, masked `[b, n)`."""
    a = jnp.minimum(head_masked, n)
    b = jnp.maximum(a, n - tail_masked)
    return a, b


def _skip_steps(gstep, n, ready, free) -> None:
    """Steps `[0, n)` of a warpgroup with no rows in its item: keeps the ring in step.

    Waits on each slot's `ready` barriers and releases it through `free`, so the
    barrier phases of both compute warpgroups stay in lockstep.
    """

    def body(i, carry):
        slot = lax.rem(gstep + i, NUM_STAGES)
        for r in ready:
            plgpu.barrier_wait(r.at[slot])
        for f in free:
            plgpu.barrier_arrive(f.at[slot])
        return carry

    lax.fori_loop(0, n, body, None)


def _issue_items(spec: Pass, table_ref, heads: int, num_ctas: int, cta, rounds, end_row):
    """The memory warpgroup's walk over its CTA's work items; returns the ring steps issued.

    For round r's item: wait until the compute warpgroups release the previous
    item's own rows (`spec.item_free`); `spec.load_rows` for each warpgroup that
    has rows, when the item has steps; signal `spec.item_go`; then `spec.stream`
    issues the item's n ring steps from global step `gstep`. At the end the last
    `item_free` release is taken.
    """

    def item_body(r, gstep):
        item = Item.read(table_ref, zigzag_item(r, num_ctas, cta), heads)
        n = spec.steps(item)[1]

        @pl.when(r >= 1)
        def _():
            plgpu.barrier_wait(spec.item_free)

        for w in range(NUM_COMPUTE_WGS):
            lo_w, hi_w = item.wg_rows(w)

            @pl.when((hi_w > lo_w) & (n > 0))
            def _(w=w):
                spec.load_rows(item, w, end_row)

        plgpu.barrier_arrive(spec.item_go)  # the item's loads are issued
        spec.stream(item, gstep, n, end_row)
        return gstep + n

    total = lax.fori_loop(0, rounds, item_body, jnp.int32(0))
    _drain(spec.item_free, rounds - 1, rounds, 1)
    return total


def _drain_rings(steps, *freed) -> None:
    """Takes the releases of the last `NUM_STAGES` of `steps` ring steps, for each ring in `freed`."""
    for free in freed:
        _drain(free, steps - NUM_STAGES, steps, NUM_STAGES)


def _drain(barriers, first, count, num_slots: int) -> None:
    """Waits for the completions of uses `[first, count)` of a ring of `num_slots` barriers.

    The producer waits for a slot's release only before reusing it; at the end
    it consumes the releases it never waited for, so every barrier phase is
    observed before the shared memory goes away.
    """

    def body(g, carry):
        plgpu.barrier_wait(barriers if num_slots == 1 else barriers.at[lax.rem(g, num_slots)])
        return carry

    loop(jnp.maximum(first, 0), count, body, None)
