"""Tests of the synthetic source: shapes at several scales, determinism, length distribution, labels."""

import math

import numpy as np
import pytest

from gem_jax.batch import PAD_ID, HistoryField, validate_ids
from gem_jax.data.config import DataConfig, Source, SyntheticConfig
from gem_jax.data.sources.synthetic import (
    EVAL_STREAM,
    TRAIN_STREAM,
    SyntheticBatchBuilder,
    synthetic_item_mean_labels,
    synthetic_lengths,
    synthetic_spec,
)
from gem_jax.jagged import validate as validate_jagged


def make_builder(batch_size, max_seq_len, seed=0, stream=TRAIN_STREAM, **kwargs):
    config = SyntheticConfig(**kwargs)
    spec = synthetic_spec(config, max_seq_len, 32)
    return SyntheticBatchBuilder(config, spec, batch_size, seed, stream), spec


@pytest.mark.parametrize("batch_size,max_seq_len,n", [(4, 16, 4), (64, 512, 64), (33, 100, 7), (256, 2048, 256)])
def test_shapes_and_validity(batch_size, max_seq_len, n):
    build, spec = make_builder(batch_size, max_seq_len)
    batch = build(np.arange(100, 100 + n))
    offsets = np.asarray(batch.history.offsets)
    assert offsets.shape == (batch_size + 1,) and batch.history.values.shape[1] == 3
    assert batch.history.capacity == offsets[-1], "no slack rows: capacities are chosen when the batch is placed"
    assert {k: v.shape for k, v in batch.user.items()} == {k: (batch_size, 1) for k in ("user", "age", "gender", "occupation")}
    assert batch.candidate_features["genres"].shape == (batch_size, spec.item_features[0].max_values)
    assert spec.tasks == ("click", "convert")
    assert batch.labels.shape == (batch_size, 2)
    np.testing.assert_array_equal(batch.weights, [1.0] * n + [0.0] * (batch_size - n))
    validate_jagged(batch.history)
    validate_ids(batch, spec)
    genres = batch.candidate_features["genres"]
    assert np.all(genres[n:] == PAD_ID) and np.all(np.diff(np.where(genres == PAD_ID, 1 << 20, genres), axis=1) >= 0)  # ids, then PAD
    values = np.asarray(batch.history.values)
    for b in range(n):
        tb = values[offsets[b] : offsets[b + 1], HistoryField.TIME_BUCKET]
        assert np.all(np.diff(tb) <= 0) and (tb.size == 0 or tb[-1] == 1)


def test_examples_are_pure_functions_of_their_index():
    build, _ = make_builder(8, 64, seed=11)
    a = build([5, 6, 7])
    b = build([9, 5])
    la = np.diff(a.history.offsets)
    lb = np.diff(b.history.offsets)
    assert la[0] == lb[1]
    np.testing.assert_array_equal(
        a.history.values[a.history.offsets[0] : a.history.offsets[1]], b.history.values[b.history.offsets[1] : b.history.offsets[2]]
    )
    assert a.candidate_item[0] == b.candidate_item[1] and all(np.array_equal(a.user[k][0], b.user[k][1]) for k in a.user)
    np.testing.assert_array_equal(build([5, 6, 7]).history.values, a.history.values)
    other_stream, _ = make_builder(8, 64, seed=11, stream=EVAL_STREAM)
    other_seed, _ = make_builder(8, 64, seed=12)
    assert not np.array_equal(other_stream([5, 6, 7]).candidate_item[:3], a.candidate_item[:3])
    assert not np.array_equal(other_seed([5, 6, 7]).candidate_item[:3], a.candidate_item[:3])


def test_lengths_are_clipped_lognormal():
    config = SyntheticConfig(median_length_fraction=0.1, length_sigma=1.0)
    max_len = 1000
    lengths = synthetic_lengths(7, TRAIN_STREAM, np.arange(40_000), config, max_len)
    assert lengths.min() >= 0 and lengths.max() == max_len
    assert abs(np.median(lengths) - 100) <= 4
    # P(length == max) = P(Z >= ln(10)) for a median at a tenth of the maximum.
    tail = 0.5 * math.erfc(math.log(10) / math.sqrt(2))
    assert abs(np.mean(lengths == max_len) - tail) < 0.003
    inner = lengths[(lengths > 5) & (lengths < max_len)]
    assert abs(np.std(np.log(inner + 0.5)) - 1.0) < 0.08
    assert np.max(lengths) / np.median(lengths) >= 9, "long tail"
    flat = synthetic_lengths(7, TRAIN_STREAM, np.arange(100), SyntheticConfig(length_sigma=0.0), 200)
    np.testing.assert_array_equal(flat, 20)


def test_labels_follow_the_item_table():
    build, spec = make_builder(512, 8, seed=3, num_items=20, median_length_fraction=0.5)
    table = synthetic_item_mean_labels(3, spec.num_items)
    assert table.shape == (20, 2) and np.all(table[0] == 0)
    np.testing.assert_allclose(table[1:, 1], 0.5 * table[1:, 0])
    batches = [build(np.arange(k * 512, (k + 1) * 512)) for k in range(40)]
    cand = np.concatenate([b.candidate_item for b in batches])
    labels = np.concatenate([b.labels for b in batches])
    assert np.all(labels[:, 1] <= labels[:, 0])
    for item in range(1, 20):
        mask = cand == item
        assert mask.sum() > 500
        np.testing.assert_allclose(labels[mask, 0].mean(), table[item, 0], atol=0.06)


def test_history_item_features_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="Source.SYNTHETIC draws each example's features at random"):
        DataConfig(source=Source.SYNTHETIC, history_item_features=True)
