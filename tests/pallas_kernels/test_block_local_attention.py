"""Block-local attention: the jnp reference against a per-block float64 loop, the work
list, and the Mosaic GPU kernels (CPU interpret mode) against the reference, forward
and gradients, with and without fused RoPE."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from tolerances import BFLOAT16, FLOAT32, attention_budget, check

from pallas_kernels import block_local_attention
from pallas_kernels.block_local_attention import reference, schedule
from pallas_kernels.jagged_flash_attention.config import ROW_ALIGN

# max |kernel - reference| / max |reference| by input dtype (tests/support/tolerances.py; measured: benchmarks/tolerances.md).
BUDGET = {jnp.dtype(d): attention_budget(f) for d, f in ((jnp.bfloat16, BFLOAT16), (jnp.float32, FLOAT32))}
EDGE_LENGTHS = [0, 1, 63, 64, 65, 130, 200]  # 200: past several blocks, partial last block


def _offsets(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _inputs(lengths, capacity, heads, dim, dtype, seed, scale=1.0, shift=0.0):
    """q, k, v, dout `[capacity, H, D]`; rows past the real data hold NaN."""
    end = int(sum(lengths))
    xs = []
    for i, key in enumerate(jax.random.split(jax.random.key(seed), 4)):
        x = jax.random.normal(key, (capacity, heads, dim), jnp.float32) * (scale if i < 2 else 1.0)
        xs.append(x.astype(dtype).at[end:].set(jnp.nan))
    return xs


def _naive(q, k, v, lengths, block, scale, rope_base=None):
    """float64 block-local attention, one block and head at a time; RoPE from float64 angles."""
    q, k, v = (np.asarray(x.astype(jnp.float32)).astype(np.float64) for x in (q, k, v))
    out = np.zeros_like(q)
    start = 0
    for n in lengths:
        pos = np.arange(n)
        if rope_base is not None:
            half = q.shape[-1] // 2
            ang = pos[:, None] * rope_base ** (-np.arange(half) / half)[None, :]
            c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
            rot = lambda x: np.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], -1)
            qs, ks = rot(q[start : start + n]), rot(k[start : start + n])
        else:
            qs, ks = q[start : start + n], k[start : start + n]
        for b0 in range(0, n, block):
            b = slice(b0, min(b0 + block, n))
            for h in range(q.shape[1]):
                x = qs[b, h] @ ks[b, h].T * scale
                p = np.exp(x - x.max(-1, keepdims=True))
                out[start + b0 : start + b.stop, h] = (p / p.sum(-1, keepdims=True)) @ v[start:][b, h]
        start += n
    return out


@pytest.mark.parametrize("rope_base", [None, 100.0])
@pytest.mark.parametrize("block", [64, 5])
def test_reference_matches_per_block_loop(rope_base, block):
    lengths = [0, 1, 7, 12, 70]
    q, k, v, _ = _inputs(lengths, 100, 2, 8, jnp.float32, 0)
    got = reference.block_local_attention(q, k, v, _offsets(lengths), block_size=block, max_seq_len=70,
                                          rope_base=rope_base)
    want = _naive(q, k, v, lengths, block, 8**-0.5, rope_base)
    end = sum(lengths)
    np.testing.assert_allclose(np.asarray(got)[:end], want[:end], atol=1e-5)  # float32 vs float64: <= 64-key sums, gamma_64 = 4e-6
    np.testing.assert_array_equal(np.asarray(got)[end:], 0.0)


def test_reference_rope_matches_gem_jax_apply_rope():
    # The op must not import gem_jax; its RoPE convention must still be the model's.
    from gem_jax.nn.layers import apply_rope, rope_table

    x = jax.random.normal(jax.random.key(1), (9, 2, 16), jnp.float32).astype(jnp.bfloat16)
    pos = jnp.asarray([0, 1, 2, 0, 1, 5, 100, 4095, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(reference.rope(x, pos, 10000.0), np.float32),
                                  np.asarray(apply_rope(x, rope_table(pos, 16, 10000.0)), np.float32))


def test_fused_rope_equals_unfused_apply_rope_then_attention():
    from gem_jax.nn.layers import apply_rope, rope_table
    from pallas_kernels.jagged_layout import positions_in_sequence

    lengths = [3, 70, 0, 9]
    offsets = _offsets(lengths)
    q, k, v, dout = _inputs(lengths, 90, 2, 16, jnp.float32, 2)
    table = rope_table(positions_in_sequence(offsets, 90), 16, 500.0)
    fused = lambda q, k, v: block_local_attention(q, k, v, offsets, max_seq_len=70, rope_base=500.0, implementation="xla")
    unfused = lambda q, k, v: block_local_attention(apply_rope(q, table), apply_rope(k, table), v, offsets,
                                                    max_seq_len=70, implementation="xla")
    # The same float32 operations, fused or not: summation order of 64-key blocks at most (gamma_64 = 4e-6 of the
    # largest term; outputs are averages of unit-normal v, gradients sums of up to 64 such terms).
    for a, b in zip(jax.vjp(fused, q, k, v)[1](dout), jax.vjp(unfused, q, k, v)[1](dout)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    np.testing.assert_allclose(np.asarray(fused(q, k, v)), np.asarray(unfused(q, k, v)), atol=1e-6)


def test_explicit_positions_place_the_rotation():
    lengths = [5, 4]
    offsets = _offsets(lengths)
    q, k, v, _ = _inputs(lengths, 9, 1, 8, jnp.float32, 3)
    from pallas_kernels.jagged_layout import positions_in_sequence

    default = block_local_attention(q, k, v, offsets, max_seq_len=5, rope_base=10.0, implementation="xla")
    given = block_local_attention(q, k, v, offsets, max_seq_len=5, rope_base=10.0, implementation="xla",
                                  positions=positions_in_sequence(offsets, 9) + 7)
    # Relative rotations are shift-invariant: scores (and so outputs) do not change.
    np.testing.assert_allclose(np.asarray(default), np.asarray(given), atol=1e-5)  # float32 cos/sin of angles 7 apart: ~10 u


def test_bad_input_errors_name_the_problem():
    q = jnp.zeros((8, 1, 8), jnp.float32)
    off = _offsets([8])
    with pytest.raises(ValueError, match="positions given without rope_base"):
        block_local_attention(q, q, q, off, max_seq_len=8, positions=jnp.zeros(8))
    with pytest.raises(ValueError, match="block_size"):
        block_local_attention(q, q, q, off, max_seq_len=8, block_size=0)
    with pytest.raises(ValueError, match="positions must be"):
        block_local_attention(q, q, q, off, max_seq_len=8, rope_base=1.0, positions=jnp.zeros(3))
    with pytest.raises(ValueError, match=r"q, k, v must share one floating dtype .*; got int32, int32, int32"):
        block_local_attention(*(q.astype(jnp.int32),) * 3, off, max_seq_len=8)
    qb = jnp.zeros((8, 1, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="block_size"):
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            block_local_attention(qb, qb, qb, off, max_seq_len=8, block_size=32, implementation="pallas")


def test_work_list_owns_every_row_once():
    lengths = np.array([0, 1, 63, 64, 65, 130, 0, 7])
    capacity = int(lengths.sum()) + 70
    plan = schedule.build_plan(_offsets(lengths), capacity, None)
    live = int(plan.live[0])
    t = np.asarray(plan.table)[:live]
    owner = np.zeros(capacity, int)
    for start, rows, _ in t:
        assert 1 <= rows <= 64
        owner[start : start + rows] += 1
    assert np.all(owner == 1) and live <= plan.table.shape[0]
    assert int(t[:, schedule.F_KEYS].sum()) == int(np.sum(np.ceil(lengths / 64)))
    pos = np.asarray(plan.positions)[:live]
    assert pos[t[:, 0].tolist().index(1 + 63 + 64 + 65 + 64), :2].tolist() == [64.0, 65.0]  # 130's second block


# --- the Mosaic GPU kernels, interpreted on the CPU ---------------------------------------


def _value_and_grads(impl, q, k, v, dout, offsets, max_seq_len, rope_base, num_ctas=None):
    if num_ctas is None:
        fn = functools.partial(block_local_attention, offsets=offsets, max_seq_len=max_seq_len, rope_base=rope_base,
                               implementation=impl)
    else:  # the kernels' own entry, which takes the persistent grid size
        from pallas_kernels.block_local_attention import vjp as kernels

        fn = functools.partial(kernels.block_local_attention, offsets=offsets, block_size=64, rope_base=rope_base,
                               num_ctas=num_ctas)
    out, pullback = jax.vjp(fn, q, k, v)
    return [np.asarray(x.astype(jnp.float32)) for x in (out, *pullback(dout))]


def _check_kernel(lengths, rope_base, dim=64, heads=1, scale=1.0, shift=0.0, capacity=None, num_ctas=None,
                  params=None):
    capacity = capacity or sum(lengths) + 13
    q, k, v, dout = _inputs(lengths, capacity, heads, dim, jnp.bfloat16, 7, scale=scale)
    if shift:
        # Scores near `shift` for every key: q . k = shift * sqrt(D) after the 1/sqrt(D) scale.
        q = jnp.ones_like(q) * jnp.sqrt(jnp.float32(dim)).astype(q.dtype)
        k = (jnp.ones_like(k) * (shift / dim) + 0.1 * k.astype(jnp.float32)).astype(k.dtype)
        end = sum(lengths)
        q, k = q.at[end:].set(jnp.nan), k.at[end:].set(jnp.nan)
    offsets = _offsets(lengths)
    args = (q, k, v, dout, offsets, max(max(lengths), 1), rope_base)
    want = _value_and_grads("xla", *args)
    with plgpu.force_gpu_interpret_mode(params or plgpu.InterpretGPUParams()):
        got = _value_and_grads("pallas", *args, num_ctas=num_ctas)
    end = sum(lengths)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_array_equal(g[end:], 0.0, err_msg=f"{name}: slack rows")
        err = np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-6)
        check(name, err, BUDGET[jnp.dtype(jnp.bfloat16)])


@pytest.mark.parametrize("rope_base", [None, 10000.0])
def test_kernels_match_reference_edge_lengths(rope_base):
    _check_kernel(EDGE_LENGTHS, rope_base)


def test_kernels_head_dim_128_with_rope():
    _check_kernel([3, 66], 10000.0, dim=128, heads=2)


@pytest.mark.parametrize("logit", [-12.0, -20.0])
def test_kernels_strongly_negative_logits(logit):
    _check_kernel([5, 64, 70], None, shift=logit)


def test_kernels_all_zero_length_batch():
    _check_kernel([0, 0], 10000.0, capacity=24)


def _blocks(lengths, capacity):
    """Work items of a batch: its live 64-row blocks (real and slack), each walked as H steps."""
    padded = -(-capacity // ROW_ALIGN) * ROW_ALIGN
    return int(schedule.build_plan(_offsets(lengths), padded, None).live[0])


# 8 blocks (one of them slack) of 2 heads: 16 steps.
RING_LENGTHS, RING_CAPACITY, RING_HEADS = [130, 5, 64, 70], 282, 2


def test_persistent_ctas_loop_over_more_items_than_ctas():
    # Three CTAs take 3, 3 and 2 blocks (6, 6 and 4 steps): the 3-slot ring wraps, and 4 steps end it mid-lap.
    assert _blocks(RING_LENGTHS, RING_CAPACITY) == 8
    _check_kernel(RING_LENGTHS, 10000.0, heads=RING_HEADS, capacity=RING_CAPACITY, num_ctas=3)


@pytest.mark.parametrize("heads, num_ctas", [(3, 2), (1, 1)])
def test_persistent_blocks_walk_their_heads_as_steps(heads, num_ctas):
    """5 blocks: 70 rows (64 + 6), none, 100 rows (64 + 36, the last crossing the first slack row: tail
    copy), then a slack block. H=3 over 2 CTAs: 3 and 2 blocks (9 and 6 steps), every block's head 0 in
    ring slot 0 and its RoPE tables reused by heads 1 and 2. H=1 over 1 CTA: 5 steps, each a block's
    head 0, so the tables are recomputed every step and the positions ring wraps."""
    lengths, capacity = [70, 0, 100], 200
    assert _blocks(lengths, capacity) == 5
    _check_kernel(lengths, 10000.0, heads=heads, capacity=capacity, num_ctas=num_ctas)


@pytest.mark.parametrize("lengths, capacity, heads, num_ctas, dim", [
    (RING_LENGTHS, RING_CAPACITY, RING_HEADS, 1, 64),
    ([70, 0, 100], 200, 1, 1, 64),
    ([70, 0, 100], 200, 3, 1, 128),
])
def test_persistent_pipeline_has_no_races(monkeypatch, capfd, lengths, capacity, heads, num_ctas, dim):
    """Under the interpreter's happens-before race detector: one CTA walks all 16 steps (the
    backward's three-slot ring wraps five times and a third, the forward's two-slot ring eight
    times), and one CTA walks the 5 one-head blocks of `test_persistent_blocks_walk_their_heads_as_steps`
    (an odd count: both rings end mid-lap, and every step reloads the positions ring into the
    slot whose positions the step before last read). TMA loads, register reads and writes, wgmma
    reads and TMA stores of each slot, and the positions ring read once per block, are ordered by
    the barriers and the store-group waits (in either walk a wait one group too lax is reported
    as a race). At D=128 the backward's two warpgroups share one CTA's ring over 15 steps (5
    blocks of 3 heads, the last slack): each warpgroup runs as its own interpreter thread, so the
    detector also checks the handover of every slot from one warpgroup to the other (a TMA
    barrier, or the slack handoff barrier) and each warpgroup's own store-group waits.

    The detector's RefUnion check is switched off: it treats a union as one buffer, so a ring of
    slots with a plain and a swizzled view reads as a violation whenever two slots are in
    different phases. The happens-before checks of the bytes themselves stay on. The interpreter
    counts each TMA store as its own group (the GPU counts `commit_smem_to_gmem_group` groups), so
    `wait_smem_to_gmem(n)` leaves fewer stores pending here than on the GPU: a missing wait is
    caught, a wait count too small for a step of several stores is not (the two-warpgroup walk
    waits with n = 0, where both count alike). Pending stores are kept per interpreter thread,
    i.e. per warpgroup, as the GPU keeps bulk-copy groups per issuing thread. Barrier phases are
    checked exactly: a warpgroup skipping a phase of a barrier it waits on is an error (with the
    ring's barriers indexed by slot only, warpgroups would skip every other phase).
    """
    from jax._src.pallas.mosaic_gpu.interpret import race_detection_state

    monkeypatch.setattr(race_detection_state.GPURaceDetectionState, "_check_ref_union", lambda *a, **k: None)
    _check_kernel(lengths, 10000.0, dim=dim, heads=heads, capacity=capacity, num_ctas=num_ctas,
                  params=plgpu.InterpretGPUParams(detect_races=True))
    assert "RACE DETECTED" not in capfd.readouterr().out


@pytest.mark.parametrize("heads, num_ctas", [(3, 2), (1, 4)])
def test_backward_warpgroups_alternate_over_a_ctas_steps(heads, num_ctas):
    """At D=128 the backward CTA's two warpgroups take its steps alternately (warpgroup s % 2 step
    s) through one three-slot ring. The 5 blocks of `test_persistent_blocks_walk_their_heads_as_steps`:
    H=3 over 2 CTAs: 9 steps (odd) and 6; warpgroup 0 computes heads 0 and 2 of a CTA's even
    rounds and head 1 of its odd ones, so each warpgroup computes RoPE tables for the blocks it
    touches; the first CTA ends with a slack block (both warpgroups store zeros). H=1 over 4 CTAs:
    2, 1, 1 and 1 steps: a block per step, alternating warpgroups, and three CTAs with a single
    step, where warpgroup 1 computes nothing."""
    _check_kernel([70, 0, 100], 10000.0, dim=128, heads=heads, capacity=200, num_ctas=num_ctas)


@pytest.mark.parametrize("dim, backward_ctas", [(64, 264), (128, 132)])
def test_gpu_grids_are_ctas_per_sm_times_sm_count(monkeypatch, dim, backward_ctas):
    """On a GPU (132 SMs) the forward runs two CTAs per SM; the backward two at D=64 (110 KiB of
    shared memory each) and one at D=128 (214 KiB, two warpgroups)."""
    from pallas_kernels._src import mgpu_common
    from pallas_kernels.block_local_attention import vjp

    monkeypatch.setattr(mgpu_common, "interpreting", lambda: False)
    monkeypatch.setattr(mgpu_common, "sm_count", lambda: 132)
    grids = {}

    def kernel(name, q, *args, num_ctas, **kwargs):
        grids[name] = num_ctas
        return q if name == "forward" else (q, q, q)

    monkeypatch.setattr(vjp, "forward", functools.partial(kernel, "forward"))
    monkeypatch.setattr(vjp, "backward", functools.partial(kernel, "backward"))
    x = jnp.zeros((8, 1, dim), jnp.bfloat16)
    jax.vjp(lambda x: vjp.block_local_attention(x, x, x, _offsets([8]), block_size=64), x)[1](x)
    assert grids == {"forward": 264, "backward": backward_ctas}


def test_persistent_ctas_outnumber_items():
    # 4 blocks (3 real, 1 slack) of one head over 7 CTAs: three CTAs have no round at all.
    lengths, capacity = [5, 70], 88
    assert _blocks(lengths, capacity) == 4
    _check_kernel(lengths, None, capacity=capacity, num_ctas=7)


def test_persistent_ctas_all_empty_batch():
    # No real block: 3 slack blocks of 2 heads over 4 CTAs, which only store zeros; one CTA has none.
    lengths, capacity, heads = [0, 0, 0], 150, 2
    assert _blocks(lengths, capacity) == 3
    _check_kernel(lengths, 10000.0, heads=heads, capacity=capacity, num_ctas=4)


@pytest.mark.parametrize("dim", [64, 128])
def test_kernels_lower_for_hopper(dim):
    """Forward and backward lower through Mosaic GPU (layouts, TMA shapes), with and without RoPE."""
    from pallas_kernels.block_local_attention import vjp

    offsets = _offsets([70, 0, 130, 5, 301])
    x = jax.ShapeDtypeStruct((509, 4, dim), jnp.bfloat16)
    for rope_base in (None, 10000.0):

        def fwd_bwd(q, k, v):
            f = lambda q, k, v: vjp.block_local_attention(q, k, v, offsets, block_size=64, rope_base=rope_base)
            out, pullback = jax.vjp(f, q, k, v)
            return out, pullback(out)

        lowered = jax.jit(fwd_bwd).trace(x, x, x).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("mosaic_gpu") >= 2


@pytest.mark.parametrize("rope_base, head_dim, max_seq_len, positions_given, bounded", [
    (10000.0, 64, 4096, False, True), (10000.0, 128, 65537, False, True), (10000.0, 128, 65538, False, False),
    (10000.0, 64, 4096, True, False), (10000.0, 64, None, False, False), (None, 64, 4096, False, False),
    (1.0, 64, 65537, False, True),
    # a base below 1 makes the last frequency the largest: 0.5 ** (-31/32) = 1.96 at D=64, 898 at D=128 for 1e-3
    (0.5, 64, 4096, False, True), (0.5, 64, 65537, False, False), (1e-3, 128, 73, False, True),
    (1e-3, 128, 75, False, False), (1e-6, 64, 128, False, False),
])
def test_angles_are_bounded_only_below_max_angle(rope_base, head_dim, max_seq_len, positions_given, bounded):
    """Every default-position angle is (max_seq_len - 1) x the largest frequency at most: bounded when that is
    <= MAX_ANGLE; given positions, no bound or no RoPE never."""
    from pallas_kernels._src import bounded_trig
    from pallas_kernels.block_local_attention import vjp

    assert vjp.angles_bounded(rope_base, head_dim, max_seq_len, positions_given) is bounded
    if bounded:  # the rule's bound holds for the frequencies the kernels read
        largest = float(jnp.max(reference.rope_frequencies(head_dim, rope_base)))
        assert (max_seq_len - 1) * largest <= bounded_trig.MAX_ANGLE * (1 + 1e-6)


@pytest.mark.parametrize("rope_base, positions, bounded", [(10000.0, False, True), (10000.0, True, False),
                                                          (1e-6, False, False)])
def test_rope_tables_take_bounded_sin_cos_only_when_angles_are_bounded(monkeypatch, rope_base, positions, bounded):
    """Through the public op: the kernels' tables take `bounded_trig.sin_cos` (forward and backward) only when
    `angles_bounded` says so; otherwise CUDA's sin/cos."""
    from pallas_kernels._src import bounded_trig
    from pallas_kernels.block_local_attention import _mgpu

    calls, sin_cos = [], bounded_trig.sin_cos
    monkeypatch.setattr(_mgpu.bounded_trig, "sin_cos", lambda x: calls.append(x.shape) or sin_cos(x))
    offsets = _offsets([70, 0, 5])
    x = jax.ShapeDtypeStruct((80, 2, 64), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((80,), jnp.int32) if positions else None

    def fwd_bwd(q, k, v, pos):
        f = lambda q, k, v: block_local_attention(q, k, v, offsets, max_seq_len=128, rope_base=rope_base, positions=pos,
                                                  implementation="pallas")
        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(out)

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        jax.jit(fwd_bwd).trace(x, x, x, pos)
    assert bool(calls) is bounded  # the forward's and the backward's tables, each trace of them
    assert all(shape == (64, 32) for shape in calls)


def test_default_implementation_takes_the_kernels_only_for_64_row_blocks(monkeypatch):
    from pallas_kernels._src import dispatch
    from pallas_kernels.block_local_attention import vjp

    monkeypatch.setattr(dispatch, "is_hopper_gpu", lambda device=None: True)
    called = []
    monkeypatch.setattr(vjp, "block_local_attention", lambda q, *a, **kw: called.append(kw["block_size"]) or q)
    x = jnp.zeros((8, 1, 64), jnp.bfloat16)
    for block in (64, 32):
        block_local_attention(x, x, x, _offsets([8]), max_seq_len=8, block_size=block)
    assert called == [64]
