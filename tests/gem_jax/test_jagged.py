"""Tests of gem_jax.jagged: construction, validation errors, padded round trips, slack isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax import jagged
from gem_jax.jagged import Jagged, JaggedError, from_lengths, offsets_from_lengths
from pallas_kernels import jagged_layout


def _random_case(rng, batch, max_len, capacity_slack, feature_shape=(3,)):
    lengths = rng.integers(0, max_len + 1, size=batch)
    lengths[-1] = 0  # always an empty sequence
    if batch > 1:
        lengths[0] = max_len  # and a full one
    total = int(lengths.sum())
    values = rng.standard_normal((total + capacity_slack,) + feature_shape).astype(np.float32)
    return lengths, values, total


def _padded_reference(values, lengths, max_len, fill):
    out = np.full((lengths.shape[0], max_len) + values.shape[1:], fill, values.dtype)
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = values[start : start + n]
        start += n
    return out


def test_offsets_from_lengths_values_and_dtype():
    offsets = offsets_from_lengths([3, 0, 2, 5])
    np.testing.assert_array_equal(offsets, [0, 3, 3, 5, 10])
    assert offsets.dtype == np.int32
    np.testing.assert_array_equal(offsets_from_lengths(np.zeros(0, int)), [0])


def test_negative_length_is_named():
    with pytest.raises(JaggedError, match=r"negative sequence length -2 at index 1"):
        offsets_from_lengths([3, -2, 1])
    with pytest.raises(JaggedError, match="negative"):
        from_lengths(np.zeros((4, 2)), [3, -2, 1], max_seq_len=8)


def test_lengths_must_be_1d():
    with pytest.raises(JaggedError, match="1-D"):
        offsets_from_lengths(np.zeros((2, 2), int))


def test_non_monotone_offsets_are_named():
    bad = Jagged(jnp.zeros((8, 2)), jnp.array([0, 3, 2, 5], jnp.int32), 8)
    with pytest.raises(JaggedError, match=r"not monotone: offsets\[2\]=2 < offsets\[1\]=3"):
        jagged.validate(bad)


def test_offsets_must_start_at_zero():
    with pytest.raises(JaggedError, match=r"offsets\[0\] must be 0, got 1"):
        jagged.validate(Jagged(jnp.zeros((8, 2)), jnp.array([1, 3, 5], jnp.int32), 8))


def test_capacity_exceeded():
    with pytest.raises(JaggedError, match=r"capacity exceeded: 10 rows do not fit in capacity 8"):
        from_lengths(np.zeros((10, 2)), [5, 5], max_seq_len=8, capacity=8)
    with pytest.raises(JaggedError, match=r"capacity exceeded: offsets\[B\]=9 > capacity 8"):
        jagged.validate(Jagged(jnp.zeros((8, 2)), jnp.array([0, 4, 9], jnp.int32), 8))


def test_length_above_max_seq_len():
    with pytest.raises(JaggedError, match=r"sequence 1 has length 5 > max_seq_len 4"):
        from_lengths(np.zeros((7, 2)), [2, 5], max_seq_len=4)


def test_too_few_values_for_lengths():
    with pytest.raises(JaggedError, match=r"values has 4 rows but the lengths sum to 6"):
        from_lengths(np.zeros((4, 2)), [3, 3], max_seq_len=4)


def test_from_lengths_pads_to_capacity_and_trims_extra_rows():
    rng = np.random.default_rng()
    values = rng.standard_normal((5, 2)).astype(np.float32)
    j = from_lengths(values, [2, 3], max_seq_len=4, capacity=16)
    assert j.capacity == 16 and j.batch_size == 2
    np.testing.assert_array_equal(np.asarray(j.values[:5]), values)
    np.testing.assert_array_equal(np.asarray(j.values[5:]), 0)
    extra = rng.standard_normal((20, 2)).astype(np.float32)
    j = from_lengths(extra, [2, 3], max_seq_len=4, capacity=8)
    np.testing.assert_array_equal(np.asarray(j.values), extra[:8])


def test_index_helpers_match_numpy():
    rng = np.random.default_rng()
    lengths, values, total = _random_case(rng, batch=7, max_len=9, capacity_slack=5)
    j = from_lengths(values, lengths, max_seq_len=9)
    offsets = offsets_from_lengths(lengths)
    seg = np.concatenate([np.full(n, b) for b, n in enumerate(lengths)] + [np.full(j.capacity - total, 7)])
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(j.capacity - total, int)])
    np.testing.assert_array_equal(np.asarray(j.lengths()), lengths)
    np.testing.assert_array_equal(np.asarray(j.segment_ids()), seg)
    np.testing.assert_array_equal(np.asarray(j.positions()), pos)
    np.testing.assert_array_equal(np.asarray(j.valid_mask()), np.arange(j.capacity) < offsets[-1])


@pytest.mark.parametrize("batch,max_len,slack", [(1, 1, 1), (2, 1, 0), (5, 7, 3), (8, 33, 17)])
def test_padded_round_trip(batch, max_len, slack):
    rng = np.random.default_rng()
    lengths, values, total = _random_case(rng, batch, max_len, slack, feature_shape=(2, 3))
    j = from_lengths(values, lengths, max_seq_len=max_len)
    padded = np.asarray(jax.jit(lambda x: x.to_padded(fill_value=-7.0))(j))
    np.testing.assert_array_equal(padded, _padded_reference(values, lengths, max_len, -7.0))
    back = np.asarray(jagged.from_padded(jnp.asarray(padded), j.offsets, j.capacity, fill_value=0.0))
    np.testing.assert_array_equal(back[:total], values[:total])
    np.testing.assert_array_equal(back[total:], 0.0)


def test_all_empty_sequences():
    j = from_lengths(np.zeros((4, 3), np.float32), [0, 0, 0], max_seq_len=2)
    np.testing.assert_array_equal(np.asarray(j.to_padded(fill_value=1.0)), np.ones((3, 2, 3)))
    assert not np.asarray(j.valid_mask()).any()


def test_nan_in_slack_stays_out_of_values_and_gradients():
    rng = np.random.default_rng()
    lengths, values, total = _random_case(rng, batch=6, max_len=8, capacity_slack=9)
    values[total:] = np.nan
    j = Jagged(jnp.asarray(values), jnp.asarray(offsets_from_lengths(lengths)), 8)
    jagged.validate(j)
    padded = np.asarray(j.to_padded())
    assert np.isfinite(padded).all()
    np.testing.assert_array_equal(padded, _padded_reference(np.nan_to_num(values), lengths, 8, 0.0))

    weights = rng.standard_normal(padded.shape).astype(np.float32)
    grad = np.asarray(jax.grad(lambda v: jnp.sum(j.replace_values(v).to_padded() * weights))(j.values))
    assert np.isfinite(grad).all()
    np.testing.assert_array_equal(grad[total:], 0.0)
    expected = np.concatenate([weights[b, :n] for b, n in enumerate(lengths)])
    np.testing.assert_allclose(grad[:total], expected)


def test_nan_in_padding_stays_out_of_from_padded():
    rng = np.random.default_rng()
    lengths, values, total = _random_case(rng, batch=4, max_len=6, capacity_slack=4)
    offsets = jnp.asarray(offsets_from_lengths(lengths))
    padded = _padded_reference(values, lengths, 6, np.nan)
    back = np.asarray(jagged.from_padded(jnp.asarray(padded), offsets, values.shape[0], fill_value=0.0))
    np.testing.assert_array_equal(back[:total], values[:total])
    np.testing.assert_array_equal(back[total:], 0.0)


def test_zero_capacity_pads_every_sequence():
    from gem_jax.jagged import to_padded

    offsets = jnp.zeros((4,), jnp.int32)
    padded = to_padded(jnp.zeros((0, 2), jnp.float32), offsets, 5, fill_value=-1.0)
    assert padded.shape == (3, 5, 2) and float(padded.max()) == -1.0


@pytest.mark.parametrize("low, n", [(0, 50), (-70, 50), (0, 0)])
def test_counts_at_or_below_matches_searchsorted(low, n):
    values = np.sort(np.random.default_rng(3).integers(low, 60, 40))  # repeats, some past n, some negative
    got = jagged_layout.counts_at_or_below(jnp.asarray(values, jnp.int32), n)
    np.testing.assert_array_equal(np.asarray(got), np.searchsorted(values, np.arange(n), side="right"))
