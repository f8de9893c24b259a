"""GDPA Mosaic GPU kernels vs the jnp reference, in the Mosaic GPU interpreter on CPU.

Every test draws fresh random inputs, poisons slack rows (and the output
cotangent's slack rows) with NaN, and checks forward and gradients on the real
rows, zeros on the slack rows, and no NaN anywhere.
"""

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import ImplementationUnavailableError
from pallas_kernels._src import dispatch
from pallas_kernels.gdpa import activations, config, ops, reference, schedule
from pallas_kernels.gdpa import vjp as gdpa_vjp
from pallas_kernels.gdpa.reference import Activation

HEAD_DIM = 64


@pytest.fixture(autouse=True)
def gpu_interpreter():
    """Runs the kernels in the Mosaic GPU interpreter."""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield


def _offsets(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _rows(key, lengths, slack, heads):
    """bf16 `[sum + slack, H, D]` normal rows, slack rows NaN."""
    total = int(sum(lengths))
    x = jax.random.normal(key, (total + slack, heads, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
    return x.at[total:].set(jnp.nan)


def _batch(seed, q_lens, kv_lens, *, heads=2, q_slack=5, kv_slack=3, lq=None):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = _rows(kq, [lq] if lq else q_lens, 0 if lq else q_slack, heads)
    k = _rows(kk, kv_lens, kv_slack, heads)
    v = _rows(kv, kv_lens, kv_slack, heads)
    out_lens = [lq] * len(kv_lens) if lq else q_lens
    d_out = _rows(kd, out_lens, 0 if lq else q_slack, heads)
    return q, k, v, d_out


def _forward_and_grads(impl, q, k, v, d_out, q_offsets, kv_offsets, **kw):
    def f(q, k, v):
        return ops.gdpa(q, k, v, q_offsets, kv_offsets, implementation=impl, **kw)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(d_out))


# Error bound of a kernel output against the float32 reference on the same bf16 inputs.
# Every output element is a sum of products a_j b_j (P V, dS K, dS^T Q, P^T dO), and
# M = sum_j |a_j| |b_j| bounds what each bf16 rounding on the way can move it by:
# u * M per rounding, u = 2^-8 the bf16 unit roundoff. The kernels round at most four
# times: the P / dS operand of the second matmul, the per-warpgroup partial outputs
# (column split), the per-sequence partial dQ (broadcast_q) and the output.
BF16_U = 2.0**-8
ROUNDINGS = 4
# float32 slack: accumulation over n <= 320 terms (n 2^-24 < 2^-15), the activation in
# float32 on both sides and the u^2 terms of the four roundings, all far below 2^-12.
F32_SLACK = 2.0**-12
ERROR_PER_MAGNITUDE = ROUNDINGS * BF16_U + F32_SLACK
# Measured in these tests: at most 1.92 u M (a forward with rows split, which rounds twice,
# so its own worst case is 2 u M), 2.1x under the bound; a proven worst case, not a fit.


def _magnitudes(q, k, v, d_out, q_lens, kv_lens, *, activation="gelu", scale=None, causal=False, broadcast_q=False,
                output_scale=1.0, **_):
    """float64 M = sum_j |a_j| |b_j| per element of out, dq, dk, dv (shapes of the results; zero on slack rows),
    times |output_scale| (every result is linear in it)."""
    q, k, v, d_out = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, d_out))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    act = reference.activation_fn(activation)
    m_out, m_dq, m_dk, m_dv = np.zeros(d_out.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(k.shape)
    q_start = kv_start = 0
    for b, lk in enumerate(kv_lens):
        lq = q.shape[0] if broadcast_q else q_lens[b]
        rows_q = slice(0, lq) if broadcast_q else slice(q_start, q_start + lq)
        rows_out = slice(b * lq, (b + 1) * lq) if broadcast_q else rows_q
        rows_kv = slice(kv_start, kv_start + lk)
        keep = np.tril(np.ones((lq, lk))) if causal else np.ones((lq, lk))
        for h in range(q.shape[1]):
            qb, kb, vb, dob = q[rows_q, h], k[rows_kv, h], v[rows_kv, h], d_out[rows_out, h]
            p, act_vjp = jax.vjp(act, jnp.asarray(scale * qb @ kb.T, jnp.float32))
            (ds,) = act_vjp(jnp.asarray(dob @ vb.T, jnp.float32))
            p, ds = (np.abs(np.asarray(x, np.float64)) * keep for x in (p, ds))
            m_out[rows_out, h] = p @ np.abs(vb)
            m_dv[rows_kv, h] = p.T @ np.abs(dob)
            m_dq[rows_q, h] += scale * ds @ np.abs(kb)
            m_dk[rows_kv, h] = scale * ds.T @ np.abs(qb)
        q_start += 0 if broadcast_q else lq
        kv_start += lk
    return tuple(abs(output_scale) * m for m in (m_out, m_dq, m_dk, m_dv))


def _check(name, got, want, magnitude, real_rows):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    want = np.asarray(want.astype(jnp.float32), np.float64)
    assert not np.isnan(got).any(), f"{name}: NaN in kernel result"
    err = np.abs(got[:real_rows] - want[:real_rows])
    bound = ERROR_PER_MAGNITUDE * magnitude[:real_rows]
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{name}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    np.testing.assert_array_equal(got[real_rows:], 0.0, err_msg=f"{name}: slack rows not zero")


def _compare(q, k, v, d_out, q_lens, kv_lens, *, broadcast_q=False, **kw):
    q_offsets = None if broadcast_q else _offsets(q_lens)
    kv_offsets = _offsets(kv_lens)
    args = (q, k, v, d_out, q_offsets, kv_offsets)
    got = jax.jit(lambda *a: _forward_and_grads("pallas", *a, broadcast_q=broadcast_q, **kw))(*args)
    # The reference on float32 copies of the inputs: exact up to float32 rounding.
    exact = tuple(x.astype(jnp.float32) for x in (q, k, v, d_out))
    want = _forward_and_grads("xla", *exact, q_offsets, kv_offsets, broadcast_q=broadcast_q, **kw)
    magnitudes = _magnitudes(q, k, v, d_out, q_lens, kv_lens, broadcast_q=broadcast_q, **kw)
    out_rows = len(kv_lens) * q.shape[0] if broadcast_q else sum(q_lens)
    q_rows = q.shape[0] if broadcast_q else sum(q_lens)
    rows = (out_rows, q_rows, sum(kv_lens), sum(kv_lens))
    for name, g, w, m, n in zip(("out", "dq", "dk", "dv"), got, want, magnitudes, rows):
        _check(name, g, w, m, n)
    return got


# Lengths: empty query and empty key sequences, lengths off the tile sizes, a
# query sequence over one 128-row tile, Lq != Lkv throughout.
Q_LENS = [70, 0, 130, 5, 64, 9]
KV_LENS = [40, 17, 0, 64, 33, 1]


@pytest.mark.parametrize("activation", [a.value for a in Activation])
def test_forward_and_gradients_match_reference(activation):
    seed = 1 + [a.value for a in Activation].index(activation)
    q, k, v, d_out = _batch(seed, Q_LENS, KV_LENS)
    scale = 0.05 if activation == Activation.GELU_POLY6 else None  # keeps |x| in the polynomial's range
    _compare(q, k, v, d_out, Q_LENS, KV_LENS, max_seq_len_q=160, max_seq_len_kv=64, activation=activation, scale=scale)


def test_streamed_long_keys_and_resident_queries(monkeypatch):
    """Keys longer than the column ring (streamed per row tile) and a short-query dK/dV pass."""
    real_choose = config.choose
    monkeypatch.setattr(config, "choose", lambda **kw: real_choose(**{**kw, "block_cols": 64}))
    q_lens, kv_lens = [150, 3, 0, 47], [200, 0, 131, 64]
    q, k, v, d_out = _batch(11, q_lens, kv_lens, heads=1)
    _compare(q, k, v, d_out, q_lens, kv_lens, max_seq_len_q=160, max_seq_len_kv=320, activation="silu", scale=0.1)


def test_broadcast_queries_pooled_attention(monkeypatch):
    """Dense learned queries shared by every sequence (pooled attention); dQ sums over sequences.

    27 queries split the key steps between the two warpgroups; 64-key blocks
    make the keys stream.
    """
    real_choose = config.choose
    monkeypatch.setattr(config, "choose", lambda **kw: real_choose(**{**kw, "block_cols": 64}))
    kv_lens = [100, 0, 7, 64, 300]
    q, k, v, d_out = _batch(21, None, kv_lens, lq=27)  # not a multiple of 8: outputs padded per sequence inside
    _compare(q, k, v, d_out, None, kv_lens, broadcast_q=True, max_seq_len_q=27, max_seq_len_kv=320, activation="gelu")


def test_zero_length_sequences_give_zero_output_and_gradients():
    q_lens, kv_lens = [0, 30, 0, 12], [5, 0, 0, 0]  # every query sequence has no keys, or no queries
    q, k, v, d_out = _batch(31, q_lens, kv_lens, heads=1)
    out, dq, dk, dv = _compare(q, k, v, d_out, q_lens, kv_lens, max_seq_len_q=64, max_seq_len_kv=64)
    for x in (out, dq, dk, dv):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), 0.0)


def test_work_list_is_sorted_dealt_in_a_zigzag_and_complete():
    row_lens = jnp.array([300, 0, 5, 129, 7], jnp.int32)  # last entry: slack rows
    col_lens = jnp.array([10, 40, 0, 200, 0], jnp.int32)
    row_delta = jnp.array([0, 4, 4, 1, 2], jnp.int32)
    col_delta = jnp.array([0, 3, 0, 7, 0], jnp.int32)
    plan = schedule.build(
        row_lens,
        col_lens,
        row_delta,
        col_delta,
        jnp.zeros((5, 1), jnp.int32),
        out_rows=441,
        heads=2,
        rows_per_tile=128,
        tiles_per_item=2,
        block_cols=64,
        max_col_steps=5,
        num_ctas=3,
    )
    sched = np.asarray(plan.sched)
    items = [tuple(r) for r in sched.reshape(-1, 4) if r[3] > r[2]]
    # Tiles cover [delta, delta + L): sequence 0: 3 tiles in items of <= 2; 2: 1; 3: 2 (130 rows); slack: 1.
    expected = {(s, h, t0, t1) for h in (0, 1) for s, t0, t1 in [(0, 0, 2), (0, 2, 3), (2, 0, 1), (3, 0, 2), (4, 0, 1)]}
    assert sorted(items) == sorted(expected)
    col_steps = lambda s: -(-(int(col_lens[s]) + int(col_delta[s])) // 64) if col_lens[s] else 0
    work = lambda r: (r[3] - r[2]) * (col_steps(r[0]) + 1)
    # Round r of the deal is sorted item r*C + c; odd rounds run backwards over the CTAs.
    dealt = [sched[c if r % 2 == 0 else 2 - c, r] for r in range(sched.shape[1]) for c in range(3)]
    live = [work(r) for r in dealt if r[3] > r[2]]
    assert live == sorted(live, reverse=True)
    assert all(r[3] == r[2] for r in dealt[len(live) :])


def test_grouped_work_list_deals_each_sequence_together_heaviest_sequence_first():
    """`group_sequences`: one item per 128-row tile, causal; the deal runs sequence by sequence (their summed
    work descending, ties in sequence order), each sequence's items in row order with their heads side by side,
    and every item is there once."""
    lens = jnp.array([300, 640, 0, 300, 90, 3], jnp.int32)  # last entry: slack rows
    cols = lens.at[-1].set(0)
    plan = schedule.build(
        lens, cols, jnp.zeros(6, jnp.int32), jnp.zeros(6, jnp.int32), jnp.zeros((6, 1), jnp.int32),
        out_rows=1333, heads=2, rows_per_tile=128, tiles_per_item=1, block_cols=128, max_col_steps=5, num_ctas=4,
        causal=schedule.Causal.KEYS_UP_TO_ROW, group_sequences=True,
    )
    sched = np.asarray(plan.sched)
    dealt = [tuple(sched[c if r % 2 == 0 else 3 - c, r]) for r in range(sched.shape[1]) for c in range(4)]
    live = [d for d in dealt if d[3] > d[2]]
    tiles = {0: 3, 1: 5, 3: 3, 4: 1, 5: 1}  # sequence -> 128-row tiles; the slack (5) has rows and no columns
    assert sorted(live) == sorted((s, h, t, t + 1) for s, n in tiles.items() for h in (0, 1) for t in range(n))
    # Work of tile t: t + 1 column steps + 1 (capped at 5 steps); the slack's tiles have none: 1 each.
    work = {0: 2 + 3 + 4, 1: 2 + 3 + 4 + 5 + 6, 3: 2 + 3 + 4, 4: 2, 5: 1}
    order = sorted(tiles, key=lambda s: -work[s])  # stable: sequence 0 before 3
    assert [(s, h, t) for s, h, t, _ in live] == [(s, h, t) for s in order for t in range(tiles[s]) for h in (0, 1)]
    assert all(d[3] == d[2] for d in dealt[len(live):])


@pytest.mark.parametrize("causal", [schedule.Causal.KEYS_UP_TO_ROW, schedule.Causal.QUERIES_FROM_ROW])
def test_causal_work_list_counts_the_visited_column_steps(causal):
    """One 640-row self-attention sequence, items of one 128-row tile, 128-row column steps:
    tile t visits t + 1 steps (queries) or 5 - t (keys); items come heaviest first."""
    lens = jnp.array([640, 0], jnp.int32)
    plan = schedule.build(
        lens, jnp.array([640, 0], jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
        jnp.zeros((2, 1), jnp.int32), out_rows=640, heads=1, rows_per_tile=128, tiles_per_item=1,
        block_cols=128, max_col_steps=5, num_ctas=1, causal=causal,
    )
    tiles = [int(r[2]) for r in np.asarray(plan.sched)[0] if r[3] > r[2]]
    assert tiles == ([4, 3, 2, 1, 0] if causal == schedule.Causal.KEYS_UP_TO_ROW else [0, 1, 2, 3, 4])
    steps = [int(schedule.causal_col_steps(causal, jnp.int32(t), jnp.int32(5), 128, 128)) for t in range(5)]
    assert steps == ([1, 2, 3, 4, 5] if causal == schedule.Causal.KEYS_UP_TO_ROW else [5, 4, 3, 2, 1])


def test_tail_window_zeroes_rows_past_the_end():
    x = jnp.arange(40, dtype=jnp.float32)[:, None] + 1
    x = x.at[21:].set(jnp.nan)
    block = 8
    base = int(schedule.tail_base(jnp.int32(21), block))
    assert base % 8 == 0 and base <= 21 - block
    tail = np.asarray(schedule.tail_window(x, jnp.int32(21), block))[:, 0]
    rows = base + np.arange(2 * block + 8)
    np.testing.assert_array_equal(tail, np.where(rows < 21, rows + 1, 0))


@pytest.mark.parametrize("at, max_error", [(1.0, 1.2e-3), (1.5, 2.6e-2), (2.0, 0.23)])
def test_poly6_gelu_error_against_exact_gelu(at, max_error):
    x = jnp.linspace(-at, at, 4001, dtype=jnp.float32)
    err = jnp.abs(activations.value(Activation.GELU_POLY6, x) - jax.nn.gelu(x, approximate=False))
    assert float(err.max()) <= max_error
    assert float(err.max()) >= 0.5 * max_error  # the bound is tight: the error grows with |x|
    # The same polynomial in two float32 evaluation orders: a few ulp (2^-24 ~ 6e-8) apart.
    np.testing.assert_allclose(activations.value(Activation.GELU_POLY6, x), reference.activation_fn("gelu_poly6")(x), rtol=1e-6, atol=1e-6)


def test_qk_norm_bound_of_the_scores():
    d, scale = 128, 1.0 / 128
    q = jax.random.normal(jax.random.key(0), (256, d))
    k = jax.random.normal(jax.random.key(1), (256, d))
    rms = lambda x: x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))
    scores = scale * rms(q) @ rms(k).T
    bound = activations.qk_norm_score_bound(d, scale)
    assert bound == pytest.approx(1.0)
    assert float(jnp.abs(scores).max()) <= bound
    assert float(jnp.abs(scale * rms(q) @ rms(q).T).max()) == pytest.approx(bound, rel=1e-4)  # reached by q.q
    assert bound <= activations.POLY6_INPUT_BOUND
    assert activations.qk_norm_score_bound(d, 1.0 / math.sqrt(d)) > activations.POLY6_INPUT_BOUND


def test_activation_derivatives_match_autodiff():
    x = jnp.linspace(-4.0, 4.0, 801, dtype=jnp.float32)
    g = jax.random.normal(jax.random.key(3), x.shape)
    for activation in Activation:
        value, vjp = activations.value_and_vjp(activation, x, g)
        want_value, want_vjp = jax.vjp(reference.activation_fn(activation), x)
        # float32 formulas against autodiff of other float32 formulas (tanh, erf, exp near |x| <= 4):
        # tens of ulp (2^-24 ~ 6e-8) on values, more on derivatives, which subtract terms near x = 0.
        np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6, err_msg=activation)
        np.testing.assert_allclose(vjp, want_vjp(g)[0], rtol=1e-4, atol=1e-5, err_msg=activation)


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_no_keys_or_no_queries_give_zeros_without_a_kernel(broadcast_q):
    """Empty key buffers and zero maximum lengths: zero output and zero gradients, as the reference."""
    q_lens = None if broadcast_q else [3, 5]
    q, k, v, d_out = _batch(41, q_lens, [0, 0], heads=1, kv_slack=0, lq=8 if broadcast_q else None)
    q_offsets = None if broadcast_q else _offsets(q_lens)
    four = _rows(jax.random.key(42), [4], 0, 1)  # key rows exist, but every sequence is empty
    cases = [(k, v, 8, 4), (four, four, 8, 0), (four, four, 0, 4)]
    for kk, vv, max_q, max_kv in cases:
        f = lambda q, k, v: gdpa_vjp.gdpa(
            q, k, v, q_offsets, _offsets([0, 0]), max_seq_len_q=max_q, max_seq_len_kv=max_kv, broadcast_q=broadcast_q
        )
        out, vjp = jax.vjp(f, q, kk, vv)
        assert out.shape == ((2 * 8, 1, HEAD_DIM) if broadcast_q else q.shape)
        for x in (out, *vjp(d_out)):
            np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        gdpa_vjp.gdpa(q, k, v, q_offsets, _offsets([0, 0]), max_seq_len_q=8, max_seq_len_kv=-1, broadcast_q=broadcast_q)


def test_bad_inputs_raise_clear_errors():
    offsets = _offsets([4])
    x = jnp.zeros((4, 1, HEAD_DIM), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        gdpa_vjp.gdpa(x, x, x, offsets, offsets, max_seq_len_q=4, max_seq_len_kv=4)
    for d in (96, 192):
        y = jnp.zeros((4, 1, d), jnp.bfloat16)
        with pytest.raises(ValueError, match="head dim"):
            gdpa_vjp.gdpa(y, y, y, offsets, offsets, max_seq_len_q=4, max_seq_len_kv=4)
    with pytest.raises(ValueError, match="unknown activation"):
        ops.gdpa(x, x, x, offsets, offsets, max_seq_len_q=4, max_seq_len_kv=4, activation="tanh", implementation="pallas")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_malformed_offsets_and_bounds_raise_naming_the_problem(implementation):
    x = jnp.zeros((8, 1, HEAD_DIM), jnp.bfloat16)
    good = _offsets([3, 5])
    call = lambda qo, ko, max_q=8, max_kv=8: ops.gdpa(
        x, x, x, qo, ko, max_seq_len_q=max_q, max_seq_len_kv=max_kv, implementation=implementation
    )
    cases = [
        (dict(qo=jnp.array([1, 3, 8], jnp.int32), ko=good), r"q_offsets\[0\] must be 0, got 1"),
        (dict(qo=good, ko=jnp.array([0, 5, 3], jnp.int32)), r"kv_offsets not monotone: kv_offsets\[2\]=3"),
        (dict(qo=good, ko=jnp.array([0, 5, 9], jnp.int32)), r"kv_offsets\[B\]=9 > capacity 8"),
        (dict(qo=good, ko=good, max_kv=4), r"kv_offsets: sequence 1 has length 5 > max_seq_len 4"),
        (dict(qo=good.astype(jnp.float32), ko=good), "1-D integer array"),
        (dict(qo=good[None], ko=good[None]), "1-D integer array"),
        (dict(qo=good[:2], ko=good), r"got \(2,\) and \(3,\)"),
        (dict(qo=good, ko=good, max_q=-1), ">= 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**kwargs)


def test_default_implementation_takes_the_kernels_only_where_they_apply(monkeypatch):
    """None picks the kernels on Hopper for bf16/f16 and D in {64, 128}, else the reference."""
    bf16 = jnp.zeros((4, 1, HEAD_DIM), jnp.bfloat16)
    problem = lambda *dtypes, d=HEAD_DIM: ops.SUPPORT.kernel_problem(dtypes, d)
    assert problem(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16) is None
    assert "got float32, bfloat16, bfloat16" in problem(jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert "one dtype" in problem(jnp.bfloat16, jnp.float16, jnp.bfloat16)
    for d in (96, 256):  # 256 is a multiple of 64 but its tiles do not fit in shared memory
        assert f"head dim in (64, 128), got {d}" in problem(jnp.bfloat16, d=d)
    monkeypatch.setattr(dispatch, "is_hopper_gpu", lambda device=None: True)
    called = []
    monkeypatch.setattr(gdpa_vjp, "gdpa", lambda *a, **kw: called.append(a[0].dtype) or a[0])
    offsets = _offsets([4])
    for x in (bf16, bf16.astype(jnp.float32)):
        ops.gdpa(x, x, x, offsets, offsets, max_seq_len_q=4, max_seq_len_kv=4)
    assert called == [jnp.bfloat16]


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_every_tma_window_starts_on_an_8_row_boundary(broadcast_q):
    """Mosaic GPU's TMA moves whole 8-row tiles of swizzled SMEM (the interpreter does not model this)."""
    q_lens, kv_lens = [70, 0, 13, 5, 9], [33, 17, 0, 3, 21]
    lq = 27
    q, k, v, d_out = _batch(41, q_lens, kv_lens, heads=1, lq=lq if broadcast_q else None)
    static = gdpa_vjp.Static(160, 64, Activation.GELU, 0.125, broadcast_q)
    q_offsets = None if broadcast_q else _offsets(q_lens)
    if broadcast_q:
        d_out = gdpa_vjp._broadcast_rows(d_out, len(kv_lens), lq, pad=True)
    for name in ("fwd", "dq", "dkv"):
        args = gdpa_vjp.pass_arguments(name, q, k, v, d_out, q_offsets, _offsets(kv_lens), static)
        _, plan, _ = gdpa_vjp.build_plan(**{key: val for key, val in args.items()})
        seqs = np.asarray(plan.seqs)
        nr, nc = len(args["rows"]), len(args["cols"])
        ends = schedule.S_STARTS + nr + nc + 1
        aligned = np.concatenate([seqs[:, schedule.S_STARTS : ends], seqs[:, ends + nc :]], axis=1)
        assert (aligned % 8 == 0).all(), (name, aligned)
        deltas = seqs[:, [schedule.S_ROW_DELTA, schedule.S_COL_DELTA]]
        assert ((deltas >= 0) & (deltas < 8)).all()


def test_kernels_lower_for_hopper():
    """All three passes lower through Mosaic GPU (layouts, TMA shapes) for jagged odd-sized and broadcast batches."""
    heads, d = 4, 128
    cases = [
        ([70, 0, 130, 5, 301], [40, 17, 0, 64, 250], False, False),  # odd rows everywhere
        ([27], [100, 3, 0, 64], True, False),  # shared queries, Lq not a multiple of 8
        ([70, 0, 130, 5, 250], [70, 0, 130, 5, 250], False, True),  # causal self-attention
    ]
    for q_lens, kv_lens, broadcast_q, causal in cases:
        q_offsets = None if broadcast_q else _offsets(q_lens)
        kv_offsets = _offsets(kv_lens)
        tq = q_lens[0] if broadcast_q else sum(q_lens) + 3
        q = jax.ShapeDtypeStruct((tq, heads, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((sum(kv_lens) + 5, heads, d), jnp.bfloat16)

        def fwd_bwd(q, k, v):
            f = lambda q, k, v: gdpa_vjp.gdpa(
                q, k, v, q_offsets, kv_offsets, max_seq_len_q=320, max_seq_len_kv=256, broadcast_q=broadcast_q,
                causal=causal,
            )
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(out)

        with plgpu.force_gpu_interpret_mode(None):
            lowered = jax.jit(fwd_bwd).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("mosaic_gpu") >= 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Jagged:
    """A jagged container as gem_jax's `Jagged`: a pytree dataclass with a static bound."""

    values: jax.Array
    offsets: jax.Array
    max_seq_len: int = dataclasses.field(metadata=dict(static=True))


def test_jagged_containers_give_offsets_and_bounds():
    q_lens, kv_lens = [5, 0, 9], [3, 7, 0]
    q, k, v, _ = _batch(51, q_lens, kv_lens, heads=1)
    qo, kvo = _offsets(q_lens), _offsets(kv_lens)
    want = ops.gdpa(q, k, v, qo, kvo, max_seq_len_q=9, max_seq_len_kv=7, implementation="xla")
    got = ops.gdpa(_Jagged(q, qo, 9), _Jagged(k, kvo, 7), _Jagged(v, kvo, 7), implementation="xla")
    assert isinstance(got, _Jagged) and got.offsets is qo and got.max_seq_len == 9
    np.testing.assert_array_equal(np.asarray(got.values, np.float32), np.asarray(want, np.float32))
    # Keys as a container, values as an array; pooled attention over a container's keys.
    got = ops.gdpa(q, _Jagged(k, kvo, 7), v, qo, max_seq_len_q=9, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    pooled = ops.gdpa(q[:4], _Jagged(k, kvo, 7), _Jagged(v, kvo, 7), broadcast_q=True, implementation="xla")
    want = ops.gdpa(q[:4], k, v, None, kvo, max_seq_len_q=4, max_seq_len_kv=7, broadcast_q=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(pooled, np.float32), np.asarray(want, np.float32))


def test_jagged_container_errors_name_the_problem():
    x = jnp.zeros((8, 1, HEAD_DIM), jnp.bfloat16)
    offsets = _offsets([3, 5])
    # Pooled queries: the bound is q's row count, not a bound a caller may choose.
    for bad in (2, 9, np.int64(7)):
        with pytest.raises(ValueError, match=rf"broadcast_q, max_seq_len_q is q's row count Lq = 8 \(or None\), got {re.escape(repr(bad))}"):
            ops.gdpa(x, x, x, None, offsets, max_seq_len_q=bad, max_seq_len_kv=8, broadcast_q=True)
    for bad in (True, 8.0, np.float32(8), np.bool_(True), np.array([8])):
        with pytest.raises(ValueError, match=r"max_seq_len_q must be an int >= 0"):
            ops.gdpa(x, x, x, None, offsets, max_seq_len_q=bad, max_seq_len_kv=8, broadcast_q=True)
    with pytest.raises(ValueError, match="kv_offsets missing"):
        ops.gdpa(x, x, x, offsets, max_seq_len_q=8, max_seq_len_kv=8)
    with pytest.raises(ValueError, match="q_offsets missing"):
        ops.gdpa(x, _Jagged(x, offsets, 8), x, max_seq_len_q=8)
    with pytest.raises(ValueError, match="max_seq_len_q missing"):
        ops.gdpa(x, x, x, offsets, offsets, max_seq_len_kv=8)
    with pytest.raises(ValueError, match="max_seq_len_kv missing"):
        ops.gdpa(x, x, x, offsets, offsets, max_seq_len_q=8)
    with pytest.raises(ValueError, match=r"kv_offsets and k.offsets disagree: kv_offsets\[1\]=3 != k.offsets\[1\]=4"):
        ops.gdpa(x, _Jagged(x, _offsets([4, 4]), 8), x, offsets, offsets, max_seq_len_q=8)
    with pytest.raises(ValueError, match="not a jagged container"):
        ops.gdpa(_Jagged(x, offsets, 8), x, x, None, offsets, max_seq_len_kv=8, broadcast_q=True)


def test_implementation_errors_name_the_machine():
    x = jnp.zeros((8, 1, HEAD_DIM), jnp.bfloat16)
    offsets = _offsets([3, 5])
    call = lambda impl: ops.gdpa(x, x, x, offsets, offsets, max_seq_len_q=8, max_seq_len_kv=8, implementation=impl)
    with pytest.raises(ValueError, match="gdpa has no cuDNN implementation"):
        call("cudnn")
    with plgpu.force_gpu_interpret_mode(None):  # outside the simulator, the CPU is no Hopper GPU
        with pytest.raises(ImplementationUnavailableError, match="no Hopper GPU: found cpu"):
            call("pallas")
        f32 = x.astype(jnp.float32)  # inputs the kernels do not take: the machine is named first
        with pytest.raises(ImplementationUnavailableError, match="no Hopper GPU: found cpu"):
            ops.gdpa(f32, f32, f32, offsets, offsets, max_seq_len_q=8, max_seq_len_kv=8, implementation="pallas")


def test_causal_reference_matches_per_sequence_silu_loop():
    lengths = [0, 1, 6, 3]
    offsets = _offsets(lengths)
    q, k, v = (jax.random.normal(key, (12, 2, 8), jnp.float32) for key in jax.random.split(jax.random.key(0), 3))
    got = ops.gdpa(q, k, v, offsets, offsets, max_seq_len_q=6, max_seq_len_kv=6, activation="silu", causal=True,
                   scale=0.5, implementation=None)
    want = np.zeros((12, 2, 8))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    start = 0
    for n in lengths:
        for i in range(n):
            for h in range(2):
                x = np.array([qn[start + i, h] @ kn[start + j, h] for j in range(i + 1)]) * 0.5
                want[start + i, h] = (x / (1 + np.exp(-x))) @ vn[start : start + i + 1, h]
        start += n
    # float32 against float64 on outputs below 16 (ulp 2^-20 ~ 1e-6): measured 9e-7, the bound allows ~10 ulp.
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_only_the_causal_forward_deals_its_work_by_sequence():
    """One-tile items below `GROUPED_PAIRS_FROM` row tiles a CTA, two-tile items from it; every other pass keeps
    eight-tile items by their own work."""
    common = dict(max_rows=1024, max_cols=1024, head_dim=128, itemsize=2, n_row_inputs=1, n_col_inputs=2, num_ctas=132)
    other = config.choose(**common)
    assert (other.group_sequences, other.row_tiles_per_item) == (False, 8)
    pairs_from = config.GROUPED_PAIRS_FROM * 132 * 128  # rows times heads
    few = config.choose(**common, causal_forward_rows=pairs_from - 1)
    many = config.choose(**common, causal_forward_rows=pairs_from)
    assert (few.group_sequences, few.row_tiles_per_item) == (True, 1)
    assert (many.group_sequences, many.row_tiles_per_item) == (True, 2)
    assert dataclasses.replace(many, group_sequences=False, row_tiles_per_item=8) == other
    short = config.choose(**{**common, "max_rows": 64}, causal_forward_rows=pairs_from // 2)  # 64-row tiles
    assert short.rows_per_tile == 64 and short.row_tiles_per_item == 2


@pytest.mark.parametrize("streamed,short,grouped", [(False, False, False), (True, False, False), (False, True, False),
                                                    (True, False, True)])
def test_causal_kernels_match_reference(monkeypatch, streamed, short, grouped):
    """Causal SiLU self-attention (HSTU): resident and streamed keys (64-key blocks), so the
    work list skips column steps above the diagonal in both engine modes; sequences of at
    most 64 rows run with the warpgroups splitting the column steps. The default tiling deals
    the forward's work list sequence by sequence (`TileConfig.group_sequences`) and the
    backward's by item; the streamed cases set one tiling for every pass, eight row tiles an
    item by their own work or one row tile an item by sequence."""
    lens = ([200, 0, 7, 131] if grouped else [200, 7, 131]) if streamed else ([0, 1, 40, 64, 9] if short else [0, 1, 63, 64, 65, 130])
    chosen = []
    if streamed:
        real_choose = config.choose

        def choose(**kw):
            cfg = real_choose(**{**kw, "block_cols": 64})
            tiles = 1 if grouped else 8
            chosen.append(cfg := dataclasses.replace(cfg, group_sequences=grouped, row_tiles_per_item=tiles))
            return cfg

        monkeypatch.setattr(config, "choose", choose)
        jax.clear_caches()  # a cached lowering of the same shapes would skip `choose`
    q, k, v, d_out = _batch(21, lens, lens, heads=1, q_slack=5, kv_slack=5)
    _compare(q, k, v, d_out, lens, lens, max_seq_len_q=max(lens), max_seq_len_kv=max(lens), activation="silu",
             causal=True, scale=0.1)
    if streamed:  # the forward, dQ and dK/dV passes each chose their tiling here
        assert len(chosen) >= 3 and all(c.group_sequences == grouped for c in chosen)


def test_causal_forward_in_two_tile_items_dealt_by_sequence_matches_reference(monkeypatch):
    """The causal forward's two-tile items (what a CTA of 48 or more row tiles gets, as at gem_h200's capacity),
    forced here by `GROUPED_PAIRS_FROM` 0, against the reference on fresh random inputs: sequences of one to three
    row tiles (an item with one tile left over), an empty one and NaN-poisoned slack rows; the backward passes keep
    eight-tile items by their own work."""
    monkeypatch.setattr(config, "GROUPED_PAIRS_FROM", 0)
    real_choose, chosen = config.choose, []

    def choose(**kw):
        chosen.append(cfg := real_choose(**kw))
        return cfg

    monkeypatch.setattr(config, "choose", choose)
    jax.clear_caches()  # a cached lowering of the same shapes would skip `choose`
    lens = [130, 0, 1, 257, 64]
    q, k, v, d_out = _batch(int(np.random.default_rng().integers(1 << 30)), lens, lens, heads=1, q_slack=5, kv_slack=5)
    _compare(q, k, v, d_out, lens, lens, max_seq_len_q=max(lens), max_seq_len_kv=max(lens), activation="silu",
             causal=True, scale=0.1)
    forward = [c for c in chosen if c.group_sequences]
    assert forward and all(c.row_tiles_per_item == 2 for c in forward)
    assert any(not c.group_sequences and c.row_tiles_per_item == 8 for c in chosen)


@pytest.mark.parametrize("short", [False, True])
def test_output_scale_is_applied_inside_the_kernels(short):
    """HSTU's semantics, silu(alpha q.k) / N v: the 1/N as `output_scale`, forward and gradients against the
    reference on fresh random inputs (rows split, and columns split for sequences of at most 64 rows)."""
    lens = [0, 1, 40, 64, 9] if short else [0, 1, 63, 64, 65, 130]
    q, k, v, d_out = _batch(int(np.random.default_rng().integers(1 << 30)), lens, lens, heads=1)
    _compare(q, k, v, d_out, lens, lens, max_seq_len_q=max(lens), max_seq_len_kv=max(lens), activation="silu",
             causal=True, scale=HEAD_DIM**-0.5, output_scale=1.0 / max(lens))


def test_output_scale_with_broadcast_queries():
    """`output_scale` on pooled attention: the per-sequence partial dQ is scaled in the kernel and then
    summed over sequences, forward and gradients against the reference on fresh random inputs (a
    zero-length sequence, lengths off the tile sizes, NaN key slack)."""
    kv_lens = [0, 33, 70, 5]
    q, k, v, d_out = _batch(int(np.random.default_rng().integers(1 << 30)), None, kv_lens, heads=1, lq=11)
    _compare(q, k, v, d_out, None, kv_lens, broadcast_q=True, max_seq_len_q=11, max_seq_len_kv=70, activation="silu",
             output_scale=0.37)


def test_causal_errors_name_the_problem():
    q = jnp.zeros((8, 1, 64), jnp.bfloat16)
    off = _offsets([8])
    with pytest.raises(ValueError, match="q_offsets and kv_offsets disagree"):
        ops.gdpa(q, q, q, _offsets([3, 5]), _offsets([4, 4]), max_seq_len_q=8, max_seq_len_kv=8, causal=True, implementation="xla")
    with pytest.raises(ValueError, match="broadcast_q"):
        ops.gdpa(q, q, q, None, off, max_seq_len_kv=8, causal=True, broadcast_q=True, implementation="xla")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), jnp.float32(0.5), "0.5"])
def test_output_scale_must_be_a_finite_number(bad):
    q = jnp.zeros((8, 1, 64), jnp.bfloat16)
    off = _offsets([8])
    with pytest.raises(ValueError, match="output_scale must be a finite Python number"):
        ops.gdpa(q, q, q, off, off, max_seq_len_q=8, max_seq_len_kv=8, output_scale=bad, implementation="xla")


# Short causal self-attention batches of one shape (two sequences in 136 rows, NaN
# slack after them), so one compiled program serves every repetition.
REPEAT_LENS = ([64, 65], [1, 64], [0, 3])
REPEAT_ROWS = 136
REPEAT_SECONDS = 20.0


def test_causal_backward_repeated_runs_stay_correct():
    """The causal forward and backward many times over: every run finishes (the suite's per-test
    timeout turns a hang into a failure) and matches the reference.

    The simulated warpgroups of the interpreter run on CPU threads whose interleaving
    differs from run to run, so repetitions exercise different schedules of the
    barrier protocol. Runs cycle through `REPEAT_LENS` until `REPEAT_SECONDS` have
    passed, each case at least once.
    """
    kw = dict(max_seq_len_q=65, max_seq_len_kv=65, activation="silu", causal=True, scale=0.1)
    kernel = jax.jit(lambda *a: _forward_and_grads("pallas", *a, **kw))
    exact = jax.jit(lambda *a: _forward_and_grads("xla", *a, **kw))
    start, runs = time.monotonic(), 0
    while runs < len(REPEAT_LENS) or time.monotonic() - start < REPEAT_SECONDS:
        lens = REPEAT_LENS[runs % len(REPEAT_LENS)]
        slack = REPEAT_ROWS - sum(lens)
        q, k, v, d_out = _batch(100 + runs, lens, lens, q_slack=slack, kv_slack=slack)
        offsets = _offsets(lens)
        got = kernel(q, k, v, d_out, offsets, offsets)
        want = exact(*(x.astype(jnp.float32) for x in (q, k, v, d_out)), offsets, offsets)
        magnitudes = _magnitudes(q, k, v, d_out, lens, lens, **kw)
        for name, g, w, m in zip(("out", "dq", "dk", "dv"), got, want, magnitudes):
            _check(f"{name} (run {runs}, lengths {lens})", g, w, m, sum(lens))
        runs += 1
