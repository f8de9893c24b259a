"""Embedding lookup on one device: out-of-range policies (never NaN, clamp or silent drop), counters, host check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.nn import shard_context as context
from gem_jax.nn.embeddings import (
    EmbeddingLookupError,
    Generation,
    OutOfRange,
    TableSharding,
    apply_id_policy,
    check_lookup_stats,
    lookup,
    place_table,
)

ONE_DEVICE = {"zone": 1, "node": 1, "expert": 1, "gpu": 1}


def make_table(rng, rows=16, dim=4):
    return jnp.asarray(rng.normal(size=(rows, dim)), jnp.float32)


def placement(policy, num_rows=13):
    return place_table("t", num_rows, 16, TableSharding(Generation.REPLICATED, policy), ONE_DEVICE)


@pytest.mark.parametrize("policy", [OutOfRange.ERROR, OutOfRange.ZERO])
def test_rejected_ids_give_zero_rows_and_no_gradient(policy):
    rng = np.random.default_rng()
    table = make_table(rng)
    ids = jnp.asarray([[3, 13, -1], [0, 12, 2**31 - 1]], jnp.int32)  # 13 == num_rows, negative, huge
    with context.shard_context(ONE_DEVICE) as ctx:
        rows = lookup(table, ids, 13, placement(policy))
    assert rows.shape == (2, 3, 4) and np.isfinite(np.asarray(rows)).all()
    np.testing.assert_array_equal(np.asarray(rows[0, 0]), np.asarray(table[3]))
    np.testing.assert_array_equal(np.asarray(rows[1, 1]), np.asarray(table[12]))
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        assert not np.asarray(rows[i, j]).any()
    assert int(ctx.stats["t/out_of_range"]) == 3
    grad = jax.grad(lambda t: lookup(t, ids, 13, placement(policy)).sum())(table)
    expected = np.zeros((16, 4), np.float32)
    for i in (3, 0, 12):
        expected[i] += 1.0
    np.testing.assert_array_equal(np.asarray(grad), expected)  # rows 13..15 (the last valid clamp target) untouched


def test_hash_policy_maps_into_the_vocabulary_deterministically():
    rng = np.random.default_rng()
    bad = jnp.asarray(rng.integers(-(2**31), 2**31 - 1, size=64), jnp.int32)
    bad = jnp.where((bad >= 0) & (bad < 13), bad + 13, bad)
    ids, valid, num_bad = apply_id_policy(bad, 13, OutOfRange.HASH)
    assert bool(valid.all()) and int(num_bad) == 64
    assert int(ids.min()) >= 0 and int(ids.max()) < 13
    again, _, _ = apply_id_policy(bad, 13, OutOfRange.HASH)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(again))
    good = jnp.arange(13, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(apply_id_policy(good, 13, OutOfRange.HASH)[0]), np.arange(13))


def test_unbound_table_lookup_is_the_plain_gather_for_valid_ids():
    rng = np.random.default_rng()
    table = make_table(rng)
    ids = jnp.asarray(rng.integers(0, 13, size=(5, 7)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(lookup(table, ids, 13, None)), np.asarray(table)[np.asarray(ids)])
    assert lookup(table, jnp.zeros((0,), jnp.int32), 13, None).shape == (0, 4)


def test_check_lookup_stats_raises_only_for_error_tables():
    tables = {"a": placement(OutOfRange.ERROR), "b": placement(OutOfRange.ZERO)}
    check_lookup_stats({"a/out_of_range": 0, "b/out_of_range": 5}, tables)
    with pytest.raises(EmbeddingLookupError, match=r"step 7: 2 ids outside \[0, 13\) reached table 'a'"):
        check_lookup_stats({"a/out_of_range": 2}, tables, where="step 7")


def test_sharded_placement_outside_a_sharded_step_is_an_error():
    sharded = place_table("t", 13, 16, TableSharding(Generation.GLOBAL), {"zone": 1, "node": 2, "expert": 1, "gpu": 1})
    with pytest.raises(ValueError, match="look it up inside the sharded step"):
        lookup(jnp.zeros((8, 4)), jnp.zeros((3,), jnp.int32), 13, sharded)


def test_table_sharding_validates_its_fields():
    with pytest.raises(TypeError, match="generation must be a Generation"):
        TableSharding(2)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        TableSharding(capacity_factor=0.0)
