"""Tests of load_dataset: iterators (resume, epochs, eval coverage), baseline table, config, paths."""

import dataclasses
import logging
import os
import signal

import chex
import numpy as np
import pytest

from gem_jax.batch import Pooling, validate_ids
from gem_jax.data.paths import SHARED_DATA_ENV, SOURCE_FOLDERS, default_path, shared_data_dir
from gem_jax.data.pipeline import DataConfig, OnBadRow, Source, SyntheticConfig, load_dataset
from gem_jax.data import sampling
from gem_jax.data.sampling import ShuffledBatchIndices



@pytest.fixture(scope="module")
def ml_small():
    return load_dataset(DataConfig(source=Source.ML_LATEST_SMALL, batch_size=256, max_seq_len=200, seed=3))


def test_ml_small_dataset_summary(ml_small):
    info, spec = ml_small.info, ml_small.spec
    assert (info.num_events, info.num_users, info.num_items) == (100836, 610, 9724)
    assert info.num_train_examples + info.num_eval_examples == 100836
    assert (spec.num_items, spec.num_actions, spec.max_seq_len) == (9743, 11, 200)
    assert [(f.name, f.vocab_size, f.max_values) for f in spec.user_features] == [("user", 611, 1), ("age", 1, 1), ("gender", 1, 1), ("occupation", 1, 1)]
    assert [(f.name, f.vocab_size, f.max_values, f.pooling) for f in spec.item_features] == [("genres", 20, 19, Pooling.MULTI_HOT)]
    assert ml_small.task_names == spec.tasks == info.task_names == ("like", "love")
    assert info.label_names == ("rating >= 4", "rating >= 4.5")
    assert 0.45 < info.train_positive_rate[0] < 0.5 and 0.2 < info.train_positive_rate[1] < 0.23
    assert "like label: rating >= 4 (positive rate train 0.4" in info.summary()
    buckets = ml_small.token_buckets  # every train example's length
    lengths = ml_small.train_batch.examples.history_length
    assert buckets.mean_length == pytest.approx(lengths.mean()) and buckets.std_length == pytest.approx(lengths.std())
    assert (buckets.max_seq_len, buckets.step, buckets.sigmas) == (200, 1.04, 4.0)
    assert "100836 events" in info.summary()


def test_resume_yields_the_same_remaining_batches(ml_small):
    it = ml_small.train_iterator()
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    fresh = load_dataset(DataConfig(source=Source.ML_LATEST_SMALL, batch_size=256, max_seq_len=200, seed=3))
    resumed = fresh.train_iterator()
    resumed.set_state(state)
    for want in expected:
        chex.assert_trees_all_equal(next(resumed), want)


def test_resume_across_an_epoch_boundary(ml_small):
    steps = ml_small.steps_per_epoch
    assert steps == -(-ml_small.info.num_train_examples // 256)
    it = ml_small.train_iterator()
    it.set_state({"next_index": steps - 2})
    state = it.get_state()
    run = [next(it) for _ in range(4)]  # last two of epoch 0, first two of epoch 1
    assert run[1].weights.sum() == ml_small.info.num_train_examples - (steps - 1) * 256, "the last batch is padded"
    assert run[0].weights.sum() == run[2].weights.sum() == 256
    again = ml_small.train_iterator()
    again.set_state(state)
    for want in run:
        chex.assert_trees_all_equal(next(again), want)
    direct = ml_small.train_dataset()
    chex.assert_trees_all_equal(direct[steps], run[2])


def test_one_epoch_sees_every_train_example_once(ml_small):
    batches = list(ml_small.train_iterator(num_epochs=1))
    assert len(batches) == ml_small.steps_per_epoch
    weights = np.concatenate([b.weights for b in batches])
    assert weights.sum() == ml_small.info.num_train_examples
    candidates = np.concatenate([b.candidate_item[b.weights > 0] for b in batches])
    np.testing.assert_array_equal(np.sort(candidates), np.sort(ml_small.train_batch.examples.candidate))
    assert all(b.history.capacity == b.history.offsets[-1] for b in batches)
    assert all(b.candidate_item.shape == (256,) for b in batches)


def test_shuffled_batch_indices_are_epoch_permutations():
    src = ShuffledBatchIndices(1000, 64, seed=5, num_epochs=3)
    assert len(src) == 3 * 16
    epochs = [np.concatenate([src[e * 16 + k] for k in range(16)]) for e in range(3)]
    for order in epochs:
        np.testing.assert_array_equal(np.sort(order), np.arange(1000))
    assert not np.array_equal(epochs[0], epochs[1])
    assert src[15].shape == (1000 - 15 * 64,)
    np.testing.assert_array_equal(ShuffledBatchIndices(1000, 64, seed=5)[17], src[17])
    assert not np.array_equal(ShuffledBatchIndices(1000, 64, seed=6)[0], src[0])
    np.testing.assert_array_equal(ShuffledBatchIndices(10, 4, seed=None)[2], [8, 9])
    with pytest.raises(IndexError):
        src[48]
    with pytest.raises(ValueError, match="num_epochs"):
        ShuffledBatchIndices(10, 4, seed=0, num_epochs=0)


def test_an_epoch_order_is_computed_once_and_shared_read_only():
    first = ShuffledBatchIndices(1000, 64, seed=7)
    first.prefetch(16)  # batch 16 is epoch 1's first
    second = ShuffledBatchIndices(1000, 64, seed=7, num_epochs=4)  # another reader of the same examples
    assert second.epoch_order(1) is first.epoch_order(1)
    np.testing.assert_array_equal(first.epoch_order(1), np.random.default_rng([7, 1]).permutation(1000))
    assert second.epoch_order(0) is not second.epoch_order(1)
    with pytest.raises(ValueError, match="read-only"):
        second[16][0] = 3
    assert sampling.prefetch_epoch_order(1000, 8, 0) is not sampling.prefetch_epoch_order(1000, 7, 0)
    for epoch in range(2, 2 + sampling._KEPT_ORDERS):  # older epochs are dropped, recomputed alike when asked again
        first.epoch_order(epoch)
    assert (1000, 7, 1) not in sampling._ORDERS
    np.testing.assert_array_equal(first.epoch_order(1), second.epoch_order(1))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # the case tested
def test_a_process_forked_while_the_order_lock_is_held_computes_its_own_orders():
    with sampling._ORDERS_LOCK:  # as if another thread were starting an order at the fork
        pid = os.fork()
        if pid == 0:  # the child: a fresh lock and no inherited (never arriving) orders
            signal.alarm(20)
            order = ShuffledBatchIndices(50, 8, seed=3).epoch_order(0)
            os._exit(0 if np.array_equal(order, np.random.default_rng([3, 0]).permutation(50)) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_orders_kept_are_the_last_used():
    for seed in (11, 12):
        sampling.prefetch_epoch_order(100, seed, 0).result()
    sampling.prefetch_epoch_order(100, 11, 0)  # used again: the other one goes first
    sampling.prefetch_epoch_order(100, 13, 0)
    assert (100, 11, 0) in sampling._ORDERS and (100, 12, 0) not in sampling._ORDERS


def test_seed_controls_the_order(ml_small):
    first = next(ml_small.train_iterator())
    chex.assert_trees_all_equal(next(ml_small.train_iterator(seed=3)), first)
    other = next(ml_small.train_iterator(seed=4))
    assert not np.array_equal(other.candidate_item, first.candidate_item)


def test_eval_batches_cover_each_eval_example_once_in_order(ml_small):
    batches = list(ml_small.eval_batches())
    assert len(batches) == ml_small.num_eval_batches
    weights = np.concatenate([b.weights for b in batches])
    assert weights.sum() == ml_small.info.num_eval_examples
    assert np.all(weights[: ml_small.info.num_eval_examples] == 1) and np.all(weights[ml_small.info.num_eval_examples :] == 0)
    candidates = np.concatenate([b.candidate_item for b in batches])[weights > 0]
    np.testing.assert_array_equal(candidates, ml_small.eval_batch.examples.candidate)
    for b in batches:
        validate_ids(b, ml_small.spec)
    chex.assert_trees_all_equal(next(ml_small.eval_batches()), batches[0])


def test_empty_histories_reach_the_batch(ml_small):
    ex = ml_small.train_batch.examples
    empty = np.flatnonzero(ex.history_length == 0)
    assert empty.size == ml_small.info.num_users, "each user's first event is an example with no history"
    batch = ml_small.train_batch(empty[:5].tolist())
    assert np.all(np.diff(batch.history.offsets) == 0) and batch.history.capacity == 0
    np.testing.assert_array_equal(batch.weights[:5], 1.0)


def test_item_mean_label_is_the_train_mean_per_item(ml_small):
    ex = ml_small.train_batch.examples
    for task in range(len(ml_small.task_names)):
        table = ml_small.item_mean_label(task)
        assert table.shape == (ml_small.spec.num_items,) and table.dtype == np.float32
        for item in np.random.default_rng().choice(np.unique(ex.candidate), size=20, replace=False):
            np.testing.assert_allclose(table[item], ex.labels[ex.candidate == item, task].mean(), rtol=1e-6)
        unseen = np.setdiff1d(np.arange(ml_small.spec.num_items), ex.candidate)
        np.testing.assert_allclose(table[unseen], ex.labels[:, task].mean(), rtol=1e-6)


def test_skip_mode_reports_counts(tmp_path, caplog):
    (tmp_path / "movies.csv").write_text("movieId,title,genres\n1,A (1990),Drama\n2,B (1991),Comedy\n")
    rows = [f"{u},{1 + (t % 2)},{1 + t % 5}.0,{t}" for u in (1, 2) for t in range(6)] + ["1,3,4.0,99", "2,x,4.0,1"]
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows) + "\n")
    with pytest.raises(ValueError, match="line 14"):
        load_dataset(DataConfig(path=str(tmp_path), batch_size=4, max_seq_len=8))
    with caplog.at_level(logging.WARNING):
        ds = load_dataset(DataConfig(path=str(tmp_path), batch_size=4, max_seq_len=8, on_bad_row=OnBadRow.SKIP))
    assert ds.info.num_events == 12 and len(ds.info.skipped) == 2
    assert "skipped 1 row(s), unknown id (first at line 14)" in caplog.text
    assert "skipped 1 row(s), not a number (first at line 15)" in ds.info.summary()
    assert ds.info.num_eval_examples == 2  # floor(0.1 * 6) < 1, so one per user
    batch = next(ds.train_iterator())
    assert batch.history.capacity == batch.history.offsets[-1] and batch.candidate_item.shape == (4,)


@pytest.mark.parametrize("source", [Source.ML_100K, Source.AMAZON_BEAUTY])
def test_other_sources_build_valid_batches(source):
    folder = shared_data_dir() / SOURCE_FOLDERS[source]
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent (set {SHARED_DATA_ENV})")
    ds = load_dataset(DataConfig(source=source, batch_size=64, max_seq_len=50))
    batch = next(ds.train_iterator())
    validate_ids(batch, ds.spec)
    (feature,) = ds.spec.item_features
    assert batch.candidate_features[feature.name].shape == (64, feature.max_values)
    assert batch.history.capacity == batch.history.offsets[-1]
    eval_batch = next(ds.eval_batches())
    assert eval_batch.weights.sum() == 64
    if source is Source.ML_100K:
        assert [(f.name, f.vocab_size) for f in ds.spec.user_features[1:]] == [("age", 8), ("gender", 3), ("occupation", 22)]
        assert all(np.all(batch.user[name] > 0) for name in ("age", "gender", "occupation"))
        assert ds.task_names == ("like", "love")
    else:
        rates = ds.info.train_positive_rate
        assert ds.task_names == ("next_item", "in_next_5")
        assert 0.45 < rates[0] < 0.55 and rates[1] > rates[0] + 0.1


def test_synthetic_dataset_resume_across_epochs():
    config = DataConfig(
        source=Source.SYNTHETIC,
        batch_size=16,
        max_seq_len=32,
        synthetic=SyntheticConfig(num_items=500, num_users=50, num_train_examples=50, num_eval_examples=20),
    )
    ds = load_dataset(config)
    assert ds.steps_per_epoch == 4 and ds.num_eval_batches == 2
    it = ds.train_iterator()
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(6)]
    assert expected[0].weights.sum() == 2  # 50 = 3 * 16 + 2
    resumed = load_dataset(config).train_iterator()
    resumed.set_state(state)
    for want in expected:
        chex.assert_trees_all_equal(next(resumed), want)
    assert sum(b.weights.sum() for b in ds.eval_batches()) == 20


def test_data_config_validation():
    with pytest.raises(ValueError, match="eval_fraction"):
        DataConfig(eval_fraction=0.0)
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="DataConfig.path is empty: name the data's folder"):
            DataConfig(path=empty)
    with pytest.raises(TypeError, match="OnBadRow"):
        DataConfig(on_bad_row="skip")
    with pytest.raises(TypeError, match="Source"):
        DataConfig(source="ml_100k")
    with pytest.raises(ValueError, match=r"DataConfig.capacity_step must be in \(1, 2\], got 1.0"):
        DataConfig(capacity_step=1.0)
    with pytest.raises(ValueError, match="DataConfig.capacity_sigmas must be finite and > 0, got 0"):
        DataConfig(capacity_sigmas=0)
    with pytest.raises(ValueError, match="batch_size"):
        DataConfig(batch_size=0)
    with pytest.raises(ValueError, match="num_items"):
        SyntheticConfig(num_items=1)
    assert dataclasses.replace(DataConfig(), seed=5).seed == 5


def test_default_paths(monkeypatch, tmp_path):
    assert default_path(Source.ML_LATEST_SMALL).joinpath("ratings.csv").is_file()
    monkeypatch.setenv(SHARED_DATA_ENV, str(tmp_path))
    assert default_path(Source.ML_100K) == tmp_path / "ml-100k"
    assert default_path(Source.AMAZON_BEAUTY) == tmp_path / "amazon-beauty-s3rec"
    with pytest.raises(FileNotFoundError):
        load_dataset(DataConfig(source=Source.ML_100K))
    with pytest.raises(ValueError, match="has no files"):
        default_path(Source.SYNTHETIC)
