"""Tests of the workload model and the balance metrics."""

import numpy as np
import pytest

from gem_jax.batch import CategoricalFeature, FeatureSpec, Pooling
from gem_jax.data.balance import load_imbalance, padding_waste, shard_loads
from gem_jax.model.config import ModelConfig
from gem_jax.model.flops import Workload, flop_model, train_workload


def test_train_workload_is_three_times_the_forward_count():
    model_config = ModelConfig(embed_dim=16, num_heads=2, num_seq_layers=2, num_pooled_queries=2, head_hidden=8)
    spec = FeatureSpec(
        num_items=50, num_actions=11, num_time_buckets=8, tasks=("like", "love"),
        user_features=(CategoricalFeature("user", 10),), item_features=(CategoricalFeature("genres", 6, 5, Pooling.MULTI_HOT),),
    )
    fm = flop_model(model_config, spec)
    workload = train_workload(model_config, spec)
    lengths = np.random.default_rng().integers(0, 300, size=17)
    np.testing.assert_allclose(workload.total(lengths), 3 * fm.total(lengths), rtol=1e-12)
    np.testing.assert_allclose(workload(lengths), [3 * fm.total([n]) for n in lengths], rtol=1e-12)
    assert workload.per_token_pair > 0 and workload.per_example > 0


def test_call_keeps_shape_and_rejects_bad_lengths():
    model = Workload(per_token=2.0, per_token_pair=0.5, per_example=1.0)
    np.testing.assert_array_equal(model(np.array([[0, 2], [4, 1]])), [[1.0, 1 + 4 + 2], [1 + 8 + 8, 1 + 2 + 0.5]])
    with pytest.raises(ValueError, match="length -3 at index 1 is negative"):
        model([4, -3])
    with pytest.raises(ValueError, match="must be integers"):
        model([1.5])
    with pytest.raises(ValueError, match="per_token must be finite"):
        Workload(per_token=-1.0, per_token_pair=0.0)


def test_load_imbalance_and_shard_loads():
    rng = np.random.default_rng()
    loads = rng.uniform(1.0, 10.0, size=int(rng.integers(2, 64)))
    assert load_imbalance(loads) == pytest.approx(loads.max() / loads.mean() - 1.0, rel=1e-12)
    assert load_imbalance([3.0, 3.0, 3.0]) == 0.0
    assert load_imbalance([0.0, 0.0]) == 0.0
    workloads = rng.uniform(0.0, 5.0, size=24)
    np.testing.assert_allclose(shard_loads(workloads, 3), [workloads[:8].sum(), workloads[8:16].sum(), workloads[16:].sum()])
    np.testing.assert_array_equal(shard_loads(workloads, 1), [workloads.sum()])
    for shards in (0, 5, True):
        with pytest.raises(ValueError, match="num_shards must be a positive int dividing the batch of 24"):
            shard_loads(workloads, shards)
    with pytest.raises(ValueError, match="must be 1-D"):
        shard_loads(workloads.reshape(4, 6), 2)
    for bad, message in [([], "non-empty 1-D"), ([[1.0]], "non-empty 1-D"), ([1.0, -1.0], ">= 0"), ([np.nan], "finite")]:
        with pytest.raises(ValueError, match=message):
            load_imbalance(bad)


def test_padding_waste():
    rng = np.random.default_rng()
    lengths = rng.integers(0, 50, size=16)
    assert padding_waste(lengths, 16 * 50) == pytest.approx(1.0 - lengths.sum() / 800)
    assert padding_waste([], 8) == 1.0
    assert padding_waste([4, 4], 8) == 0.0
    with pytest.raises(ValueError, match="9 real tokens exceed the capacity of 8"):
        padding_waste([4, 5], 8)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        padding_waste([1], 0)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        padding_waste([1, -1], 4)


def test_attention_pairs_count_window_and_block_pairs_exactly():
    from gem_jax.model.flops import AttentionPairs

    for n in (0, 1, 5, 63, 64, 65, 130, 300):
        causal_band = sum(min(i, 7) + 1 for i in range(n))
        blocks = sum(min(64, n - b) ** 2 for b in range(0, n, 64))
        assert AttentionPairs("window", 7)(np.float64(n)) == causal_band
        assert AttentionPairs("block", 64)(np.float64(n)) == blocks
    with pytest.raises(ValueError, match="kind must be"):
        AttentionPairs("block", 0)


def test_flop_model_counts_each_sequence_attention_kind():
    from gem_jax.model.config import SequenceAttention

    spec = FeatureSpec(
        num_items=50, num_actions=11, num_time_buckets=8, tasks=("like", "love"),
        user_features=(CategoricalFeature("user", 10),), item_features=(CategoricalFeature("genres", 6, 5, Pooling.MULTI_HOT),),
    )
    base = dict(embed_dim=16, num_heads=2, num_seq_layers=2, num_pooled_queries=2, head_hidden=8)
    full = flop_model(ModelConfig(**base), spec)
    window = flop_model(ModelConfig(**base, sequence_attention=SequenceAttention.SLIDING_WINDOW, attention_window=10), spec)
    block = flop_model(ModelConfig(**base, sequence_attention="block_local", attention_block_size=64), spec)
    silu = flop_model(ModelConfig(**base, sequence_attention=SequenceAttention.CAUSAL_SILU), spec)
    per_pair = 2 * 4 * 16  # layers x (QK^T and PV) x H x head dim
    n = 200
    causal = n * (n + 1) / 2  # full causal attention: the lower triangle with its diagonal
    assert window(n) - full(n) == pytest.approx(per_pair * (sum(min(i, 10) + 1 for i in range(n)) - causal))
    assert block(n) - full(n) == pytest.approx(per_pair * (3 * 64**2 + 8**2 - causal))
    assert silu(n) == full(n)
    with pytest.raises(ValueError, match="sequence_attention|SequenceAttention|valid"):
        ModelConfig(**base, sequence_attention="sparse")
