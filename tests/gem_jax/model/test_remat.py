"""Rematerialization regions: the settings, and gradients equal with and without every policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.batch import Batch, random_batch
from gem_jax.model import cross_tower, remat
from gem_jax.model.config import ModelConfig
from gem_jax.model.gem import GEMModel
from gem_jax.model.loss import weighted_bce
from gem_jax.model.remat import RematConfig, RematPolicy
from gem_jax.nn import layers
from gem_jax.train import config_tree
from gem_jax.train.config import load_config
from specs import movielens_spec

SPEC = movielens_spec()


def tiny_model_config(repo_root, name: str = "gem_h200_tiny.py") -> ModelConfig:
    return load_config(repo_root / "configs" / name).model



def test_region_names_follow_the_layer_counts():
    assert ModelConfig(num_seq_layers=2, num_dhen_layers=1).region_names == (
        "history_context", "seq0/attention", "seq0/mlp", "seq1/attention", "seq1/mlp",
        "pooled_attention", "feature_to_history", "token_attention", "dhen0", "heads",
    )


def test_the_last_matching_pattern_sets_a_regions_policy():
    config = RematConfig(policies=(("*", "SAVE_DOTS"), ("seq*/mlp", RematPolicy.SAVE_NOTHING), ("seq1/mlp", "save_named")))
    assert config.policy("seq0/mlp") is RematPolicy.SAVE_NOTHING
    assert config.policy("seq1/mlp") is RematPolicy.SAVE_NAMED
    assert config.policy("heads") is RematPolicy.SAVE_DOTS
    assert RematConfig().policy("heads") is RematPolicy.SAVE_ALL


def test_a_pattern_matching_no_region_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'seq2/\*' matches no region.*seq1/mlp"):
        ModelConfig(num_seq_layers=2, remat=RematConfig(policies=(("seq2/*", "SAVE_NOTHING"),)))
    with pytest.raises(ValueError, match="'dhen' matches no region"):
        ModelConfig(remat=RematConfig(policies=(("dhen", "SAVE_NOTHING"),)))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(policies=(("*", "SAVE_SOME"),)), ValueError, "'SAVE_SOME' is not a RematPolicy"),
        (dict(policies=("*",)), TypeError, r"policies\[0\] must be a \(pattern, policy\) pair"),
        (dict(budget_gb=0.0), ValueError, "budget_gb must be finite and > 0"),
        (dict(budget_gb="80"), TypeError, "budget_gb must be a number"),
        (dict(budget_gb=80.0, policies=(("*", "SAVE_DOTS"),)), ValueError, "not both"),
    ],
)
def test_malformed_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        RematConfig(**kwargs)


def test_settings_round_trip_through_the_config_tree_and_overrides(repo_root):
    config = load_config(repo_root / "configs" / "gem_h200_tiny.py")
    config = config_tree.apply_overrides(config, ["model.remat.policies=(('seq*/mlp', 'SAVE_NOTHING'), ('heads', 'SAVE_DOTS'))"])
    assert config.model.remat.policies == (("seq*/mlp", RematPolicy.SAVE_NOTHING), ("heads", RematPolicy.SAVE_DOTS))
    tree = config_tree.to_tree(config)
    assert tree["model"]["remat"] == {"budget_gb": None, "policies": [["seq*/mlp", "SAVE_NOTHING"], ["heads", "SAVE_DOTS"]]}
    assert config_tree.from_tree(type(config), tree) == config
    assert config_tree.apply_overrides(config, ["model.remat.policies=()", "model.remat.budget_gb=70"]).model.remat == RematConfig(budget_gb=70.0)


def _grad_fn(model_config: ModelConfig, batch: Batch):
    graphdef = nnx.split(nnx.eval_shape(lambda: GEMModel(SPEC, model_config, rngs=nnx.Rngs(0))))[0]
    return jax.grad(lambda params: weighted_bce(nnx.merge(graphdef, params)(batch), batch.labels, batch.weights).sum())


def test_gradients_equal_with_and_without_every_policy(repo_root):
    """configs/movielens_tiny.py's model: every region under each policy in turn, and a mix, against no remat."""
    base = tiny_model_config(repo_root, "movielens_tiny.py")
    batch = random_batch(SPEC, np.random.default_rng(), [3, 0, 12, 7, 5], capacity=32)
    params = nnx.split(GEMModel(SPEC, base, rngs=nnx.Rngs(0)))[1]
    names = base.region_names
    mixed = tuple((name, list(RematPolicy)[i % len(RematPolicy)]) for i, name in enumerate(names))
    variants = [RematConfig()] + [RematConfig(policies=(("*", p),)) for p in RematPolicy if p is not RematPolicy.SAVE_ALL] + [RematConfig(policies=mixed)]
    fns = [_grad_fn(dataclasses.replace(base, remat=v), batch) for v in variants]
    grads = jax.jit(lambda p: [f(p) for f in fns])(params)
    reference = jax.tree.leaves(grads[0])
    for variant, g in zip(variants[1:], grads[1:]):
        for a, b in zip(jax.tree.leaves(g), reference):
            # The same float32 gradient, recomputed: only XLA's fusion and summation order may differ (a few u per
            # sum, amplified through the tiny model's backward; measured ~1e-7).
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=str(variant))
    assert max(float(jnp.abs(x).max()) for x in reference) > 0


def test_policies_put_regions_under_checkpoint_and_the_default_adds_none(repo_root, monkeypatch):
    for module in (layers, cross_tower):  # the GELUs' own checkpoint (`gem_jax.nn.layers.gelu`) is not a region's
        monkeypatch.setattr(module, "gelu", jax.nn.gelu)
    base = tiny_model_config(repo_root)
    batch = random_batch(SPEC, np.random.default_rng(0), [3, 4], capacity=8)
    params = nnx.split(GEMModel(SPEC, base, rngs=nnx.Rngs(0)))[1]

    def checkpoints(remat_config):
        jaxpr = jax.make_jaxpr(_grad_fn(dataclasses.replace(base, remat=remat_config), batch))(params)
        return str(jaxpr).count("checkpoint[") + str(jaxpr).count("remat")

    assert checkpoints(RematConfig()) == 0
    assert checkpoints(RematConfig(policies=(("*", "SAVE_ALL"),))) == 0
    assert checkpoints(RematConfig(policies=(("seq*/mlp", "SAVE_NOTHING"),))) > 0


def test_observed_regions_are_pure_functions_of_their_parameters_and_inputs(repo_root):
    """The observer sees each region once, in order, with `fn(params, *args)` giving the region's output."""
    base = tiny_model_config(repo_root)
    batch = random_batch(SPEC, np.random.default_rng(0), [3, 4], capacity=8)
    graphdef, params = nnx.split(GEMModel(SPEC, base, rngs=nnx.Rngs(0)))
    seen = []

    def observe(name, fn, params, args):
        seen.append((name, jax.eval_shape(fn, params, *args).shape))

    with remat.observe_regions(observe):
        jax.eval_shape(lambda p: nnx.merge(graphdef, p)(batch), params)
    assert [name for name, _ in seen] == list(base.region_names)
    assert dict(seen)["seq0/mlp"] == (8, base.embed_dim) and dict(seen)["heads"] == (2, 2)
