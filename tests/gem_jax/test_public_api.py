"""The package faces: the names research code imports, without deep paths; the light import stays light."""

import dataclasses
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import gem_jax
import gem_jax.data
import gem_jax.model
import gem_jax.parallel
import gem_jax.train


@pytest.mark.parametrize("module", [gem_jax, gem_jax.data, gem_jax.model, gem_jax.parallel, gem_jax.train])
def test_every_exported_name_imports(module):
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_import_gem_jax_does_not_load_grain_or_orbax(repo_root):
    code = "import sys, gem_jax; gem_jax.Jagged; gem_jax.ModelConfig; print(sorted(m for m in ('grain', 'orbax', 'gem_jax.train.loop') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root, check=True).stdout
    assert out.strip() == "[]"


SPEC = gem_jax.FeatureSpec(
    num_items=50,
    num_actions=11,
    num_time_buckets=8,
    tasks=("click", "buy"),
    user_features=(gem_jax.CategoricalFeature("user", 10), gem_jax.CategoricalFeature("country", 5)),
    item_features=(gem_jax.CategoricalFeature("tags", 20, max_values=3),),
    max_seq_len=4,
)


def test_a_model_builds_and_runs_outside_the_trainer():
    spec = SPEC
    model = gem_jax.GEMModel(spec, gem_jax.ModelConfig(embed_dim=16, num_pooled_queries=2), rngs=nnx.Rngs(0))
    lengths = np.array([0, 3, 4])
    rng = np.random.default_rng()
    values = np.stack([rng.integers(1, 50, 7), rng.integers(1, 11, 7), rng.integers(1, 8, 7)], axis=1).astype(np.int32)
    history = gem_jax.Jagged.from_lengths(values, lengths, max_seq_len=4, capacity=8)
    batch = gem_jax.Batch(
        history=history,
        user={"user": rng.integers(1, 10, (3, 1)).astype(np.int32), "country": np.array([[4], [0], [1]], np.int32)},
        candidate_item=rng.integers(1, 50, 3).astype(np.int32),
        candidate_features={"tags": np.array([[3, 7, 0], [0, 0, 0], [19, 0, 0]], np.int32)},
        labels=np.zeros((3, 2), np.float32),
        weights=np.ones(3, np.float32),
    )
    logits = model(jax.tree.map(jax.numpy.asarray, batch))
    assert logits.shape == (3, 2) and np.all(np.isfinite(logits))


def test_a_malformed_batch_is_refused_with_the_field_named():
    spec = SPEC
    model = gem_jax.GEMModel(spec, gem_jax.ModelConfig(embed_dim=16, num_pooled_queries=2), rngs=nnx.Rngs(0))

    def batch(values):
        return gem_jax.Batch(
            history=gem_jax.Jagged.from_lengths(values, [2, 1], max_seq_len=4),
            user={"user": np.array([[1], [2]], np.int32), "country": np.zeros((2, 1), np.int32)},
            candidate_item=np.array([3, 4], np.int32),
            candidate_features={"tags": np.zeros((2, 3), np.int32)},
            labels=np.zeros((2, 2), np.float32),
            weights=np.ones(2, np.float32),
        )

    with pytest.raises(ValueError, match=r"Batch\.history\.values has shape \(3,\), expected \('T', 3\)"):
        model(batch(np.ones(3, np.int32)))
    with pytest.raises(ValueError, match="history item id 99 at index 0 is outside the vocabulary"):
        model(batch(np.full((3, 3), 99, np.int32)))
    # float ids are refused, not truncated (1.9 would read as item 1, NaN as some id)
    for values in (np.full((3, 3), 1.9, np.float32), np.full((3, 3), np.nan, np.float32)):
        with pytest.raises(ValueError, match="GEMModel input: history item ids are float32; ids must have an integer dtype"):
            model(batch(values))
    floats = batch(np.ones((3, 3), np.int32))
    with pytest.raises(ValueError, match="candidate item ids are float64"):
        model(dataclasses.replace(floats, candidate_item=np.array([1.9, 2.0])))


def test_histories_all_empty_run_with_or_without_a_capacity_and_no_examples_is_refused():
    """A batch of cold-start users (T = 0 rows) gives the logits it gives with slack rows; B = 0 is named."""
    model = gem_jax.GEMModel(SPEC, gem_jax.ModelConfig(embed_dim=16, num_pooled_queries=2), rngs=nnx.Rngs(0))

    def batch(b, **capacity):
        return gem_jax.Batch(
            history=gem_jax.Jagged.from_lengths(np.zeros((0, 3), np.int32), np.zeros(b, np.int64), max_seq_len=4, **capacity),
            user={"user": np.ones((b, 1), np.int32), "country": np.ones((b, 1), np.int32)},
            candidate_item=np.arange(1, b + 1, dtype=np.int32),
            candidate_features={"tags": np.zeros((b, 3), np.int32)},
            labels=np.zeros((b, 2), np.float32),
            weights=np.ones(b, np.float32),
        )

    bare, padded = model(batch(3)), model(batch(3, capacity=8))
    assert bare.shape == (3, 2) and np.all(np.isfinite(bare))
    np.testing.assert_allclose(bare, padded, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"GEMModel input: a batch holds at least one example; the example counts its fields give: "
                       r"history.offsets 0, candidate_item 0, labels 0, weights 0"):
        model(batch(0))
