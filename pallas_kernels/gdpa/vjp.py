"""GDPA on Hopper: the Mosaic GPU forward and backward passes behind one `jax.custom_vjp`.

`gdpa` here has the semantics of `pallas_kernels.gdpa.reference.gdpa` (see
`pallas_kernels.gdpa.ops.gdpa` for the full contract). Each pass is an
instance of the tile engine (`engine.py`) over a work list built on the device
(`schedule.py`); the residuals are just the inputs (no softmax statistics).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels._src import manual_axes, mgpu_common
from pallas_kernels.gdpa import backward, config, engine, forward, schedule
from pallas_kernels.gdpa.reference import Activation

# dK/dV hold two [64, D] float32 accumulators per warpgroup; 64-column steps keep
# the two [64, 64] score tiles beside them within the 232 registers per thread.
DKV_BLOCK_COLS = 64
INTERPRET_NUM_CTAS = 3  # persistent CTAs under the CPU simulator (exercises the zigzag)


@dataclasses.dataclass(frozen=True)
class Static:
    """The static arguments of one GDPA call."""

    max_seq_len_q: int
    max_seq_len_kv: int
    activation: Activation
    scale: float
    broadcast_q: bool
    causal: bool = False
    output_scale: float = 1.0


def gdpa(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offsets: jax.Array | None,
    kv_offsets: jax.Array,
    *,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    activation: str | Activation = Activation.GELU,
    scale: float | None = None,
    output_scale: float = 1.0,
    broadcast_q: bool = False,
    causal: bool = False,
) -> jax.Array:
    """`act((Q_b K_b^T) * scale) V_b * output_scale` per sequence with the Mosaic GPU kernels (differentiable).

    Same arguments and result as `pallas_kernels.gdpa.ops.gdpa`. Sequence lengths
    must not exceed `max_seq_len_q` / `max_seq_len_kv` (keys past the maximum are
    ignored). Rows of neighbouring sequences may be read by boundary tiles and
    are masked out, so they must be finite; slack rows past `offsets[-1]` may
    hold anything. Without any key or output rows (or a zero maximum length) the
    result is zeros and no kernel runs.

    With `causal`, q_offsets and kv_offsets must be equal (self-attention): the
    passes skip the tiles above the diagonal and mask the diagonal ones.

    Raises:
      ValueError: dtype other than bfloat16/float16, head dim other than 64 or 128,
        a negative maximum length, or causal with broadcast_q.
    """
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"pallas GDPA needs bfloat16 or float16 q, k, v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    _, heads, head_dim = q.shape
    if head_dim not in config.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"pallas GDPA takes head dim {config.SUPPORTED_HEAD_DIMS}; got {head_dim}")
    if max_seq_len_q < 0 or max_seq_len_kv < 0:
        raise ValueError(f"max_seq_len_q and max_seq_len_kv must be >= 0; got {max_seq_len_q}, {max_seq_len_kv}")
    if causal and broadcast_q:
        raise ValueError("causal GDPA needs jagged queries (self-attention), not broadcast_q")
    kv_offsets = kv_offsets.astype(jnp.int32)
    q_offsets = jnp.zeros((1,), jnp.int32) if broadcast_q else q_offsets.astype(jnp.int32)
    q, k, v, q_offsets, kv_offsets = manual_axes.match_axes(q, k, v, q_offsets, kv_offsets)
    out_rows = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    no_queries = out_rows == 0 or (max_seq_len_q == 0 and not broadcast_q)
    if no_queries or k.shape[0] == 0 or max_seq_len_kv == 0:
        zeros = jnp.zeros((out_rows, heads, head_dim), q.dtype)
        return manual_axes.to_varying(zeros, manual_axes.varying_axes(q))
    static = Static(
        max_seq_len_q=int(q.shape[0]) if broadcast_q else int(max_seq_len_q),
        max_seq_len_kv=int(max_seq_len_kv),
        activation=Activation(activation),
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        broadcast_q=bool(broadcast_q),
        causal=bool(causal),
        output_scale=float(output_scale),
    )
    return _gdpa(q, k, v, q_offsets, kv_offsets, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gdpa(q, k, v, q_offsets, kv_offsets, static: Static):
    return _forward(q, k, v, q_offsets, kv_offsets, static)


def _gdpa_fwd(q, k, v, q_offsets, kv_offsets, static: Static):
    return _forward(q, k, v, q_offsets, kv_offsets, static), (q, k, v, q_offsets, kv_offsets)


def _gdpa_bwd(static: Static, residuals, d_out):
    q, k, v, q_offsets, kv_offsets = residuals
    d_out = d_out.astype(q.dtype)
    if static.broadcast_q:
        d_out = _broadcast_rows(d_out, kv_offsets.shape[0] - 1, q.shape[0], pad=True)
    dq = _backward_dq(q, k, v, d_out, q_offsets, kv_offsets, static)
    dk, dv = _backward_dkv(q, k, v, d_out, q_offsets, kv_offsets, static)
    return dq, dk, dv, None, None


_gdpa.defvjp(_gdpa_fwd, _gdpa_bwd)


@dataclasses.dataclass(frozen=True)
class _Sequences:
    """Per-sequence rows of the query and output sides, and of the key side (int32 [B])."""

    q_start: jax.Array  # first row of the sequence in q (0 for broadcast queries)
    q_len: jax.Array
    q_end: jax.Array  # first slack row of q
    out_start: jax.Array  # first row of the sequence in the output (and in its cotangent)
    out_end: jax.Array  # first slack row of the output
    out_rows: int  # static rows of the output
    kv_start: jax.Array
    kv_len: jax.Array
    kv_end: jax.Array

    @classmethod
    def of(cls, q, q_offsets, kv_offsets, static: Static) -> _Sequences:
        batch = kv_offsets.shape[0] - 1
        kv_start = kv_offsets[:-1]
        kv_len = jnp.maximum(kv_offsets[1:] - kv_start, 0)
        if static.broadcast_q:
            # Sequence b's outputs (and output cotangents) sit at rows b * Lq8, Lq8
            # = Lq rounded up to 8, so they share the queries' alignment (row 0).
            lq = q.shape[0]
            lq8 = _round_up(lq, config.ALIGN)
            out_start = jnp.arange(batch, dtype=jnp.int32) * lq8
            return cls(
                q_start=jnp.zeros((batch,), jnp.int32),
                q_len=jnp.full((batch,), lq, jnp.int32),
                q_end=jnp.int32(lq),
                out_start=out_start,
                out_end=jnp.int32(batch * lq8),
                out_rows=batch * lq8,
                kv_start=kv_start,
                kv_len=kv_len,
                kv_end=kv_offsets[-1],
            )
        q_start = q_offsets[:-1]
        return cls(
            q_start=q_start,
            q_len=jnp.maximum(q_offsets[1:] - q_start, 0),
            q_end=q_offsets[-1],
            out_start=q_start,
            out_end=q_offsets[-1],
            out_rows=q.shape[0],
            kv_start=kv_start,
            kv_len=kv_len,
            kv_end=kv_offsets[-1],
        )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _broadcast_rows(x: jax.Array, batch: int, lq: int, *, pad: bool) -> jax.Array:
    """`[B * Lq, ...]` <-> `[B * Lq8, ...]` (sequence b at rows b * Lq8); a copy only when Lq % 8."""
    lq8 = _round_up(lq, config.ALIGN)
    if lq8 == lq:
        return x
    if pad:
        x = x.reshape((batch, lq) + x.shape[1:])
        x = jnp.pad(x, [(0, 0), (0, lq8 - lq)] + [(0, 0)] * (x.ndim - 2))
    else:
        x = x.reshape((batch, lq8) + x.shape[1:])[:, :lq]
    return x.reshape((-1,) + x.shape[2:])


def _num_ctas() -> int:
    if mgpu_common.interpreting():
        return INTERPRET_NUM_CTAS
    return mgpu_common.sm_count()


def _append(per_seq: jax.Array, slack) -> jax.Array:
    return jnp.concatenate([per_seq.astype(jnp.int32), jnp.asarray(slack, jnp.int32).reshape(1)])


def _tma_rows(rows: int, minimum: int) -> int:
    """Rows of a TMA-addressed buffer: at least one tile, and a multiple of 8.

    Mosaic GPU tiles the whole GMEM row dimension by the 8-row SMEM tiling, so
    its size must be a multiple of 8.
    """
    return max(minimum, -(-rows // config.ALIGN) * config.ALIGN)


def _padded_rows(x: jax.Array, minimum: int) -> jax.Array:
    """`x` with zero rows appended up to `_tma_rows` (a copy only when rows are added)."""
    rows = _tma_rows(x.shape[0], minimum)
    if x.shape[0] == rows:
        return x
    return jnp.concatenate([x, jnp.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)])


def _run(
    spec: engine.EngineSpec,
    *,
    rows: list[jax.Array],
    row_starts: list[jax.Array],
    row_len: jax.Array,
    row_end: jax.Array,
    cols: list[jax.Array],
    col_starts: list[jax.Array],
    col_ends: list[jax.Array],
    col_len: jax.Array,
    out_start: jax.Array,
    out_rows: int,
    max_rows: int,
    max_cols: int,
    block_cols: int | None = None,
    causal: str | None = None,
    causal_forward: bool = False,
) -> list[jax.Array]:
    """Builds the work list and runs one engine pass; returns outputs `[out_rows, H, D]`.

    `row_end` is the first output row past the real data; rows `[row_end, out_rows)`
    form the slack pseudo-sequence, which gets zeros. `causal_forward` marks the causal
    forward pass, whose work list is dealt sequence by sequence (`config.choose`).
    """
    cfg, plan, padded_out_rows = build_plan(
        causal=causal,
        causal_forward=causal_forward,
        rows=rows,
        row_starts=row_starts,
        row_len=row_len,
        row_end=row_end,
        cols=cols,
        col_starts=col_starts,
        col_ends=col_ends,
        col_len=col_len,
        out_start=out_start,
        out_rows=out_rows,
        max_rows=max_rows,
        max_cols=max_cols,
        block_cols=block_cols,
    )
    block = cfg.block_cols
    outs = engine.run(
        spec,
        cfg,
        plan,
        [_padded_rows(x, cfg.rows_per_tile) for x in rows],
        [_padded_rows(x, block) for x in cols],
        [schedule.tail_window(x, e, block) for x, e in zip(cols, col_ends)],
        out_rows=padded_out_rows,
        causal=causal,
    )
    if cfg.split is config.Split.COLS:
        outs = [(o[0].astype(jnp.float32) + o[1].astype(jnp.float32)).astype(o.dtype) for o in outs]
    return [o if o.shape[0] == out_rows else o[:out_rows] for o in outs]


def build_plan(
    *,
    rows,
    row_starts,
    row_len,
    row_end,
    cols,
    col_starts,
    col_ends,
    col_len,
    out_start,
    out_rows,
    max_rows,
    max_cols,
    block_cols=None,
    causal=None,
    causal_forward=False,
) -> tuple[config.TileConfig, schedule.Plan, int]:
    """Tile config, work list and padded output rows of one pass (arguments as `_run`)."""
    _, heads, head_dim = rows[0].shape
    cfg = config.choose(
        causal_forward_rows=out_rows * heads if causal_forward else 0,
        max_rows=max_rows,
        max_cols=max_cols,
        head_dim=head_dim,
        itemsize=rows[0].dtype.itemsize,
        n_row_inputs=len(rows),
        n_col_inputs=len(cols),
        num_ctas=_num_ctas(),
        block_cols=block_cols,
    )
    block = cfg.block_cols
    padded_out_rows = _tma_rows(out_rows, cfg.rows_per_tile)
    # Every operand on one side shares its start mod 8 (`schedule`): tiles start at
    # `start - delta`, 8-aligned.
    align = schedule.ALIGN
    row_delta = _append(row_starts[0], row_end) % align
    col_delta = _append(col_starts[0], 0) % align
    columns = [_append(s, row_end) - row_delta for s in row_starts]
    columns += [_append(s, 0) - col_delta for s in col_starts]
    columns.append(_append(out_start, row_end) - row_delta)
    n_seq = out_start.shape[0] + 1
    columns += [jnp.full((n_seq,), e, jnp.int32) for e in col_ends]
    columns += [jnp.full((n_seq,), schedule.tail_base(e, block), jnp.int32) for e in col_ends]
    plan = schedule.build(
        _append(row_len, out_rows - row_end),
        _append(jnp.minimum(col_len, max_cols), 0),
        row_delta,
        col_delta,
        jnp.stack(columns, axis=1),
        out_rows=padded_out_rows,
        heads=heads,
        rows_per_tile=cfg.rows_per_tile,
        tiles_per_item=cfg.row_tiles_per_item,
        block_cols=block,
        max_col_steps=cfg.max_col_tiles,
        num_ctas=cfg.num_ctas,
        causal=causal,
        group_sequences=cfg.group_sequences,
    )
    return cfg, plan, padded_out_rows


def pass_arguments(name: str, q, k, v, d_out, q_offsets, kv_offsets, static: Static) -> dict:
    """Operands and per-sequence geometry of pass `name` ("fwd", "dq" or "dkv"), as `_run` takes them."""
    seqs = _Sequences.of(q, q_offsets, kv_offsets, static)
    query_side = dict(
        row_len=seqs.q_len,
        row_end=seqs.out_end,
        cols=[k, v],
        col_starts=[seqs.kv_start, seqs.kv_start],
        col_ends=[seqs.kv_end, seqs.kv_end],
        col_len=seqs.kv_len,
        out_start=seqs.out_start,
        out_rows=seqs.out_rows,
        max_rows=static.max_seq_len_q,
        max_cols=static.max_seq_len_kv,
    )
    if name == "fwd":
        return dict(query_side, rows=[q], row_starts=[seqs.q_start])
    if name == "dq":
        return dict(query_side, rows=[q, d_out], row_starts=[seqs.q_start, seqs.out_start])
    if name == "dkv":
        return dict(
            rows=[k, v],
            row_starts=[seqs.kv_start, seqs.kv_start],
            row_len=seqs.kv_len,
            row_end=seqs.kv_end,
            cols=[q, d_out],
            col_starts=[seqs.q_start, seqs.out_start],
            col_ends=[seqs.q_end, seqs.out_end],
            col_len=seqs.q_len,
            out_start=seqs.kv_start,
            out_rows=k.shape[0],
            max_rows=static.max_seq_len_kv,
            max_cols=static.max_seq_len_q,
            block_cols=DKV_BLOCK_COLS,
        )
    raise ValueError(f"unknown pass {name!r}")


def causal_pass(name: str, static: Static) -> str | None:
    """The engine's `Causal` mode of pass `name` (rows are queries for "fwd" and "dq", keys for "dkv")."""
    if not static.causal:
        return None
    return engine.Causal.QUERIES_FROM_ROW if name == "dkv" else engine.Causal.KEYS_UP_TO_ROW


def _forward(q, k, v, q_offsets, kv_offsets, static: Static):
    spec = forward.spec(static.activation, static.scale, q.dtype, static.output_scale)
    args = pass_arguments("fwd", q, k, v, None, q_offsets, kv_offsets, static)
    (out,) = _run(spec, causal=causal_pass("fwd", static), causal_forward=static.causal, **args)
    if static.broadcast_q:
        out = _broadcast_rows(out, kv_offsets.shape[0] - 1, q.shape[0], pad=False)
    return out


def _backward_dq(q, k, v, d_out, q_offsets, kv_offsets, static: Static):
    spec = backward.dq_spec(static.activation, static.scale, q.dtype, static.output_scale)
    args = pass_arguments("dq", q, k, v, d_out, q_offsets, kv_offsets, static)
    (dq,) = _run(spec, causal=causal_pass("dq", static), **args)
    if static.broadcast_q:
        # One partial dQ per sequence (rows b * Lq8 ...): the shared queries get their sum.
        batch = kv_offsets.shape[0] - 1
        lq8 = _round_up(q.shape[0], config.ALIGN)
        dq = dq.reshape((batch, lq8) + q.shape[1:])[:, : q.shape[0]]
        dq = dq.astype(jnp.float32).sum(axis=0).astype(q.dtype)
    return dq


def _backward_dkv(q, k, v, d_out, q_offsets, kv_offsets, static: Static):
    spec = backward.dkv_spec(static.activation, static.scale, q.dtype, static.output_scale)
    args = pass_arguments("dkv", q, k, v, d_out, q_offsets, kv_offsets, static)
    dk, dv = _run(spec, causal=causal_pass("dkv", static), **args)
    return dk, dv
