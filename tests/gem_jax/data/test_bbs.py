"""Tests of base batch shuffling: the window algorithm and the per-device ordering of a global batch."""

import numpy as np
import pytest

from gem_jax.data.bbs import BalancedBatchOrder, balance_shards, base_batch_shuffle
from gem_jax.model.flops import Workload
from gem_jax.data.balance import load_imbalance, shard_loads

WORKLOAD = Workload(per_token=1000.0, per_token_pair=3.0, per_example=50.0)


def _reference_bbs(workloads, minibatch_size, minibatches_per_batch, seed, num_batches=None):
    """The algorithm written out with Python loops, one decision at a time."""
    w = [float(x) for x in workloads]
    batch_size = minibatch_size * minibatches_per_batch
    k = num_batches if num_batches is not None else len(w) // batch_size
    units = []  # (load, samples), minibatch-major, heaviest pair of each minibatch first
    for start in range(0, len(w), minibatch_size):
        ids = sorted(range(start, min(start + minibatch_size, len(w))), key=lambda i: (w[i], i))
        while ids:
            heavy = ids.pop()
            light = [ids.pop(0)] if ids else []
            units.append((w[heavy] + sum(w[i] for i in light), [heavy, *light]))
    tie_order = [int(b) for b in np.random.default_rng(seed).permutation(k)]
    ranked = sorted(range(len(units)), key=lambda u: (-units[u][0], u))
    loads = [0.0] * k
    members = [[] for _ in range(k)]
    for start in range(0, len(ranked), k):
        lightest = sorted(range(k), key=lambda j: (loads[tie_order[j]], j))
        for rank, u in enumerate(ranked[start : start + k]):
            b = tie_order[lightest[rank]]
            loads[b] += units[u][0]
            members[b] += units[u][1]
    return [np.array(sorted(m), dtype=np.int64) for m in members]


def _long_tail_workloads(rng, n):
    lengths = np.clip(rng.lognormal(np.log(150.0), 1.0, size=n), 0, 4096).astype(np.int64)
    return WORKLOAD(lengths)


@pytest.mark.parametrize("ties", [False, True])
def test_matches_reference_and_is_a_permutation(ties):
    rng = np.random.default_rng()
    for _ in range(3):
        m = 2 * int(rng.integers(1, 9))
        n = int(rng.integers(1, 5))
        k = int(rng.integers(1, 7))
        size = k * m * n
        w = rng.integers(0, 4, size=size).astype(float) if ties else _long_tail_workloads(rng, size)
        seed = int(rng.integers(2**31))
        got = base_batch_shuffle(w, minibatch_size=m, minibatches_per_batch=n, seed=seed)
        want = _reference_bbs(w, m, n, seed)
        assert len(got) == k
        for g, r in zip(got, want):
            np.testing.assert_array_equal(g, r)
            assert g.dtype == np.int64 and g.size == m * n
        np.testing.assert_array_equal(np.sort(np.concatenate(got)), np.arange(size))


def test_load_spread_is_bounded_by_the_heaviest_pair():
    rng = np.random.default_rng()
    m, n, k = 16, 4, 8
    w = _long_tail_workloads(rng, k * m * n)
    loads = np.array([w[b].sum() for b in base_batch_shuffle(w, minibatch_size=m, minibatches_per_batch=n)])
    heaviest_pair = max(np.sort(mb)[::-1][0] + np.sort(mb)[0] for mb in w.reshape(-1, m))
    assert loads.max() - loads.min() <= heaviest_pair


def test_seed_only_relabels_batches():
    rng = np.random.default_rng()
    w = _long_tail_workloads(rng, 8 * 64)
    kwargs = dict(minibatch_size=16, minibatches_per_batch=4)
    a = base_batch_shuffle(w, seed=1, **kwargs)
    b = base_batch_shuffle(w, seed=2, **kwargs)
    for x, y in zip(a, base_batch_shuffle(w, seed=1, **kwargs)):
        np.testing.assert_array_equal(x, y)
    assert sorted(tuple(x) for x in a) == sorted(tuple(y) for y in b)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))


def test_short_window_remainder_policy():
    rng = np.random.default_rng()
    m, n, k = 8, 2, 4
    for size in [0, 1, 3, 7, 8 * 3 + 5, k * m * n - 1]:
        w = _long_tail_workloads(rng, size)
        got = base_batch_shuffle(w, minibatch_size=m, minibatches_per_batch=n, num_batches=k, seed=3)
        want = _reference_bbs(w, m, n, 3, num_batches=k)
        assert len(got) == k
        for g, r in zip(got, want):
            np.testing.assert_array_equal(g, r)
            assert g.size <= m * n
        np.testing.assert_array_equal(np.sort(np.concatenate(got)), np.arange(size))


def test_bad_input_is_named():
    w = np.ones(32)
    with pytest.raises(ValueError, match="window of 30 samples is not a positive multiple of .* = 16"):
        base_batch_shuffle(np.ones(30), minibatch_size=8, minibatches_per_batch=2)
    with pytest.raises(ValueError, match="window of 33 samples exceeds num_batches"):
        base_batch_shuffle(np.ones(33), minibatch_size=8, minibatches_per_batch=2, num_batches=2)
    with pytest.raises(ValueError, match="minibatch_size must be even"):
        base_batch_shuffle(w, minibatch_size=7, minibatches_per_batch=2)
    with pytest.raises(ValueError, match="minibatches_per_batch must be a positive int"):
        base_batch_shuffle(w, minibatch_size=8, minibatches_per_batch=0)
    with pytest.raises(ValueError, match="workload nan at index 3"):
        base_batch_shuffle(np.where(np.arange(32) == 3, np.nan, 1.0), minibatch_size=8, minibatches_per_batch=2)
    with pytest.raises(ValueError, match="workload -1.0 at index 0"):
        base_batch_shuffle(-w, minibatch_size=8, minibatches_per_batch=2)
    with pytest.raises(ValueError, match="must be 1-D"):
        base_batch_shuffle(w.reshape(2, 16), minibatch_size=8, minibatches_per_batch=2)


def test_imbalance_is_far_below_random_batching():
    rng = np.random.default_rng()
    k, b = 8, 1024
    bbs, random = [], []
    for _ in range(8):
        w = _long_tail_workloads(rng, k * b)
        random.append(load_imbalance(w.reshape(k, b).sum(axis=1)))
        bbs.append(load_imbalance([w[i].sum() for i in base_batch_shuffle(w)]))
    assert np.mean(bbs) < 0.01 < 0.04 < np.mean(random)


# ---- one global batch over data-parallel shards ---------------------------------------------------


def test_balance_shards_deals_like_base_batch_shuffle():
    rng = np.random.default_rng()
    for _ in range(6):
        d = int(rng.integers(2, 9))
        per = 2 * int(rng.integers(1, 40))
        m = 2 * int(rng.integers(1, 20))  # need not divide N
        w = _long_tail_workloads(rng, d * per)
        seed = (int(rng.integers(2**31)), 7)
        order = balance_shards(w, d, minibatch_size=m, seed=seed)
        want = _reference_bbs(w, m, 1, seed, num_batches=d)
        assert order.dtype == np.int64
        np.testing.assert_array_equal(order, np.concatenate(want))
        assert [len(b) for b in want] == [per] * d
        np.testing.assert_array_equal(np.sort(order), np.arange(d * per))
    np.testing.assert_array_equal(balance_shards(w, 1, minibatch_size=m), np.arange(w.size))


def test_balance_shards_balances_a_global_batch():
    rng = np.random.default_rng()
    d, per = 8, 1024
    plain, balanced = [], []
    for _ in range(8):
        w = _long_tail_workloads(rng, d * per)
        plain.append(load_imbalance(shard_loads(w, d)))
        balanced.append(load_imbalance(shard_loads(w[balance_shards(w, d)], d)))
    assert np.mean(balanced) < 0.01 < 0.04 < np.mean(plain)


def test_balance_shards_rejects_bad_splits():
    with pytest.raises(ValueError, match="a batch of 30 samples does not split into 4 equal shards"):
        balance_shards(np.ones(30), 4)
    with pytest.raises(ValueError, match="shard size 30 / 2 = 15 is odd"):
        balance_shards(np.ones(30), 2)
    with pytest.raises(ValueError, match="num_shards must be a positive int, got 0"):
        balance_shards(np.ones(30), 0)
    with pytest.raises(ValueError, match="balance_shards: minibatch_size must be even"):
        balance_shards(np.ones(32), 2, minibatch_size=5)
    with pytest.raises(ValueError, match="balance_shards: workload inf at index 2"):
        balance_shards(np.where(np.arange(32) == 2, np.inf, 1.0), 2)


def test_balanced_batch_order_reorders_full_batches_only():
    rng = np.random.default_rng()
    lengths = np.clip(rng.lognormal(np.log(40.0), 1.0, size=500), 0, 4096).astype(np.int64)
    order = BalancedBatchOrder(lengths=lengths.take, workload=WORKLOAD, num_shards=4, batch_size=64, minibatch_size=16, seed=3)
    batch = rng.permutation(500)[:64]
    got = order(11, batch)
    np.testing.assert_array_equal(got, batch[balance_shards(WORKLOAD(lengths[batch]), 4, minibatch_size=16, seed=(3, 11))])
    np.testing.assert_array_equal(order(11, batch), got)  # a pure function of (index, indices)
    short = batch[:40]
    np.testing.assert_array_equal(order(12, short), short)
    with pytest.raises(ValueError, match="batch 2 has 65 examples, more than B = 64"):
        order(2, np.arange(65))
    with pytest.raises(ValueError, match="BalancedBatchOrder: the shard size 64 / 64 = 1 is odd"):
        BalancedBatchOrder(lengths=lengths.take, workload=WORKLOAD, num_shards=64, batch_size=64)
