"""Tests of gem_jax.jagged: construction, validation errors, padded round trips, slack isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax import jagged
from gem_jax.jagged import (
    CAPACITY_MULTIPLE,
    Jagged,
    JaggedError,
    TokenBuckets,
    capacity_multiple,
    from_lengths,
    offsets_from_lengths,
    pick_capacity,
    round_capacity,
)
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


# ---------------------------------------------------------------- token capacities


def test_token_buckets_values():
    # E = 64 * 100 = 6400, spread 2 * 8 * 50 = 800: fine 6400 * 1.25**k, k = -1..1; halvings below, doublings above.
    assert TokenBuckets(100.0, 50.0, 400, step=1.25, sigmas=2.0).capacities(64) == (
        128, 256, 384, 640, 1280, 2560, 5120, 6400, 8064, 16000, 25600
    )
    assert TokenBuckets(2.0, 1.0, 16).capacities(8) == (128,)  # everything rounds to one block
    assert TokenBuckets(0.0, 0.0, 16).capacities(100) == (128, 256, 512, 1024, 1664)  # the last: 100 * 16 rounded up
    # The fine part alone: 6400 * 1.25**k for k = -1..1, rounded up to blocks of 128.
    assert TokenBuckets(100.0, 50.0, 400, step=1.25, sigmas=2.0).fine_capacities(64) == (5120, 6400, 8064)
    assert TokenBuckets(2.0, 1.0, 16).fine_capacities(8) == (128,)


@pytest.mark.parametrize("seed", range(4))
def test_token_buckets_bound_the_slack_of_every_total_in_the_fine_range(seed):
    rng = np.random.default_rng(seed)
    max_len = int(rng.integers(16, 2048))
    mean = float(rng.uniform(0.05, 0.9) * max_len)
    buckets = TokenBuckets(mean, float(rng.uniform(0.1, 1.5) * mean), max_len, step=float(rng.uniform(1.01, 1.2)), sigmas=float(rng.uniform(1, 5)))
    n = int(rng.integers(64, 4096))
    caps = buckets.capacities(n)
    fine = buckets.fine_capacities(n)
    i = caps.index(fine[0])
    assert caps[i : i + len(fine)] == fine  # a contiguous run of the capacities
    full = n * max_len
    assert list(caps) == sorted(set(caps)) and all(c % capacity_multiple(c) == 0 for c in caps)
    assert caps[-1] == round_capacity(full) and pick_capacity(full, caps) == caps[-1]
    spread = buckets.sigmas * np.sqrt(n) * buckets.std_length
    for total in np.unique(np.linspace(max(n * mean - spread, CAPACITY_MULTIPLE), min(n * mean + spread, full), 2000).astype(int)):
        capacity = pick_capacity(int(total), caps)
        assert 1 - total / capacity < 1 - 1 / buckets.step + capacity_multiple(capacity) / capacity, (total, capacity)


def test_round_capacity_rounds_to_a_power_of_two_near_the_square_root_of_large_capacities():
    # 128 * 1301 (1301 prime) has no divisor near its square root: it moves up to 256 * 651.
    assert [round_capacity(r) for r in (0, 1, 128, 129, 16384, 16385, 166528, 262144, 262145)] == [
        128, 128, 128, 256, 16384, 16512, 166656, 262144, 262656,
    ]
    assert [capacity_multiple(c) for c in (128, 65535, 65536, 166656, 262144, 1 << 20)] == [128, 128, 256, 256, 512, 1024]
    previous = 0
    for rows in np.unique(np.geomspace(1, 5e6, 4000).astype(int)):
        capacity = round_capacity(int(rows))
        multiple = capacity_multiple(capacity)
        assert capacity % multiple == 0 and capacity >= rows and capacity >= previous, rows
        assert capacity - rows < max(CAPACITY_MULTIPLE, np.sqrt(capacity)), rows  # the slack it adds
        assert multiple <= max(CAPACITY_MULTIPLE, np.sqrt(capacity)) < 2 * multiple, rows
        previous = capacity


def test_token_buckets_from_lengths_and_errors():
    buckets = TokenBuckets.from_lengths(np.array([0, 10, 20, 30]), 32, step=1.1, sigmas=3.0)
    assert (buckets.mean_length, buckets.std_length, buckets.max_seq_len, buckets.step, buckets.sigmas) == (15.0, np.sqrt(125.0), 32, 1.1, 3.0)
    with pytest.raises(ValueError, match="non-empty 1-D sample"):
        TokenBuckets.from_lengths(np.array([], int), 32)
    with pytest.raises(ValueError, match=r"mean_length must be in \[0, max_seq_len=8\], got 9"):
        TokenBuckets(9.0, 1.0, 8)
    with pytest.raises(ValueError, match="std_length must be finite and >= 0, got nan"):
        TokenBuckets(1.0, float("nan"), 8)
    with pytest.raises(ValueError, match=r"TokenBuckets.step must be in \(1, 2\], got 2.5"):
        TokenBuckets(1.0, 1.0, 8, step=2.5)
    with pytest.raises(ValueError, match="TokenBuckets.sigmas must be finite and > 0, got -1"):
        TokenBuckets(1.0, 1.0, 8, sigmas=-1)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        TokenBuckets(1.0, 1.0, 8).capacities(0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        TokenBuckets(1.0, 1.0, 8).fine_capacities(0)
