"""The tile engine: one persistent, warp-specialized Mosaic GPU kernel shape for all GDPA passes.

Each CTA runs three warpgroups: two compute warpgroups that hold 64-row
accumulators in registers and one memory warpgroup that issues TMA copies.
A CTA walks its share of the work list (`schedule.Plan`); for each item
`(b, h, [t0, t1))` and each row tile t it runs

    for j in column steps of sequence b:       # step = a few wgmma + elementwise
        accs = step(row tile t, column tile j, accs)
    outputs[rows of tile t] = finalize(accs)

What is specific to a pass (forward, dQ, dK/dV) is `EngineSpec.step` and
`EngineSpec.finalize`; scheduling, pipelining, masking and stores live here.

Pipelining. Row tiles go through `row_slots` SMEM slots, so the next row tile
loads while the current one computes. Column tiles go through a ring of
`col_slots` slots. When a sequence's columns fit in the ring (short KV, the
`resident` case) they are loaded once per work item and stay in SMEM across its
row tiles; with room for two or more items' columns, the next item's columns
load while the current item computes. Otherwise they stream once per row tile.
Consumed barriers are armed once up front, so the memory warpgroup always waits
before it refills a slot.

Jagged edges. TMA copies into swizzled SMEM move whole 8-row tiles, so every
tile starts on an 8-row boundary: the tiles of a sequence start at the 8-aligned
row at or before its first row, and the sequence occupies `[delta, delta + L)`
of them (`schedule`). Column tiles therefore hold up to 7 rows of the previous
sequence at the front and the next sequence's rows at the back; those are
finite and masked out of the scores (`step` gets the column range). A window
that reaches past the end of the real data (slack, possibly NaN) is read from a
zero-padded copy of the rows around that end instead (`schedule.tail_window`).
Row tiles may read anything outside their sequence: those rows only reach
accumulator rows that are never stored. Stores write exactly the rows of the
sequence: a full 64-row warpgroup tile in one TMA store from swizzled SMEM, a
partial one through unswizzled SMEM as a ladder of 32, 16, ..., 1-row TMA
stores (TMA boxes have static sizes).

Source: GEM engineering description (Meta, 2025), GDPA; warp specialization,
ping-ponged compute warpgroups and TMA rings as in FlashAttention-3
(Shah et al., 2024) and jax's `attention_mgpu.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import manual_axes, mgpu_common
from pallas_kernels.gdpa import schedule
from pallas_kernels.gdpa.config import NUM_COMPUTE_WGS, REDUCTION_SCRATCH_BYTES, WG_ROWS, Split, TileConfig

COMPUTE_REGISTERS = 232  # per thread, compute warpgroups (setmaxnreg)
MEMORY_REGISTERS = 40  # per thread, the TMA warpgroup


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What `EngineSpec.step` sees for one (row tile, column tile) pair of one warpgroup.

    rows: SMEM refs `[64, D]` of the row operands (this warpgroup's rows).
    cols: SMEM refs `[block_cols, D]` of the column operands.
    accs: wgmma accumulator refs `[64, D]` float32.
    col_lo, col_hi: int32 scalars; the columns of the sequence are [col_lo, col_hi).
    lhs_staging: per register operand, an SMEM tile (interpreter only) or None.
    row_offset: int32 scalar, the sequence position of row 0 minus that of column 0.
    causal: None, or which (row, column) pairs a causal pass keeps (`Causal`).
    """

    rows: Sequence
    cols: Sequence
    accs: Sequence
    col_lo: jax.Array
    col_hi: jax.Array
    lhs_staging: Sequence
    row_offset: jax.Array | None = None
    causal: str | None = None

    def scores(self, pairs: Sequence[tuple]) -> list[jax.Array]:
        """`[a @ b.T for a, b in pairs]` as float32 `[64, block_cols]`, issued together."""

        def body(*acc_refs):
            for acc, (a, b) in zip(acc_refs, pairs):
                plgpu.wgmma(acc, a, b.transpose((1, 0)))
            return [acc[...] for acc in acc_refs]

        shape = (WG_ROWS, self.cols[0].shape[0])
        return pl.run_scoped(body, *[plgpu.ACC(shape, jnp.float32) for _ in pairs])

    def valid(self) -> jax.Array:
        """bool `[64, block_cols]`: the column is inside the sequence (and on the causal side of the row)."""
        shape = (WG_ROWS, self.cols[0].shape[0])
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        valid = (col >= self.col_lo) & (col < self.col_hi)
        if self.causal is None:
            return valid
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + self.row_offset
        return valid & ((col <= row) if self.causal == Causal.KEYS_UP_TO_ROW else (col >= row))

    def lhs(self, index: int, value: jax.Array):
        """A register tile as the left operand of a wgmma.

        On the GPU the value is used from registers. The Mosaic GPU interpreter
        only multiplies SMEM operands, so there it goes through SMEM.
        """
        staging = self.lhs_staging[index]
        if staging is None:
            return value
        staging[...] = value
        plgpu.commit_smem()
        return staging


Causal = schedule.Causal


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A GDPA pass as an engine instance.

    Attributes:
      name: kernel name (shows in profiles).
      n_rows, n_cols, n_accs: operand and accumulator counts; outputs = accumulators.
      n_lhs: register tiles per step that feed a wgmma as left operand.
      step: `step(ctx: StepContext)` issues this step's wgmmas into `ctx.accs`.
      finalize: float32 accumulator values -> output values (same count).
    """

    name: str
    n_rows: int
    n_cols: int
    n_accs: int
    n_lhs: int
    step: Callable[[StepContext], None]
    finalize: Callable[[Sequence[jax.Array]], Sequence[jax.Array]]


def run(
    spec: EngineSpec,
    cfg: TileConfig,
    plan: schedule.Plan,
    rows: Sequence[jax.Array],
    cols: Sequence[jax.Array],
    tails: Sequence[jax.Array],
    *,
    out_rows: int,
    causal: str | None = None,
) -> list[jax.Array]:
    """Runs the engine.

    Args:
      spec: the pass.
      cfg: tiling; `cfg.num_ctas` CTAs.
      plan: work list; `plan.seqs` holds per sequence the lengths and alignment
        deltas, the 8-aligned start rows of the row operands, the column operands
        and the outputs, then per column operand the end of its real data and the
        first row of its tail window (see `schedule`).
      rows, cols: `[T, H, D]` operands (bf16 or f16), each at least one tile long,
        T a multiple of 8.
      tails: per column operand, `schedule.tail_window(col, end, block_cols)`.
      out_rows: rows of each output.
      causal: None, or a `Causal` pass: rows and columns must then share their
        starts (self-attention), and each row tile visits only the column steps
        on its causal side.

    Returns:
      `n_accs` outputs `[out_rows, H, D]` in the operands' dtype; with
      `Split.COLS`, `[2, out_rows, H, D]` partial sums (one per warpgroup).
    """
    dtype = rows[0].dtype
    _, heads, head_dim = rows[0].shape
    R, C, RS, CS = WG_ROWS, cfg.block_cols, cfg.row_slots, cfg.col_slots
    NCM = cfg.max_col_tiles
    split_rows = cfg.split is Split.ROWS
    row_copies = NUM_COMPUTE_WGS if split_rows else 1
    RT = cfg.rows_per_tile
    resident, groups = cfg.resident, cfg.resident_groups
    n_items = plan.sched.shape[1]
    nr, nc = spec.n_rows, spec.n_cols
    col_start_at = schedule.S_STARTS + nr
    out_start_at = col_start_at + nc
    col_end_at = out_start_at + 1
    tail_base_at = col_end_at + nc
    interpret = mgpu_common.interpreting()

    def owns(parity_index, w):
        """Whether compute warpgroup `w` consumes a column tile (rows split: both do).

        Columns split: warpgroup w takes the streamed slots of parity w, or the
        resident tiles j of parity w (tile j of a sequence lives in slot
        `group * max_col_tiles + j`), so each slot always has the same consumer.
        """
        if split_rows:
            return True
        return lax.rem(parity_index, 2) == w

    def slot_parity_index(s: int) -> int:
        return s % NCM if resident else s

    def body(sched_ref, seqs_ref, *refs):
        row_refs = refs[:nr]
        col_refs = refs[nr : nr + nc]
        tail_refs = refs[nr + nc : nr + 2 * nc]
        out_refs = refs[nr + 2 * nc : nr + 2 * nc + spec.n_accs]
        row_smem, col_smem, stage, lhs_smem, barriers = refs[nr + 2 * nc + spec.n_accs :]
        row_loaded, row_consumed, col_loaded, col_consumed = barriers
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")

        def item(it):
            field = lambda f: _read_scalar(sched_ref, cta, it, f)
            b = field(schedule.F_SEQ)
            return b, field(schedule.F_HEAD), field(schedule.F_T0), field(schedule.F_T1)

        def seq_field(b, f):
            return _read_scalar(seqs_ref, b, f)

        def n_col_steps(b):
            col_len = seq_field(b, schedule.S_COL_LEN)
            steps = lax.div(col_len + seq_field(b, schedule.S_COL_DELTA) + (C - 1), jnp.int32(C))
            return jnp.where(col_len > 0, steps, 0)

        def col_range(t, n_col):
            """Column steps `[lo, hi)` that row tile t visits (all of them unless causal)."""
            if causal is None:
                return jnp.int32(0), n_col
            visited = schedule.causal_col_steps(causal, t, n_col, RT, C)
            if causal == Causal.KEYS_UP_TO_ROW:
                return jnp.int32(0), visited
            return n_col - visited, n_col

        @pl.when(wg == NUM_COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def load_cols(b, h, j, slot):
                for c in range(nc):
                    start = seq_field(b, col_start_at + c) + j * C
                    crosses = start + C > seq_field(b, col_end_at + c)
                    tail_start = start - seq_field(b, tail_base_at + c)
                    dst = col_smem[c].at[slot]
                    bar = col_loaded.at[slot]

                    @pl.when(crosses)
                    def _(c=c, tail_start=tail_start, dst=dst, bar=bar):
                        plgpu.copy_gmem_to_smem(tail_refs[c].at[pl.ds(tail_start, C), h], dst, bar)

                    @pl.when(jnp.logical_not(crosses))
                    def _(c=c, start=start, dst=dst, bar=bar):
                        plgpu.copy_gmem_to_smem(col_refs[c].at[pl.ds(start, C), h], dst, bar)

            def load_rows(b, h, t, slot):
                for r in range(nr):
                    base = seq_field(b, schedule.S_STARTS + r) + t * RT
                    for half in range(row_copies):
                        plgpu.copy_gmem_to_smem(
                            row_refs[r].at[pl.ds(base + half * R, R), h],
                            row_smem[r].at[slot, half],
                            row_loaded.at[slot],
                        )

            def next_row(b, h, t, row_cnt):
                slot = lax.rem(row_cnt, jnp.int32(RS))
                plgpu.barrier_wait(row_consumed.at[slot])
                load_rows(b, h, t, slot)
                return row_cnt + 1

            def item_body(it, carry):
                row_cnt, col_cnt, k = carry
                b, h, t0, t1 = item(it)
                n_col = n_col_steps(b)
                active = t1 > t0
                if resident:
                    # First row tile, then the item's columns (which may wait for the
                    # previous item to release them), then the other row tiles.
                    @pl.when(active)
                    def _():
                        next_row(b, h, t0, row_cnt)

                    row_cnt = row_cnt + active.astype(jnp.int32)
                    base = lax.rem(k, jnp.int32(groups)) * NCM
                    for j in range(NCM):

                        @pl.when(active & (j < n_col))
                        def _(j=j):
                            plgpu.barrier_wait(col_consumed.at[base + j])
                            load_cols(b, h, j, base + j)

                    row_cnt = lax.fori_loop(t0 + 1, jnp.maximum(t0 + 1, t1), lambda t, n: next_row(b, h, t, n), row_cnt)
                    return row_cnt, col_cnt, k + active.astype(jnp.int32)

                def row_body(t, carry):
                    row_cnt, col_cnt = carry
                    row_cnt = next_row(b, h, t, row_cnt)

                    def col_body(j, col_cnt):
                        slot = lax.rem(col_cnt, jnp.int32(CS))
                        plgpu.barrier_wait(col_consumed.at[slot])
                        load_cols(b, h, j, slot)
                        return col_cnt + 1

                    j_lo, j_hi = col_range(t, n_col)
                    return row_cnt, lax.fori_loop(j_lo, jnp.maximum(j_lo, j_hi), col_body, col_cnt)

                row_cnt, col_cnt = lax.fori_loop(t0, t1, row_body, (row_cnt, col_cnt))
                return row_cnt, col_cnt, k

            zero = jnp.int32(0)
            lax.fori_loop(0, n_items, item_body, (zero, zero, zero))
            # Take the final releases (each slot has one release nobody waited for).
            for s in range(RS):
                plgpu.barrier_wait(row_consumed.at[s])
            for s in range(CS):
                plgpu.barrier_wait(col_consumed.at[s])

        @pl.when(wg < NUM_COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            w = wg
            lhs_tiles = [None] * spec.n_lhs if lhs_smem is None else [lhs_smem.at[w, i] for i in range(spec.n_lhs)]

            # Arm the consumed barriers: every slot starts free.
            for s in range(RS):
                plgpu.barrier_arrive(row_consumed.at[s])
            for s in range(CS):
                _when(owns(slot_parity_index(s), w), lambda s=s: plgpu.barrier_arrive(col_consumed.at[s]))

            def out_ref(o):
                return out_refs[o] if split_rows else out_refs[o].at[w]

            def store(values, row, first, last, h):
                for o, value in enumerate(values):
                    value = value.astype(dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    mgpu_common.store_rows(value, stage, w, out_ref(o), row, h, first, last)

            def item_body(it, carry):
                row_cnt, col_cnt, k = carry
                b, h, t0, t1 = item(it)
                # Sequence rows sit at [row_delta, row_delta + row_len) of the tile
                # grid that starts at the 8-aligned row before the sequence start;
                # columns likewise.
                row_len = seq_field(b, schedule.S_ROW_LEN)
                row_delta = seq_field(b, schedule.S_ROW_DELTA)
                col_lo = seq_field(b, schedule.S_COL_DELTA)
                col_hi = col_lo + seq_field(b, schedule.S_COL_LEN)
                n_col = n_col_steps(b)
                active = t1 > t0
                base = lax.rem(k, jnp.int32(groups)) * NCM if resident else None
                if resident:
                    for j in range(NCM):

                        @pl.when(active & (j < n_col) & owns(j, w))
                        def _(j=j):
                            plgpu.barrier_wait(col_loaded.at[base + j])

                def row_body(t, carry):
                    row_cnt, col_cnt = carry
                    slot = lax.rem(row_cnt, jnp.int32(RS))
                    plgpu.barrier_wait(row_loaded.at[slot])
                    row_base = t * RT + (w * R if split_rows else 0)
                    first = jnp.minimum(jnp.maximum(row_delta - row_base, 0), R)
                    last = jnp.minimum(jnp.maximum(row_delta + row_len - row_base, 0), R)
                    rows_here = [row_smem[r].at[slot, w if split_rows else 0] for r in range(nr)]

                    def scope(*acc_refs):
                        def col_body(j, col_cnt):
                            cslot = base + j if resident else lax.rem(col_cnt, jnp.int32(CS))

                            def consume():
                                if not resident:
                                    plgpu.barrier_wait(col_loaded.at[cslot])

                                @pl.when(last > first)
                                def _():
                                    spec.step(
                                        StepContext(
                                            rows=rows_here,
                                            cols=[col_smem[c].at[cslot] for c in range(nc)],
                                            accs=acc_refs,
                                            col_lo=col_lo - j * C,
                                            col_hi=col_hi - j * C,
                                            lhs_staging=lhs_tiles,
                                            row_offset=row_base - j * C,
                                            causal=causal,
                                        )
                                    )

                                if not resident:
                                    plgpu.wgmma_wait(0)
                                    plgpu.barrier_arrive(col_consumed.at[cslot])

                            _when(owns(j if resident else cslot, w), consume)
                            return col_cnt + 1

                        j_lo, j_hi = col_range(t, n_col)
                        col_cnt_out = lax.fori_loop(j_lo, jnp.maximum(j_lo, j_hi), col_body, col_cnt)
                        return tuple(acc[...] for acc in acc_refs), col_cnt_out

                    accs, col_cnt = pl.run_scoped(
                        scope, *[plgpu.ACC((R, head_dim), jnp.float32) for _ in range(spec.n_accs)]
                    )
                    plgpu.barrier_arrive(row_consumed.at[slot])
                    out_row = seq_field(b, out_start_at) + row_base
                    store(spec.finalize(accs), out_row, first, last, h)
                    return row_cnt + 1, col_cnt

                row_cnt, col_cnt = lax.fori_loop(t0, t1, row_body, (row_cnt, col_cnt))
                if resident:
                    for j in range(NCM):

                        @pl.when(active & (j < n_col) & owns(j, w))
                        def _(j=j):
                            plgpu.barrier_arrive(col_consumed.at[base + j])

                    k = k + active.astype(jnp.int32)
                return row_cnt, col_cnt, k

            zero = jnp.int32(0)
            lax.fori_loop(0, n_items, item_body, (zero, zero, zero))
            plgpu.wait_smem_to_gmem(0)

    out_shape = (out_rows, heads, head_dim) if split_rows else (NUM_COMPUTE_WGS, out_rows, heads, head_dim)
    row_smem = tuple(mgpu_common.swizzled_smem((RS, row_copies, R, head_dim), dtype) for _ in range(nr))
    col_smem = tuple(mgpu_common.swizzled_smem((CS, C, head_dim), dtype) for _ in range(nc))
    stage = mgpu_common.staging_smem(NUM_COMPUTE_WGS, head_dim, dtype)
    lhs_smem = mgpu_common.swizzled_smem((NUM_COMPUTE_WGS, spec.n_lhs, R, C), dtype) if interpret else None
    barriers = (
        plgpu.Barrier(num_arrivals=nr * row_copies, num_barriers=RS),
        plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=RS),
        plgpu.Barrier(num_arrivals=nc, num_barriers=CS),
        plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS if split_rows else 1, num_barriers=CS),
    )
    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct(out_shape, dtype) for _ in range(spec.n_accs)],
        scratch_types=[row_smem, col_smem, stage, lhs_smem, barriers],
        grid=(cfg.num_ctas,),
        grid_names=("cta",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES,
        ),
        kernel_name=spec.name,
    )
    return list(manual_axes.call_kernel(kernel, plan.sched, plan.seqs, *rows, *cols, *tails))


def scaled(x: jax.Array, factor: float) -> jax.Array:
    """`x * factor` for a finalize, or `x` itself when the factor is 1 (the kernel then has no multiply)."""
    return x if factor == 1.0 else x * factor


def _read_scalar(ref, *index) -> jax.Array:
    """`ref[index]` as a scalar of the kernel's own arithmetic type.

    Under `shard_map` a read from an operand ref is typed as varying over the
    mesh axes, but the kernel is traced with those checks off, so arithmetic
    results are not. A loop whose bounds come straight from a read would carry
    both types and fail to trace; one arithmetic step gives every scalar the same.
    """
    return ref[index] + jnp.int32(0)


def _when(cond, f) -> None:
    """`pl.when(cond)(f)`, or just `f()` when `cond` is the constant True."""
    if cond is True:
        f()
    else:
        pl.when(cond)(f)
