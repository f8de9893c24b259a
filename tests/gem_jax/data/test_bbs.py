"""Tests of base batch shuffling: the window algorithm and the grain stage."""

import json

import grain
from absl import flags
import numpy as np
import pytest

from gem_jax.data.bbs import BaseBatchShuffleIterDataset, base_batch_shuffle
from gem_jax.data.workload import Workload, load_imbalance

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


# ---- the grain stage -------------------------------------------------------------------------------

M, N, K = 4, 2, 3  # minibatch_size, minibatches_per_batch, num_batches: windows of 24 examples


def _examples(num, epochs=1, shuffle_seed=5):
    """A shuffled list of records {"id", "length"} with long-tailed lengths (picklable by value for workers)."""
    lengths = np.minimum(np.random.default_rng(num).lognormal(np.log(40.0), 1.0, size=num), 4096).astype(int)
    records = [{"id": i, "length": int(n)} for i, n in enumerate(lengths)]
    return grain.MapDataset.source(records).shuffle(seed=shuffle_seed).repeat(epochs)


def _stage(parent, **kwargs):
    kwargs = dict(dict(workload=WORKLOAD, num_batches=K, minibatch_size=M, minibatches_per_batch=N, seed=9), **kwargs)
    return BaseBatchShuffleIterDataset(parent, **kwargs)


def _ids(stream):
    return [[e["id"] for e in batch] for batch in stream]


def test_stage_deals_each_window_with_base_batch_shuffle():
    num = 24 * 3 + 11
    examples = list(_examples(num))
    out = _ids(_stage(_examples(num).to_iter_dataset()))
    assert len(out) == 4 * K
    for w, start in enumerate(range(0, num, 24)):
        window = examples[start : start + 24]
        lengths = np.array([e["length"] for e in window])
        want = base_batch_shuffle(WORKLOAD(lengths), minibatch_size=M, minibatches_per_batch=N, seed=(9, w), num_batches=K)
        assert out[w * K : (w + 1) * K] == [[window[i]["id"] for i in b] for b in want]
    assert [len(b) for b in out[: 3 * K]] == [M * N] * 3 * K
    assert sum(len(b) for b in out[3 * K :]) == 11  # the short last window: short batches, nothing dropped


def test_stage_output_is_a_permutation_across_epochs():
    num, epochs = 50, 3
    out = _ids(_stage(_examples(num, epochs).to_iter_dataset()))
    counts = np.bincount(np.concatenate(out), minlength=num)
    np.testing.assert_array_equal(counts, np.full(num, epochs))


@pytest.mark.parametrize("cut", [0, 1, K - 1, K, 2 * K + 1, 6 * K + 1, 7 * K])
def test_resume_gives_the_same_stream(cut):
    num = 24 * 6 + 5  # 7 windows, the last one short
    full = _ids(_stage(_examples(num).to_iter_dataset()))
    it = iter(_stage(_examples(num).to_iter_dataset()))
    head = _ids(next(it) for _ in range(cut))
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    resumed = iter(_stage(_examples(num).to_iter_dataset()))  # a fresh iterator
    resumed.set_state(state)
    assert head + _ids(resumed) == full
    assert head + _ids(it) == full


def _parse_absl_flags():
    """mp_prefetch reads grain's absl flags; a training entry point parses them, pytest does not."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _prefetched_pipeline(num, workers):
    options = grain.MultiprocessingOptions(num_workers=workers)
    return _stage(_examples(num).to_iter_dataset().mp_prefetch(options))


def test_same_stream_for_any_worker_count():
    _parse_absl_flags()
    num = 24 * 4 + 7
    streams = []
    for workers in (0, 2):
        it = iter(_prefetched_pipeline(num, workers))
        streams.append(_ids(it))
        it.close()
    assert streams[0] == streams[1]
    assert sorted(np.concatenate(streams[1]).tolist()) == list(range(num))


@pytest.mark.slow
def test_resume_behind_worker_processes():
    _parse_absl_flags()
    num, cut = 24 * 4 + 7, 2 * K + 1
    full = _ids(_prefetched_pipeline(num, 0))
    it = iter(_prefetched_pipeline(num, 2))
    head = _ids(next(it) for _ in range(cut))
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    resumed = iter(_prefetched_pipeline(num, 2))  # fresh worker processes
    resumed.set_state(state)
    assert head + _ids(resumed) == full
    resumed.close()


def test_keep_batches_splits_the_window_between_loaders():
    num = 24 * 2
    full = _ids(_stage(_examples(num).to_iter_dataset()))
    loader_a = _ids(_stage(_examples(num).to_iter_dataset(), keep_batches=[0, 2]))
    loader_b = _ids(_stage(_examples(num).to_iter_dataset(), keep_batches=[1]))
    assert loader_a == [full[0], full[2], full[3], full[5]]
    assert loader_b == [full[1], full[4]]


def test_stage_rejects_bad_arguments_and_state():
    parent = _examples(10).to_iter_dataset()
    with pytest.raises(TypeError, match=r"must be a grain.IterDataset, got \w*MapDataset"):
        _stage(_examples(10))
    with pytest.raises(ValueError, match="keep_batches must be distinct ids in"):
        _stage(parent, keep_batches=[0, 0])
    with pytest.raises(ValueError, match="keep_batches must be distinct ids in"):
        _stage(parent, keep_batches=[K])
    with pytest.raises(ValueError, match="minibatch_size must be even"):
        _stage(parent, minibatch_size=3)
    with pytest.raises(ValueError, match="BaseBatchShuffleIterDataset: num_batches must be a positive int, got 0"):
        _stage(parent, num_batches=0)
    it = iter(_stage(parent))
    with pytest.raises(ValueError, match="state lacks"):
        it.set_state({"parent": it.get_state()["parent"]})
    with pytest.raises(ValueError, match="position 4 is outside"):
        it.set_state(dict(it.get_state(), position=K + 1))
