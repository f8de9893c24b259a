"""Tests of the per-user time split, the example index arrays, features and batch building."""

import dataclasses

import numpy as np
import pytest

from gem_jax.batch import PAD_ID, CategoricalFeature, HistoryField, validate_ids
from gem_jax.data.collate import BatchBuilder, log_spec
from gem_jax.jagged import pick_capacity
from gem_jax.data.events import DEMOGRAPHICS, FeatureTable, build_event_log
from gem_jax.data.examples import Examples, next_item_examples, rating_examples
from gem_jax.data.features import half_star_action, time_bucket
from gem_jax.data.sources.movielens_small import read_ml_latest_small
from gem_jax.data.paths import default_path
from gem_jax.data.config import Source
from gem_jax.data.split import split_by_time
from gem_jax.jagged import JaggedError
from gem_jax.jagged import validate as validate_jagged


def random_log(rng, num_users=30, num_items=50, max_events=40, implicit=False):
    """A random event log: some users with 1 event, timestamps with ties, ratings in half stars."""
    counts = rng.integers(1, max_events + 1, size=num_users)
    counts[:3] = 1
    raw_user = np.repeat(np.arange(num_users) * 3 + 7, counts)  # sparse publisher ids
    n = raw_user.shape[0]
    raw_item = rng.integers(0, num_items, size=n) * 2 + 100
    rating = rng.integers(1, 11, size=n) / 2.0
    timestamp = rng.integers(0, 10_000, size=n) // 100 * 100  # many ties
    item_vocab = np.arange(num_items) * 2 + 100
    genres = (rng.random((num_items, 4)) < 0.3).astype(np.uint8)
    user_features = tuple(
        FeatureTable(CategoricalFeature(name, size), rng.integers(1, size, (num_users, 1)))
        for name, size in zip(DEMOGRAPHICS, (8, 3, 22))
    )
    return build_event_log(
        name="random",
        raw_user=raw_user,
        raw_item=raw_item,
        action=np.ones(n, np.int32) if implicit else half_star_action(rating),
        rating=np.full(n, np.nan) if implicit else rating,
        timestamp=timestamp,
        line=rng.permutation(n) + 2,
        user_vocab=np.arange(num_users) * 3 + 7,
        item_vocab=item_vocab,
        user_features=user_features,
        item_features=(FeatureTable.from_multi_hot("genres", genres, ("a", "b", "c", "d")),),
        num_actions=2 if implicit else 11,
    )


def spec_of(log, max_seq_len, num_time_buckets=16):
    return log_spec(log, ("like", "love"), num_time_buckets=num_time_buckets, max_seq_len=max_seq_len)


# ---------------------------------------------------------------- features


def test_feature_tables_from_multi_hot_rows():
    table = FeatureTable.from_multi_hot("genres", np.array([[0, 1, 1], [0, 0, 0], [1, 1, 1]]), ("a", "b", "c"))
    assert (table.feature.vocab_size, table.feature.max_values) == (4, 3)
    np.testing.assert_array_equal(table.ids, [[2, 3, 0], [0, 0, 0], [1, 2, 3]])
    np.testing.assert_array_equal(table.with_pad_row().ids[0], [0, 0, 0])
    with pytest.raises(ValueError, match=r"feature 'genres': ids outside \[0, 4\)"):
        FeatureTable(table.feature, np.array([[4, 0, 0]]))
    with pytest.raises(ValueError, match=r"feature 'genres': ids have shape \(1, 2\), expected \[rows, 3\]"):
        FeatureTable(table.feature, np.array([[1, 0]]))


def test_time_bucket_values():
    age = np.array([0, 1, 2, 3, 4, 7, 8, 2**20, 2**40])
    np.testing.assert_array_equal(time_bucket(age, 32), [1, 2, 2, 3, 3, 4, 4, 21, 31])
    np.testing.assert_array_equal(time_bucket(age, 4), [1, 2, 2, 3, 3, 3, 3, 3, 3])
    rng = np.random.default_rng()
    age = rng.integers(0, 2**31, size=1000)
    expected = 1 + np.minimum(np.floor(np.log2(age.astype(np.float64) + 1)), 30)
    np.testing.assert_array_equal(time_bucket(age, 32), expected)
    with pytest.raises(ValueError, match="negative event age -1"):
        time_bucket(np.array([3, -1]), 32)
    with pytest.raises(ValueError, match="num_time_buckets must be >= 2"):
        time_bucket(age, 1)


def test_half_star_action():
    np.testing.assert_array_equal(half_star_action(np.array([0.5, 1.0, 4.5, 5.0])), [1, 2, 9, 10])
    with pytest.raises(ValueError, match="rating 4.2 at index 1"):
        half_star_action(np.array([1.0, 4.2]))


# ---------------------------------------------------------------- split


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_split_holds_out_each_users_latest_events(fraction):
    rng = np.random.default_rng()
    log = random_log(rng)
    split = split_by_time(log, fraction)
    train, evals = set(split.train_targets.tolist()), set(split.eval_targets.tolist())
    assert not train & evals, "an eval target is also a train target"
    assert train | evals == set(range(log.num_events))
    for u in range(1, log.num_users):
        lo, hi = log.user_offsets[u], log.user_offsets[u + 1]
        n = hi - lo
        expected = 0 if n < 2 else max(1, int(np.floor(fraction * n)))
        user_eval = [e for e in range(lo, hi) if e in evals]
        assert user_eval == list(range(hi - expected, hi))
        if user_eval and hi - expected > lo:
            assert log.timestamp[hi - expected - 1] <= log.timestamp[hi - expected]
        assert split.eval_start[u] == hi - expected


def test_split_rejects_bad_fraction():
    log = random_log(np.random.default_rng())
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="eval_fraction"):
            split_by_time(log, bad)


@pytest.fixture(scope="module")
def ml_small_log():
    return read_ml_latest_small(default_path(Source.ML_LATEST_SMALL))


def test_split_ml_small_no_leakage(ml_small_log):
    log = ml_small_log
    split = split_by_time(log, 0.1)
    assert np.intersect1d(split.train_targets, split.eval_targets).size == 0
    assert split.train_targets.size + split.eval_targets.size == log.num_events
    counts = np.diff(log.user_offsets)[1:]
    assert split.eval_targets.size == np.maximum(1, np.floor(0.1 * counts)).sum()
    # Within each user, every eval target comes at or after every train target in time.
    last_train = np.full(log.num_users, -1, np.int64)
    np.maximum.at(last_train, log.user[split.train_targets], log.timestamp[split.train_targets])
    assert np.all(log.timestamp[split.eval_targets] >= last_train[log.user[split.eval_targets]])


# ---------------------------------------------------------------- examples


def test_rating_examples_histories_and_labels():
    rng = np.random.default_rng()
    log = random_log(rng)
    split = split_by_time(log, 0.2)
    max_len = 7
    ex = rating_examples(log, split.train_targets, max_seq_len=max_len, thresholds=(4.0, 4.5))
    assert len(ex) == split.train_targets.size
    for k, t in enumerate(ex.target_event):
        start = log.user_offsets[log.user[t]]
        assert ex.history_length[k] == min(max_len, t - start)
        assert ex.candidate[k] == log.item[t]
        assert tuple(ex.labels[k]) == (float(log.rating[t] >= 4.0), float(log.rating[t] >= 4.5))
    first_events = log.user_offsets[1:-1][np.diff(log.user_offsets)[1:] > 0]
    assert set(first_events.tolist()) <= set(ex.target_event.tolist())
    assert np.all(ex.history_length[np.isin(ex.target_event, first_events)] == 0), "first events keep an empty history"


def test_rating_examples_need_ratings():
    log = random_log(np.random.default_rng(), implicit=True)
    with pytest.raises(ValueError, match="need ratings"):
        rating_examples(log, np.arange(3), max_seq_len=4, thresholds=(4.0, 4.5))


def test_next_item_examples_labels_follow_definition():
    rng = np.random.default_rng()
    log = random_log(rng, num_users=60, max_events=30, implicit=True)
    split = split_by_time(log, 0.2)
    for targets in (split.train_targets, split.eval_targets):
        ex = next_item_examples(log, split, targets, max_seq_len=10, seed=123, window=5)
        again = next_item_examples(log, split, targets, max_seq_len=10, seed=123, window=5)
        np.testing.assert_array_equal(ex.candidate, again.candidate)
        horizon = split.horizon(log.user[targets], targets)
        for k, t in enumerate(targets):
            window = log.item[t : min(t + 5, horizon[k])]
            assert ex.labels[k, 0] == float(ex.candidate[k] == log.item[t])
            assert ex.labels[k, 1] == float(ex.candidate[k] in window)
        # No training label is defined by a held-out event: the train window stops at eval_start.
        if targets is split.train_targets:
            assert np.all(horizon <= split.eval_start[log.user[targets]])
    ex = next_item_examples(log, split, split.train_targets, max_seq_len=10, seed=123)
    primary, secondary = ex.labels[:, 0], ex.labels[:, 1]
    assert 0.4 < primary.mean() < 0.6
    assert np.all(secondary >= primary)
    assert secondary.mean() > primary.mean() + 0.1, "near-future negatives make SECONDARY differ from PRIMARY"
    other = next_item_examples(log, split, split.train_targets, max_seq_len=10, seed=124)
    assert not np.array_equal(other.candidate, ex.candidate)


# ---------------------------------------------------------------- batches


def test_pick_capacity():
    assert pick_capacity(0, (128, 256)) == 128 and pick_capacity(129, (128, 256)) == 256
    with pytest.raises(JaggedError, match="capacity exceeded: 300"):
        pick_capacity(300, (128, 256))


def _reference_example(log, ex, k, num_time_buckets):
    t, h = ex.target_event[k], ex.history_length[k]
    rows = np.arange(t - h, t)
    age = log.timestamp[t] - log.timestamp[rows]
    hist = np.stack([log.item[rows], log.action[rows], time_bucket(age, num_time_buckets)], axis=1)
    u = log.user[t]
    return hist, {"user": [u], **{t.feature.name: t.ids[u] for t in log.user_features}}


@pytest.mark.parametrize("batch_size,max_len,n", [(8, 5, 8), (16, 12, 11), (4, 40, 1), (4, 6, 0)])
@pytest.mark.parametrize("per_call", [False, True])
def test_batch_builder_matches_reference(batch_size, max_len, n, per_call):
    rng = np.random.default_rng()
    log = random_log(rng)
    split = split_by_time(log, 0.2)
    ex = rating_examples(log, split.train_targets, max_seq_len=max_len, thresholds=(4.0, 4.5))
    spec = spec_of(log, max_len)
    idx = rng.choice(len(ex), size=n, replace=False)
    if per_call:  # a process's share of a global batch: the size is given per call
        batch = BatchBuilder(log, ex, spec, 3 * batch_size)(idx.tolist(), batch_size=batch_size)
    else:
        batch = BatchBuilder(log, ex, spec, batch_size)(idx.tolist())

    offsets = np.asarray(batch.history.offsets)
    values = np.asarray(batch.history.values)
    total = int(ex.history_length[idx].sum())
    assert values.shape == (total, 3) and values.dtype == np.int32  # the real rows, no slack
    assert offsets.shape == (batch_size + 1,) and offsets.dtype == np.int32
    assert {k: v.shape for k, v in batch.user.items()} == {name: (batch_size, 1) for name in ("user", *DEMOGRAPHICS)}
    assert batch.candidate_features["genres"].shape == (batch_size, 4)
    assert batch.labels.shape == (batch_size, 2) and batch.weights.dtype == np.float32
    validate_jagged(batch.history)
    validate_ids(batch, spec)
    for slot, k in enumerate(idx):
        hist, user = _reference_example(log, ex, k, spec.num_time_buckets)
        np.testing.assert_array_equal(values[offsets[slot] : offsets[slot + 1]], hist)
        for name, ids in user.items():
            np.testing.assert_array_equal(batch.user[name][slot], ids)
        assert batch.candidate_item[slot] == ex.candidate[k]
        np.testing.assert_array_equal(batch.candidate_features["genres"][slot], log.item_features[0].ids[ex.candidate[k]])
        np.testing.assert_array_equal(batch.labels[slot], ex.labels[k])
    # Padding examples: weight 0, empty history, PAD_ID features, zero labels.
    np.testing.assert_array_equal(batch.weights, [1.0] * n + [0.0] * (batch_size - n))
    assert np.all(offsets[n:] == total)
    assert all(np.all(ids[n:] == PAD_ID) for ids in batch.user.values()) and np.all(batch.candidate_item[n:] == PAD_ID)
    assert np.all(batch.labels[n:] == 0) and np.all(batch.candidate_features["genres"][n:] == PAD_ID)
    # Time buckets never grow toward the target inside one history.
    for slot in range(n):
        tb = values[offsets[slot] : offsets[slot + 1], HistoryField.TIME_BUCKET]
        assert np.all(np.diff(tb) <= 0)
    assert np.all(batch.user["user"][:n] >= 1)


def test_batch_builder_rejects_bad_calls():
    rng = np.random.default_rng()
    log = random_log(rng)
    ex = rating_examples(log, np.arange(log.num_events), max_seq_len=4, thresholds=(4.0, 4.5))
    build = BatchBuilder(log, ex, spec_of(log, 4), 4)
    with pytest.raises(ValueError, match="at most 4 examples, got 5"):
        build([0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="at most 2 examples, got 3"):
        build([0, 1, 2], batch_size=2)
    with pytest.raises(ValueError, match="out of range"):
        build([len(ex)])
    with pytest.raises(JaggedError, match="longer than max_seq_len 3"):
        BatchBuilder(log, ex, spec_of(log, 3), 4)


def test_batch_ids_are_validated():
    rng = np.random.default_rng()
    log = random_log(rng)
    ex = rating_examples(log, np.arange(log.num_events), max_seq_len=4, thresholds=(4.0, 4.5))
    small = dataclasses.replace(spec_of(log, 4), num_items=2)
    bad = Examples(ex.target_event, ex.history_length, np.full(len(ex), 1, np.int32), ex.labels)
    with pytest.raises(ValueError, match="history item id .* outside the vocabulary"):
        BatchBuilder(log, bad, small, 4)(np.flatnonzero(ex.history_length > 0)[:4])
