"""Tests of the workload model and the balance metrics."""

import numpy as np
import pytest

from gem_jax.data.workload import Workload, load_imbalance, padding_waste, rank_workloads


def _brute_force_flops(length, *, d_model, n_layers, n_heads, head_dim, mlp_width, mlp_matrices, causal):
    """Training FLOPs counted matmul by matmul, pair by pair."""
    inner = n_heads * head_dim
    flops = 0
    for _ in range(n_layers):
        for shape in [(d_model, inner)] * 3 + [(inner, d_model)] + [(d_model, mlp_width)] * mlp_matrices:
            flops += 2 * shape[0] * shape[1] * length  # forward matmul per token
        pairs = sum(q + 1 for q in range(length)) if causal else length * length
        flops += pairs * n_heads * (2 * head_dim + 2 * head_dim)  # Q K^T and P V
    return 3 * flops


@pytest.mark.parametrize("causal", [True, False])
def test_for_transformer_matches_brute_force_count(causal):
    rng = np.random.default_rng()
    dims = dict(
        d_model=int(rng.integers(8, 64)),
        n_layers=int(rng.integers(1, 4)),
        n_heads=int(rng.integers(1, 5)),
        head_dim=int(rng.integers(4, 32)),
        mlp_width=int(rng.integers(8, 128)),
        mlp_matrices=int(rng.integers(2, 4)),
    )
    model = Workload.for_transformer(**dims, causal=causal, per_example=123.0)
    lengths = np.concatenate([[0, 1], rng.integers(2, 300, size=6)])
    expected = [123.0 + _brute_force_flops(int(n), **dims, causal=causal) for n in lengths]
    np.testing.assert_allclose(model(lengths), expected, rtol=1e-12)
    assert model(lengths).dtype == np.float64


def test_causal_halves_the_quadratic_term():
    dims = dict(d_model=32, n_layers=3, n_heads=4, head_dim=8, mlp_width=64)
    causal, full = Workload.for_transformer(**dims), Workload.for_transformer(**dims, causal=False)
    assert full.per_token_pair == 2 * causal.per_token_pair
    assert causal.per_token_pair == 4 * 4 * 8 * 3 * 3 / 2  # 4 H hd n_layers * 3 / 2


def test_call_keeps_shape_and_rejects_bad_lengths():
    model = Workload(per_token=2.0, per_token_pair=0.5, per_example=1.0)
    np.testing.assert_array_equal(model(np.array([[0, 2], [4, 1]])), [[1.0, 1 + 4 + 2], [1 + 8 + 8, 1 + 2 + 0.5]])
    with pytest.raises(ValueError, match="length -3 at index 1 is negative"):
        model([4, -3])
    with pytest.raises(ValueError, match="must be integers"):
        model([1.5])
    with pytest.raises(ValueError, match="per_token must be finite"):
        Workload(per_token=-1.0, per_token_pair=0.0)
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        Workload.for_transformer(d_model=8, n_layers=1, n_heads=0, head_dim=4, mlp_width=8)
    with pytest.raises(ValueError, match="mlp_width must be a positive int"):
        Workload.for_transformer(d_model=8, n_layers=1, n_heads=1, head_dim=4, mlp_width=8.0)


def test_load_imbalance_and_rank_workloads():
    rng = np.random.default_rng()
    loads = rng.uniform(1.0, 10.0, size=int(rng.integers(2, 64)))
    assert load_imbalance(loads) == pytest.approx(loads.max() / loads.mean() - 1.0, rel=1e-12)
    assert load_imbalance([3.0, 3.0, 3.0]) == 0.0
    assert load_imbalance([0.0, 0.0]) == 0.0
    model = Workload(per_token=1.0, per_token_pair=1.0)
    per_rank = [np.array([1, 2]), np.array([], dtype=np.int64), np.array([3])]
    np.testing.assert_array_equal(rank_workloads(model, per_rank), [2 + 6, 0, 12])
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
