"""random_batch: in-vocabulary ids, the padding id for a vocabulary of the padding id alone."""

import numpy as np
import pytest

from gem_jax.batch import PAD_ID, CategoricalFeature, FeatureSpec, HistoryField, random_batch, validate_ids

SPEC = FeatureSpec(
    num_items=50,
    num_actions=11,
    num_time_buckets=8,
    tasks=("like", "love"),
    user_features=(CategoricalFeature("user", 10), CategoricalFeature("age", 1), CategoricalFeature("langs", 1, 3)),
    item_features=(CategoricalFeature("tags", 6, 4),),
    max_seq_len=4,
)


def test_padding_only_vocabularies_give_the_padding_id():
    lengths = np.array([3, 0, 4])
    batch = random_batch(SPEC, np.random.default_rng(0), lengths, capacity=8)
    user = {k: np.asarray(v) for k, v in batch.user.items()}
    assert {k: (v.shape, v.dtype) for k, v in user.items()} == {
        "user": ((3, 1), np.int32), "age": ((3, 1), np.int32), "langs": ((3, 3), np.int32)
    }
    np.testing.assert_array_equal(user["age"], PAD_ID)
    np.testing.assert_array_equal(user["langs"], PAD_ID)
    assert ((user["user"] >= 1) & (user["user"] < 10)).all()
    tags = np.asarray(batch.candidate_features["tags"])
    assert tags.shape == (3, 4) and ((tags >= 0) & (tags < 6)).all()
    history = np.asarray(batch.history.values)[: lengths.sum()]
    for field, size in zip(HistoryField, (SPEC.num_items, SPEC.num_actions, SPEC.num_time_buckets)):
        assert ((history[:, field] >= 1) & (history[:, field] < size)).all()
    assert batch.labels.shape == (3, 2)
    validate_ids(batch, SPEC)


def test_an_empty_vocabulary_is_refused_by_name():
    with pytest.raises(ValueError, match="feature 'gender': vocab_size must be an int >= 1, got 0"):
        CategoricalFeature("gender", 0)
    with pytest.raises(ValueError, match="FeatureSpec.num_actions must be an int >= 1, got 0"):
        FeatureSpec(num_items=5, num_actions=0, num_time_buckets=2, tasks=("t",))
