"""Embedding lookup on one device: out-of-range policies (never NaN, clamp or silent drop), masked rows, counters,
host check, the exchange buffer a sharded table's lookup would use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax import shard_context as context
from gem_jax.nn.embeddings import (
    EmbeddingLookupError,
    Generation,
    OutOfRange,
    TableSharding,
    apply_id_policy,
    check_lookup_stats,
    describe_exchange,
    exchange_buffer,
    lookup,
    padded_table_rows,
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


GEM_SHARDED_AXES = {"zone": 2, "node": 2, "expert": 2, "gpu": 4}  # configs/gem_sharded.py


def test_describe_exchange_gives_the_bounded_buffer_of_a_history_lookup():
    rows = padded_table_rows(1_000_000)
    bounded = place_table("embed/item", 1_000_000, rows, TableSharding(Generation.NODE_SPLIT, capacity_factor=1.25), GEM_SHARDED_AXES)
    # 166,528 ids over 16 owners: share 10,408, C = ceil(1.25 (10,408 + 4 sqrt(10,408))) = 13,521
    assert exchange_buffer(bounded, 166_528) == (16, 13_521)
    line = describe_exchange(bounded, 166_528, 256, "bfloat16")
    assert line == (
        "embed/item: NODE_SPLIT, 16 owners (all-to-all over 2 (node) then 8 (expert/gpu)), capacity factor 1.25: "
        "a lookup of 166,528 ids sends 13,521 per owner per round, 111 MB of bfloat16 rows per device "
        "(1.30x the rows looked up)"
    )
    worst = place_table("embed/item", 1_000_000, rows, TableSharding(Generation.NODE_SPLIT), GEM_SHARDED_AXES)
    assert "worst-case buffers (no capacity factor)" in describe_exchange(worst, 166_528, 256, "bfloat16")
    assert "(16.00x the rows looked up)" in describe_exchange(worst, 166_528, 256, "bfloat16")
    # Small lookups keep a margin for the spread of uniform ids: 1,024 ids, share 64, C = ceil(1.25 (64 + 32)) = 120.
    assert exchange_buffer(bounded, 1024) == (16, 120)
    with pytest.raises(ValueError, match="replicated: nothing is exchanged"):
        describe_exchange(place_table("t", 13, 16, TableSharding(Generation.REPLICATED), ONE_DEVICE), 10, 4, "float32")


def test_masked_rows_are_zero_uncounted_and_get_no_gradient():
    rng = np.random.default_rng()
    table = make_table(rng)
    ids = jnp.asarray([3, 0, 99, 5, 7], jnp.int32)  # 99 is out of range, but masked: not counted
    mask = jnp.asarray([True, True, False, True, False])
    with context.shard_context(ONE_DEVICE) as ctx:
        rows = lookup(table, ids, 13, placement(OutOfRange.ERROR), mask=mask)
    want = np.where(np.asarray(mask)[:, None], np.asarray(table)[[3, 0, 0, 5, 7]], 0.0)
    np.testing.assert_array_equal(np.asarray(rows), want)  # padding id 0 is row 0, as any id
    assert int(ctx.stats["t/out_of_range"]) == 0
    grad = jax.grad(lambda t: lookup(t, ids, 13, placement(OutOfRange.ERROR), mask=mask).sum())(table)
    expected = np.zeros((16, 4), np.float32)
    expected[[3, 0, 5]] = 1.0
    np.testing.assert_array_equal(np.asarray(grad), expected)
    with pytest.raises(ValueError, match=r"mask has shape \(4,\), ids \(5,\)"):
        lookup(table, ids, 13, placement(OutOfRange.ERROR), mask=mask[:4])


def test_the_exchange_description_counts_history_rows_for_an_item_feature_they_look_up():
    """`Training.describe_exchanges`: a table of the candidate's features is described for B/D x its values,
    or, when history rows carry the feature too, for the history's rows x its values."""
    import dataclasses
    from types import SimpleNamespace

    from gem_jax.batch import CategoricalFeature, FeatureSpec
    from gem_jax.jagged import TokenBuckets
    from gem_jax.model.config import ModelConfig
    from gem_jax.train.setup import Training

    rows = padded_table_rows(1000)
    tables = {name: place_table(name, 1000, rows, TableSharding(Generation.GLOBAL), GEM_SHARDED_AXES) for name in ("embed/item", "embed/item_features/tags")}
    spec = FeatureSpec(num_items=1000, num_actions=2, num_time_buckets=4, tasks=("click",), item_features=(CategoricalFeature("tags", 1000, 3),), max_seq_len=64)
    buckets = TokenBuckets(mean_length=20.0, std_length=5.0, max_seq_len=64)
    model = ModelConfig(embed_dim=16, num_heads=2, num_seq_layers=1, num_dhen_layers=1, head_hidden=16)

    def lines(spec):
        fake = SimpleNamespace(
            per_device_batch=32, dataset=SimpleNamespace(spec=spec, token_buckets=buckets),
            config=SimpleNamespace(model=model), state=SimpleNamespace(plan=SimpleNamespace(tables=tables)),
        )
        return Training.describe_exchanges(fake)

    history_rows = int(lines(spec)[0].split("a lookup of ")[1].split(" ids")[0].replace(",", ""))
    assert history_rows >= 32 * 20
    assert "a lookup of 96 ids" in lines(spec)[1]  # 32 examples x 3 values
    with_history = lines(dataclasses.replace(spec, history_item_features=True))
    assert with_history[0] == lines(spec)[0] and f"a lookup of {history_rows * 3:,} ids" in with_history[1]
