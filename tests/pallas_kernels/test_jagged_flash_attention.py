"""Jagged flash attention: the jnp reference against a per-sequence loop, the work
list, and the Mosaic GPU kernels (CPU interpret mode) against the reference,
forward and dQ/dK/dV."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from tolerances import BFLOAT16, FLOAT16, FLOAT32, attention_budget, check

from pallas_kernels import ImplementationUnavailableError
from pallas_kernels.jagged_flash_attention import _mgpu, cudnn, ops, reference, schedule
from pallas_kernels.jagged_flash_attention.config import TILE_ROWS

# Budget on max |kernel - reference| / max |reference|, per tensor, by input dtype (tests/support/tolerances.py;
# measured: benchmarks/tolerances.md).
BUDGET = {jnp.dtype(d): attention_budget(f) for d, f in ((jnp.bfloat16, BFLOAT16), (jnp.float16, FLOAT16), (jnp.float32, FLOAT32))}


def _offsets(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _inputs(lengths, capacity, heads, dim, dtype, seed, poison=True):
    """q, k, v, dout `[capacity, H, D]`; rows past the real data hold NaN when `poison`."""
    keys = jax.random.split(jax.random.key(seed), 4)
    end = int(sum(lengths))
    xs = []
    for key in keys:
        x = jax.random.normal(key, (capacity, heads, dim), jnp.float32).astype(dtype)
        xs.append(x.at[end:].set(jnp.nan) if poison else x)
    return xs


def _naive(q, k, v, lengths, causal, scale):
    """float64 softmax attention, one sequence and one head at a time."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    out = np.zeros_like(q)
    start = 0
    for n in lengths:
        s = slice(start, start + n)
        for h in range(q.shape[1]):
            x = q[s, h] @ k[s, h].T * scale
            if causal:
                x = np.where(np.tril(np.ones((n, n), bool)), x, -np.inf)
            p = np.exp(x - x.max(axis=-1, keepdims=True)) if n else x
            out[s, h] = (p / p.sum(axis=-1, keepdims=True)) @ v[s, h] if n else 0.0
        start += n
    return out


def _value_and_grads(impl, q, k, v, dout, offsets, *, max_seq_len, causal, window=None):
    fn = functools.partial(
        ops.jagged_flash_attention, offsets=offsets, max_seq_len=max_seq_len, causal=causal, implementation=impl,
        window=window,
    )
    out, vjp = jax.vjp(fn, q, k, v)
    return [np.asarray(x.astype(jnp.float32)) for x in (out, *vjp(dout))]


def _assert_close(actual, expected, dtype, name):
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    if not actual.size:
        return
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    err = float(np.max(np.abs(actual - expected)))
    check(name, err / scale, BUDGET[jnp.dtype(dtype)])


# --- the "xla" path: the reference itself --------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_per_sequence_loop(causal):
    lengths = [0, 1, 7, 16, 0, 23]
    capacity, heads, dim = 56, 2, 8
    q, k, v, _ = _inputs(lengths, capacity, heads, dim, jnp.float32, seed=np.random.randint(1 << 30))
    out = ops.jagged_flash_attention(q, k, v, _offsets(lengths), max_seq_len=23, causal=causal, implementation="xla")
    expected = _naive(q, k, v, lengths, causal, dim**-0.5)
    end = sum(lengths)
    # float32 against float64: sums of <= 23 keys and 8 features, gamma_23 = 1.4e-6 of the largest term, and exp.
    np.testing.assert_allclose(np.asarray(out)[:end], expected[:end], atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[end:] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_gradients_match_per_sequence_loop(causal):
    lengths = [5, 0, 12]
    capacity, heads, dim = 20, 1, 4
    q, k, v, dout = _inputs(lengths, capacity, heads, dim, jnp.float32, seed=np.random.randint(1 << 30), poison=False)
    offsets, end = _offsets(lengths), sum(lengths)
    grads = jax.grad(
        lambda *x: jnp.sum(ops.jagged_flash_attention(*x, offsets, max_seq_len=12, causal=causal, implementation="xla") * dout),
        argnums=(0, 1, 2),
    )(q, k, v)

    def naive_loss(x):
        return float(np.sum(_naive(*np.split(x, 3), lengths, causal, dim**-0.5) * np.asarray(dout, np.float64)))

    x0 = np.concatenate([np.asarray(t, np.float64) for t in (q, k, v)])
    rng = np.random.default_rng(0)
    for _ in range(6):  # directional derivatives by central differences
        d = rng.normal(size=x0.shape)
        d[np.tile(np.arange(capacity) >= end, 3)] = 0.0
        numeric = (naive_loss(x0 + 1e-3 * d) - naive_loss(x0 - 1e-3 * d)) / 2e-3
        analytic = sum(float(np.sum(np.asarray(g, np.float64) * dd)) for g, dd in zip(grads, np.split(d, 3)))
        assert analytic == pytest.approx(numeric, rel=2e-3, abs=2e-3)
    for g in grads:
        assert np.all(np.asarray(g)[end:] == 0)


def test_reference_ignores_nan_slack_rows():
    lengths = [3, 9]
    q, k, v, _ = _inputs(lengths, 16, 2, 8, jnp.float32, seed=3)
    clean = [x.at[12:].set(0.0) for x in (q, k, v)]
    a = ops.jagged_flash_attention(q, k, v, _offsets(lengths), max_seq_len=9, implementation="xla")
    b = ops.jagged_flash_attention(*clean, _offsets(lengths), max_seq_len=9, implementation="xla")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_input_errors_name_the_problem():
    q = jnp.zeros((8, 2, 64), jnp.float32)
    offsets = _offsets([8])
    with pytest.raises(ValueError, match="q, k, v"):
        ops.jagged_flash_attention(q, q[:4], q, offsets, max_seq_len=8)
    with pytest.raises(ValueError, match="offsets"):
        ops.jagged_flash_attention(q, q, q, offsets[None], max_seq_len=8)
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0, got 2"):
        ops.jagged_flash_attention(q, q, q, jnp.array([2, 8], jnp.int32), max_seq_len=8)
    with pytest.raises(ValueError, match="sequence 0 has length 8 > max_seq_len 4"):
        ops.jagged_flash_attention(q, q, q, offsets, max_seq_len=4)
    with pytest.raises(ValueError, match="implementation"):
        ops.jagged_flash_attention(q, q, q, offsets, max_seq_len=8, implementation="triton")
    for x, y in ((q.astype(jnp.int32), q.astype(jnp.int32)), (q, q.astype(jnp.bfloat16))):  # int garbage, silent promotion
        with pytest.raises(ValueError, match=r"q, k, v must share one floating dtype .*; got (int32, int32|float32, bfloat16), "):
            ops.jagged_flash_attention(x, y, x, offsets, max_seq_len=8)
    for bound in (7.5, -1, True):
        with pytest.raises(ValueError, match=rf"max_seq_len must be an int >= 0 .*, got {bound!r}"):
            ops.jagged_flash_attention(q, q, q, offsets, max_seq_len=bound)
    # max_seq_len 0: every row is slack (zeros, whatever they hold), as gdpa and block-local attention give; the
    # reference, the semantic spec, gives the same by itself
    poisoned = jnp.full((5, 2, 64), jnp.nan, jnp.float32)
    for attend in (ops.jagged_flash_attention, reference.jagged_flash_attention):
        np.testing.assert_array_equal(np.asarray(attend(poisoned, poisoned, poisoned, _offsets([0, 0, 0]), max_seq_len=0)), 0.0)
        np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: attend(x, x, x, _offsets([0, 0, 0]), max_seq_len=0).sum())(poisoned)), 0.0)
    q96 = jnp.zeros((8, 2, 96), jnp.bfloat16)
    # On the CPU "pallas" says that there is no Hopper GPU, whatever the inputs.
    for x in (q, q96, q.astype(jnp.bfloat16)):
        with pytest.raises(ImplementationUnavailableError, match="no Hopper GPU: found cpu"):
            ops.jagged_flash_attention(x, x, x, offsets, max_seq_len=8, implementation="pallas")
    with pytest.raises(ImplementationUnavailableError, match="cuDNN needs an NVIDIA GPU: found cpu"):
        ops.jagged_flash_attention(q96, q96, q96, offsets, max_seq_len=8, implementation="cudnn")
    # Where the kernels can run (Mosaic GPU interpret mode stands in for a Hopper GPU),
    # inputs they do not take are named.
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        with pytest.raises(NotImplementedError, match="bf16 or f16"):
            ops.jagged_flash_attention(q, q, q, offsets, max_seq_len=8, implementation="pallas")
        with pytest.raises(NotImplementedError, match="head dim"):
            ops.jagged_flash_attention(q96, q96, q96, offsets, max_seq_len=8, implementation="pallas")


def test_default_implementation_on_cpu_is_the_reference():
    lengths = [4, 6]
    q, k, v, _ = _inputs(lengths, 10, 2, 64, jnp.bfloat16, seed=5, poison=False)
    a = ops.jagged_flash_attention(q, k, v, _offsets(lengths), max_seq_len=6)
    b = ops.jagged_flash_attention(q, k, v, _offsets(lengths), max_seq_len=6, implementation="xla")
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Jagged:
    """A jagged container as gem_jax's `Jagged`: a pytree dataclass with a static bound."""

    values: jax.Array
    offsets: jax.Array
    max_seq_len: int = dataclasses.field(metadata=dict(static=True))


class _ReplaceJagged:
    """A jagged container that is no dataclass but has `replace(values=...)`."""

    def __init__(self, values, offsets):
        self.values, self.offsets = values, offsets

    def replace(self, values):
        return _ReplaceJagged(values, self.offsets)


def test_jagged_containers_give_offsets_and_bound_and_get_the_result():
    lengths = [3, 0, 9]
    q, k, v, _ = _inputs(lengths, 16, 2, 8, jnp.float32, seed=np.random.randint(1 << 30))
    offsets = _offsets(lengths)
    want = np.asarray(ops.jagged_flash_attention(q, k, v, offsets, max_seq_len=9, causal=True, implementation="xla"))
    jq, jk, jv = (_Jagged(x, offsets, 9) for x in (q, k, v))
    got = ops.jagged_flash_attention(jq, jk, jv, causal=True, implementation="xla")
    assert isinstance(got, _Jagged) and got.offsets is offsets and got.max_seq_len == 9
    np.testing.assert_array_equal(np.asarray(got.values), want)
    # q alone as a container, keys and values as arrays; the same offsets passed again agree.
    got = ops.jagged_flash_attention(jq, k, v, offsets, causal=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got.values), want)
    # Arrays with a container's offsets (no max_seq_len there: it must be passed).
    rq = _ReplaceJagged(q, offsets)
    got = ops.jagged_flash_attention(rq, k, v, max_seq_len=9, causal=True, implementation="xla")
    assert isinstance(got, _ReplaceJagged)
    np.testing.assert_array_equal(np.asarray(got.values), want)
    got = ops.jagged_flash_attention(q, jk, v, causal=True, max_seq_len=9, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), want)  # q is an array: so is the result
    # Under jit the containers are pytree arguments (their offsets distinct tracers of one shape).
    attend = jax.jit(lambda *x: ops.jagged_flash_attention(*x, causal=True, implementation="xla"))
    np.testing.assert_allclose(np.asarray(attend(jq, jk, jv).values), want, rtol=1e-6, atol=1e-6)  # jit: 9-key sums, a few u
    grads = jax.grad(lambda x: jnp.sum(attend(_Jagged(x, offsets, 9), jk, jv).values ** 2))(q)
    assert grads.shape == q.shape and np.all(np.isfinite(np.asarray(grads)))


def test_jagged_container_errors_name_the_problem():
    lengths = [3, 5]
    q = jnp.zeros((8, 1, 8), jnp.float32)
    offsets = _offsets(lengths)
    with pytest.raises(ValueError, match="offsets missing"):
        ops.jagged_flash_attention(q, q, q, max_seq_len=5)
    with pytest.raises(ValueError, match="max_seq_len missing"):
        ops.jagged_flash_attention(_ReplaceJagged(q, offsets), q, q)
    with pytest.raises(ValueError, match="max_seq_len missing"):
        ops.jagged_flash_attention(q, q, q, offsets)
    other = _offsets([4, 4])
    with pytest.raises(ValueError, match=r"offsets and k.offsets disagree: offsets\[1\]=3 != k.offsets\[1\]=4"):
        ops.jagged_flash_attention(q, _Jagged(q, other, 5), q, offsets, max_seq_len=5)
    with pytest.raises(ValueError, match=r"q.offsets \(3,\) and v.offsets \(2,\) disagree"):
        ops.jagged_flash_attention(_Jagged(q, offsets, 5), q, _Jagged(q, offsets[:2], 5))
    no_replace = types.SimpleNamespace(values=q, offsets=offsets, max_seq_len=5)
    with pytest.raises(TypeError, match="cannot return a SimpleNamespace"):
        ops.jagged_flash_attention(no_replace, q, q, implementation="xla")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 0)])
def test_padded_dot_product_attention_layout_matches_reference(causal, window):
    """The cuDNN path's jagged -> padded -> jagged plumbing, run with jax's "xla" attention.

    Zero-length and full-length sequences, NaN slack rows; forward and gradients; a
    sliding window passes as `local_window_size` with the same meaning.
    """
    lengths = [0, 5, 1, 11]
    capacity, heads, dim = 21, 2, 8
    q, k, v, dout = _inputs(lengths, capacity, heads, dim, jnp.float32, seed=np.random.randint(1 << 30))
    offsets, end = _offsets(lengths), sum(lengths)

    def run(fn):
        out, vjp = jax.vjp(lambda *x: fn(*x, offsets, max_seq_len=11, causal=causal, scale=0.3, window=window), q, k, v)
        return [np.asarray(x) for x in (out, *vjp(dout))]

    got = run(functools.partial(cudnn.jagged_flash_attention, implementation="xla"))
    want = run(reference.jagged_flash_attention)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a[:end], b[:end], rtol=1e-5, atol=1e-5, err_msg=name)  # float32, <= 11 keys: gamma_11 ~ 1e-6
        assert np.all(a[end:] == 0), f"{name}: slack rows must be 0"


def test_padded_dot_product_attention_without_rows_gives_zeros():
    q = jnp.zeros((0, 1, 8), jnp.bfloat16)
    assert cudnn.jagged_flash_attention(q, q, q, _offsets([0, 0]), max_seq_len=4, implementation="xla").shape == q.shape
    q = jnp.ones((4, 1, 8), jnp.bfloat16)
    out = cudnn.jagged_flash_attention(q, q, q, _offsets([0, 0]), max_seq_len=0, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


# --- the work list --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_work_list_owns_every_row_once_and_is_sorted(causal):
    rng = np.random.default_rng()
    lengths = rng.choice([0, 1, 7, 63, 64, 65, 128, 129, 300], size=17)
    capacity = int(lengths.sum()) + int(rng.integers(0, 200))
    plan = jax.jit(schedule.build_plan, static_argnums=1, static_argnames="causal")(
        _offsets(lengths), capacity, causal=causal
    )
    live = int(plan.meta[schedule.META_LIVE_TILES])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    length_at = {int(s): int(n) for s, n in zip(starts, lengths) if n}
    for table in (plan.q_table, plan.kv_table):
        t = np.asarray(table)[:live]
        owner = np.zeros(capacity, int)
        for rec in t:
            lo = max(rec[schedule.F_LO] - TILE_ROWS * rec[schedule.F_TILE], 0)
            hi = min(rec[schedule.F_HI] - TILE_ROWS * rec[schedule.F_TILE], TILE_ROWS)
            assert rec[schedule.F_ROW0] % 8 == 0 and rec[schedule.F_BASE] % 8 == 0 and hi > lo
            owner[rec[schedule.F_ROW0] + lo : rec[schedule.F_ROW0] + hi] += 1
            first_row = rec[schedule.F_BASE] + rec[schedule.F_LO]
            if rec[schedule.F_KEYS]:
                assert rec[schedule.F_HI] - rec[schedule.F_LO] == length_at[int(first_row)]
            else:
                assert first_row == starts[-1]
        assert np.all(owner == 1)
        tiles = np.ceil(t[:, schedule.F_HI] / TILE_ROWS)
        j = t[:, schedule.F_TILE]
        work = np.where(t[:, schedule.F_KEYS] == 1, (j + 1 if table is plan.q_table else tiles - j) if causal else tiles, 0)
        assert np.all(np.diff(work) <= 0)


def test_work_list_bound_holds_for_adversarial_lengths():
    # Length-1 sequences starting at rows = 7 mod 8 each need their own tile.
    lengths = np.array([7] + [1, 7] * 40)
    capacity = int(lengths.sum())
    plan = schedule.build_plan(_offsets(lengths), capacity, causal=False)
    live = int(plan.meta[schedule.META_LIVE_TILES])
    assert live == int(np.count_nonzero(lengths)) <= plan.q_table.shape[0]


@pytest.mark.parametrize("n_items,num_ctas", [(0, 3), (5, 3), (6, 3), (17, 4), (132, 132), (1000, 132)])
def test_zigzag_deals_each_item_once(n_items, num_ctas):
    seen = []
    for cta in range(num_ctas):
        rounds = int(_mgpu.zigzag_rounds(jnp.int32(n_items), num_ctas, jnp.int32(cta)))
        items = [int(_mgpu.zigzag_item(jnp.int32(r), num_ctas, jnp.int32(cta))) for r in range(rounds)]
        if len(items) > 1:
            assert items[1] == 2 * num_ctas - 1 - cta  # the snake turns back
        seen += items
    assert sorted(seen) == list(range(n_items))


def test_tail_rows_zero_outside_real_data():
    x = jnp.arange(40 * 2, dtype=jnp.float32).reshape(40, 2) + 1
    tail = np.asarray(schedule.tail_rows(x, jnp.int32(21)))
    rows = int(schedule.tail_base(jnp.int32(21))) + np.arange(tail.shape[0])
    expected = np.where(((rows >= 0) & (rows < 21))[:, None], np.asarray(x)[np.clip(rows, 0, 39)], 0)
    np.testing.assert_array_equal(tail, expected)


# --- the Mosaic GPU kernels, interpreted on the CPU ---------------------------------------
# The interpreter compiles one program per simulated warpgroup and kernel shape, so
# these tests share one static shape (capacity, batch, heads, head dim) and differ in
# the lengths, which the kernels only see at run time.

CAPACITY, BATCH, HEADS, DIM = 336, 8, 2, 64


def _check_kernel(lengths, causal, inputs=None, dtype=jnp.bfloat16, capacity=CAPACITY, heads=HEADS, dim=DIM,
                  window=None):
    lengths = list(lengths) + [0] * (BATCH - len(lengths))
    q, k, v, dout = inputs or _inputs(lengths, capacity, heads, dim, dtype, np.random.randint(1 << 30))
    offsets, end = _offsets(lengths), int(sum(lengths))
    max_seq_len = max(max(lengths), 1)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = _value_and_grads("pallas", q, k, v, dout, offsets, max_seq_len=max_seq_len, causal=causal, window=window)
    # The reference on float32 copies of the inputs: exact up to float32 rounding.
    exact = (x.astype(jnp.float32) for x in (q, k, v, dout))
    want = _value_and_grads("xla", *exact, offsets, max_seq_len=max_seq_len, causal=causal, window=window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        _assert_close(a[:end], b[:end], dtype, name)
        assert np.all(a[end:] == 0), f"{name}: slack rows must be 0"


@pytest.mark.parametrize("causal", [False, True])
def test_kernels_match_reference_edge_lengths(causal):
    # Zero, one, around one and two 64-row warpgroup slices and 128-row tiles, the
    # maximum (130), unaligned starts; slack rows and their output cotangents hold NaN.
    _check_kernel([0, 1, 63, 64, 65, 0, 7, 130], causal)


@pytest.mark.parametrize("causal,window", [(True, (1, 0)), (False, (70, 5)), (False, (300, 300)), (True, (130, 0))])
def test_sliding_window_kernels_match_reference(causal, window):
    # Windows of one key, wider than a 128-row tile on one side, and wider than any sequence.
    _check_kernel([0, 1, 63, 64, 65, 0, 7, 130], causal, window=window)


def test_reference_window_matches_band_of_per_sequence_loop():
    lengths = [0, 5, 9]
    q, k, v, _ = _inputs(lengths, 16, 1, 8, jnp.float32, 0)
    got = reference.jagged_flash_attention(q, k, v, _offsets(lengths), max_seq_len=9, window=(2, 1))
    want = np.zeros((16, 1, 8))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for start, n in ((0, 5), (5, 9)):
        for i in range(n):
            js = [j for j in range(n) if i - 2 <= j <= i + 1]
            x = np.array([qn[start + i, 0] @ kn[start + j, 0] for j in js]) * 8**-0.5
            p = np.exp(x - x.max())
            want[start + i, 0] = (p / p.sum()) @ vn[[start + j for j in js], 0]
    np.testing.assert_allclose(np.asarray(got)[:14], want[:14], atol=1e-5)  # float32 vs float64, 4-key windows: a few u


def test_window_errors_name_the_problem():
    q = jnp.zeros((8, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="window must be"):
        ops.jagged_flash_attention(q, q, q, _offsets([8]), max_seq_len=8, window=(-1, 0))
    with pytest.raises(ValueError, match="window must be"):
        ops.jagged_flash_attention(q, q, q, _offsets([8]), max_seq_len=8, window=(True, 0))
    # numpy ints (as a config read from an array gives them) are ints: the same output as Python's
    np.testing.assert_array_equal(
        ops.jagged_flash_attention(q + 1, q, q + 2, _offsets([8]), max_seq_len=8, window=(np.int64(2), np.int32(0))),
        ops.jagged_flash_attention(q + 1, q, q + 2, _offsets([8]), max_seq_len=8, window=(2, 0)),
    )


def test_kernels_all_zero_length_batch():
    _check_kernel([0] * BATCH, causal=False)


@pytest.mark.parametrize("logit", [-12.0, -20.0])
def test_kernels_strongly_negative_logits_half_filled_tile(logit):
    # Every real score sits near `logit`; both sequences end in a half-filled tile
    # (64 of 128 rows), where zero-filled keys would score 0 and dominate.
    lengths = [64, 192]
    keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 5)
    u = jax.random.normal(keys[0], (DIM,))
    u = u / jnp.linalg.norm(u)
    a = np.sqrt(-logit * np.sqrt(DIM))
    shape = (CAPACITY, HEADS, DIM)
    q = a * u + jax.random.normal(keys[1], shape)
    k = -a * u + jax.random.normal(keys[2], shape)
    v, dout = jax.random.normal(keys[3], shape), jax.random.normal(keys[4], shape)
    scores = jnp.einsum("thd,shd->hts", q[:64], k[:64]) * DIM**-0.5
    assert abs(float(jnp.median(scores)) - logit) < 1.0, float(jnp.median(scores))
    inputs = [x.astype(jnp.bfloat16).at[sum(lengths) :].set(jnp.nan) for x in (q, k, v, dout)]
    _check_kernel(lengths, causal=False, inputs=inputs)


def test_kernels_head_dim_128_unaligned_capacity():
    _check_kernel([70, 1, 129], causal=True, capacity=203, heads=1, dim=128)


@pytest.mark.parametrize("causal,window", [(True, (256, 0)), (False, (64, 64))])
def test_sliding_window_kernels_lower_for_hopper(causal, window):
    """Forward, dQ and dK/dV with a window lower through Mosaic GPU (layouts, TMA shapes)."""
    from pallas_kernels.jagged_flash_attention import vjp

    offsets = _offsets([70, 0, 130, 5, 301])
    x = jax.ShapeDtypeStruct((509, 4, 128), jnp.bfloat16)

    def fwd_bwd(q, k, v):
        f = lambda q, k, v: vjp.jagged_flash_attention(q, k, v, offsets, max_seq_len=301, causal=causal, window=window,
                                                       num_ctas=132)
        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(out)

    lowered = jax.jit(fwd_bwd).trace(x, x, x).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 3


def test_default_implementation_leaves_cudnn_for_two_sided_windows(monkeypatch):
    from pallas_kernels._src import dispatch

    monkeypatch.setattr(dispatch, "is_nvidia_gpu", lambda device=None: True)
    monkeypatch.setattr(dispatch.OpSupport, "cudnn_problem", lambda self, *a: None)
    called = []
    monkeypatch.setattr(cudnn, "jagged_flash_attention", lambda q, *a, **kw: called.append(kw["window"]) or q)
    x = jnp.zeros((8, 1, 64), jnp.bfloat16)
    for causal, window in ((True, (4, 0)), (False, (4, 0)), (False, (2, 3))):
        ops.jagged_flash_attention(x, x, x, _offsets([8]), max_seq_len=8, causal=causal, window=window)
    assert called == [(4, 0)]
