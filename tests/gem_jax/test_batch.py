"""random_batch: in-vocabulary ids, the padding id for a vocabulary of the padding id alone."""

import dataclasses

import numpy as np
import pytest

from gem_jax.batch import PAD_ID, FeatureSpec, HistoryField, UserField, random_batch, validate_ids

SPEC = FeatureSpec(num_items=50, num_users=10, num_actions=11, num_time_buckets=8, num_genres=5, max_seq_len=4)


def test_padding_only_vocabularies_give_the_padding_id():
    # FeatureSpec's defaults: num_ages = num_genders = num_occupations = 1 (the padding id alone)
    lengths = np.array([3, 0, 4])
    batch = random_batch(SPEC, np.random.default_rng(0), lengths, capacity=8)
    user = np.asarray(batch.user)
    assert user.shape == (3, 4) and user.dtype == np.int32
    for field in (UserField.AGE, UserField.GENDER, UserField.OCCUPATION):
        np.testing.assert_array_equal(user[:, field], [PAD_ID] * 3)
    assert ((user[:, UserField.USER] >= 1) & (user[:, UserField.USER] < SPEC.num_users)).all()
    history = np.asarray(batch.history.values)[: lengths.sum()]
    for field, size in zip(HistoryField, (SPEC.num_items, SPEC.num_actions, SPEC.num_time_buckets)):
        assert ((history[:, field] >= 1) & (history[:, field] < size)).all()
    validate_ids(batch, SPEC)


def test_an_empty_vocabulary_is_refused_by_name():
    with pytest.raises(ValueError, match="user gender vocabulary has size 0"):
        random_batch(dataclasses.replace(SPEC, num_genders=0), np.random.default_rng(0), np.array([1]), capacity=1)
