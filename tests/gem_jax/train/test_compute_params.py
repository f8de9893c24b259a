"""The train state's compute-dtype copy of the dense weights (`TrainState.compute_params`).

A bfloat16 step with the copy computes what the step without it computes (the copy is the cast
the forward would make): the first loss bit for bit, the update to the float32 rounding of its
arithmetic, which XLA may evaluate in another order once the update also writes the copy (1 ulp
of some weights in this test's unoptimised CPU compile, none in the optimised one of
`configs/gem_h200_tiny.py`; a weight near a bfloat16 rounding boundary carries such an ulp into
later losses); the copy after each step is the cast of the updated weights; checkpoints hold no
copy and a restore rebuilds it; float32 models keep none.
"""

import dataclasses
import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from gem_jax.parallel.spmd import cast_param_paths
from gem_jax.pytree import path_str
from gem_jax.train.checkpoint import CheckpointConfig, Checkpointer
from gem_jax.train.config import load_config
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.setup import setup_training
from gem_jax.train.state import TrainState


def _config(repo_root, keep: bool, compute_dtype: str = "bfloat16", moments_dtype: str = "bfloat16"):
    config = load_config(str(repo_root / "configs" / "movielens_tiny.py"))
    model = dataclasses.replace(config.model, compute_dtype=compute_dtype, attention_implementation="xla")
    optim = dataclasses.replace(config.optim, keep_compute_params=keep, moments_dtype=moments_dtype, warmup_steps=0)
    return dataclasses.replace(config, model=model, optim=optim)


def _run(repo_root, keep: bool, steps: int = 3, **kwargs):
    training, state = setup_training(_config(repo_root, keep, **kwargs))
    batches = training.dataset.train_iterator()
    losses = []
    for _ in range(steps):
        state, metrics = training.train_step(state, training.placement.put(next(batches)))
        losses.append(float(metrics["loss"]))
    return training, state, losses


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def runs(repo_root):
    return {keep: _run(repo_root, keep) for keep in (True, False)}


def test_steps_with_the_copy_compute_the_steps_without(runs, repo_root):
    (_, with_copy, losses), (_, without, reference) = runs[True], runs[False]
    assert losses[0] == reference[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-3)
    assert without.compute_params is None and with_copy.compute_params
    # one step: the same update, to the float32 rounding of its arithmetic
    (_, one, _), (_, one_without, _) = _run(repo_root, True, steps=1), _run(repo_root, False, steps=1)
    for got, want in zip(_leaves(one.params), _leaves(one_without.params), strict=True):
        # the update's terms are of the weights' size: 2 ulp of the largest weight of the leaf
        np.testing.assert_allclose(got, want, rtol=0, atol=2 * np.spacing(np.abs(want).max()))


def test_the_copy_is_the_cast_of_the_updated_weights_with_their_shardings(runs):
    training, state, _ = runs[True]
    setup = training.state
    leaves = {path_str(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
    assert set(state.compute_params) == set(setup.copied)
    for path, copy in state.compute_params.items():
        assert copy.dtype == jnp.bfloat16 and leaves[path].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(leaves[path].astype(jnp.bfloat16)), err_msg=path)
        assert copy.sharding == leaves[path].sharding
    # every dense weight the forward casts is copied; no embedding table is
    assert any(path.endswith("kernel") for path in setup.copied)
    assert not any(path.endswith("embedding") for path in setup.copied)


def test_float32_models_keep_no_copy(repo_root):
    training, _ = setup_training(_config(repo_root, True, compute_dtype="float32"), init_state=False)
    assert training.state.copied == () and training.state.abstract.compute_params is None
    plan_paths = cast_param_paths(training.state.plan, training.state.abstract.params, "float32")
    assert plan_paths == ()


def test_checkpoints_hold_no_copy_and_a_restore_rebuilds_it(runs, tmp_path):
    training, state, _ = runs[True]
    data = iter(grain.MapDataset.range(100).to_iter_dataset())
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every_steps=1))
    try:
        checkpointer.preflight(training.state.abstract)
        assert checkpointer.save(3, state, data, force=True)
        checkpointer.wait()
        restored = checkpointer.restore(3, training.state.abstract, data)
    finally:
        checkpointer.close()
    for got, want in zip(_leaves(restored), _leaves(state), strict=True):
        np.testing.assert_array_equal(got, want)
    for path, copy in state.compute_params.items():
        assert restored.compute_params[path].sharding == copy.sharding and restored.compute_params[path].dtype == copy.dtype
    on_disk = set(json.loads((tmp_path / "3" / "state" / "_METADATA").read_text())["tree_metadata"])
    assert not any("compute_params" in key for key in on_disk)


def test_a_checkpoint_of_the_three_field_state_restores_with_its_copy(runs, tmp_path):
    """Checkpoints written before the state kept a copy hold the three-field `TrainState` of then: they restore onto
    a state that keeps one, its copy made from the restored weights."""

    @struct.dataclass
    class EarlierTrainState:
        step: jax.Array
        params: dict
        opt_state: optax.OptState

    training, state, _ = runs[True]
    data = iter(grain.MapDataset.range(100).to_iter_dataset())
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every_steps=1))
    earlier = EarlierTrainState(step=state.step, params=state.params, opt_state=state.opt_state)
    try:
        assert checkpointer.save(3, earlier, data, force=True)  # not a TrainState: written as given
        checkpointer.wait()
        restored = checkpointer.restore_state(3, training.state.abstract)
    finally:
        checkpointer.close()
    assert isinstance(restored, TrainState)
    for got, want in zip(_leaves(restored), _leaves(state), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_stopped_bfloat16_run_resumes_with_its_copy_and_reproduces_its_losses(repo_root, tmp_path):
    """The copy a restart rebuilds is the one the uninterrupted run carried: the same losses, bit for bit."""
    config = _config(repo_root, True)
    train_and_evaluate(config, tmp_path / "whole")
    train_and_evaluate(config, tmp_path / "resumed", stop_after_steps=4)  # checkpoints at 3 and 4 (the stop)
    train_and_evaluate(config, tmp_path / "resumed")

    def losses(workdir):
        records = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]

    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole") and len(losses(tmp_path / "whole")) == 6
