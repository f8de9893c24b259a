"""bfloat16 dense weights (`OptimConfig.weights_dtype`): the stochastic rounding of updates into them, the state's
dtypes, a bfloat16 step against the float32-master step, checkpoints, restarts and the refusals."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gem_jax import cli
from gem_jax.mesh import make_mesh
from gem_jax.pytree import path_str
from gem_jax.train import config_tree, run_record
from gem_jax.train.config import load_config
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.optimizer import OptimConfig, make_optimizer, round_into_bf16_weights, stochastic_round_bf16
from gem_jax.train.restore import load_params
from gem_jax.train.setup import model_factory, setup_training
from gem_jax.train.state import state_setup


def test_updates_below_half_a_spacing_land_on_average_and_apply_exactly():
    weights = {"w": jnp.ones((100_000,), jnp.bfloat16), "gain": jnp.ones((4,), jnp.float32)}
    step = 2.0**-10  # an eighth of bfloat16's spacing at 1 (2^-7): rounded to nearest it is lost
    updates = {"w": jnp.full((100_000,), step, jnp.float32), "gain": jnp.full((4,), step, jnp.float32)}
    rounding = round_into_bf16_weights()
    state = rounding.init(weights)
    rounded, state = rounding.update(updates, state, weights)
    new = optax.apply_updates(weights, rounded)
    assert new["w"].dtype == jnp.bfloat16 and new["gain"].dtype == jnp.float32
    values = np.asarray(new["w"], np.float32)
    assert set(np.unique(values)) == {1.0, 1.0 + 2.0**-7}
    assert abs(values.mean() - (1.0 + step)) < 5 * np.sqrt(0.125 * 0.875 / values.size) * 2.0**-7
    # the update's difference lands each weight on the stochastically rounded sum, bit for bit (count 0 -> its salt)
    salt = (jnp.uint32(0) * np.uint32(0x01000193)) ^ np.uint32(0x5BD1E995)
    want = stochastic_round_bf16(jnp.ones((100_000,), jnp.float32) + step, salt + np.uint32(1))  # "w" is leaf 1
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(new["gain"]), np.full((4,), 1.0 + step, np.float32))  # float32 unchanged
    # the next update draws other bits
    again, _ = rounding.update(updates, state, weights)
    assert not np.array_equal(np.asarray(optax.apply_updates(weights, again)["w"]), np.asarray(new["w"]))


def test_non_finite_updates_stay_non_finite_and_params_are_required():
    weights = {"w": jnp.array([1.0, 2.0, -3.0], jnp.bfloat16)}
    rounding = round_into_bf16_weights()
    rounded, _ = rounding.update({"w": jnp.array([jnp.nan, jnp.inf, 0.0], jnp.float32)}, rounding.init(weights), weights)
    new = np.asarray(optax.apply_updates(weights, rounded)["w"], np.float32)
    assert np.isnan(new[0]) and new[1] == np.inf and new[2] == -3.0
    with pytest.raises(ValueError, match="round_into_bf16_weights needs the weights"):
        rounding.update({"w": jnp.zeros(3)}, rounding.init(weights))


def test_weight_decay_below_the_spacing_decays_bf16_weights_as_float32_ones():
    """lr * wd = 1e-4 of each weight a step, a fortieth of bfloat16's relative spacing: float32 weights decay by
    1%, bfloat16 weights rounded to nearest never would, stochastically rounded ones do on average."""
    n = 20_000
    config = OptimConfig(learning_rate=1e-3, weight_decay=0.1, warmup_steps=0, decay_steps=10**6, grad_clip_norm=0.0)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        optimizer = make_optimizer(dataclasses.replace(config, weights_dtype=dtype))
        weights = {"dense": {"kernel": jnp.ones((n,), jnp.float32)}}
        state = optimizer.init(weights)
        weights = jax.tree.map(lambda w: w.astype(dtype), weights)
        zero = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights)

        @jax.jit
        def step(weights, state):
            updates, state = optimizer.update(zero, state, weights)
            return optax.apply_updates(weights, updates), state

        for _ in range(100):
            weights, state = step(weights, state)
        runs[dtype] = np.asarray(weights["dense"]["kernel"], np.float32)
    assert runs["bfloat16"].dtype == np.float32 and runs["float32"][0] == pytest.approx(0.9999**100, rel=1e-5)
    decay = 1.0 - runs["float32"][0]
    # Each step rounds a weight up with p = 1e-4 / 2^-8 (its spacing below 1), variance p (1 - p) 2^-16: over 100 steps
    # a weight's sd is about 0.0062 and the mean's over 20,000 weights 4.4e-5, so 5% of the decay (5e-4) is 11 sds.
    assert abs(runs["bfloat16"].mean() - runs["float32"][0]) < 0.05 * decay, (runs["bfloat16"].mean(), runs["float32"][0])
    assert np.unique(runs["bfloat16"]).size > 1  # rounded at random, not all alike


def test_weights_dtype_is_validated():
    with pytest.raises(ValueError, match=r"OptimConfig.weights_dtype must be one of \('float32', 'bfloat16'\), got 'float16'"):
        OptimConfig(weights_dtype="float16")


def _config(repo_root, weights_dtype: str, compute_dtype: str = "bfloat16"):
    config = load_config(str(repo_root / "configs" / "movielens_tiny.py"))
    model = dataclasses.replace(config.model, compute_dtype=compute_dtype, attention_implementation="xla")
    optim = dataclasses.replace(config.optim, weights_dtype=weights_dtype, moments_dtype="bfloat16", warmup_steps=0)
    return dataclasses.replace(config, model=model, optim=optim)


def _run(repo_root, weights_dtype: str, steps: int = 6):
    """`(training, states, losses)`: host copies of the train state before each step and after the last (the step
    donates its input), and each step's loss."""
    training, state = setup_training(_config(repo_root, weights_dtype))
    batches = training.dataset.train_iterator()
    states, losses = [jax.tree.map(np.asarray, state)], []
    for _ in range(steps):
        state, metrics = training.train_step(state, training.placement.put(next(batches)))
        states.append(jax.tree.map(np.asarray, state))
        losses.append(float(metrics["loss"]))
    return training, states, losses


@pytest.fixture(scope="module")
def runs(repo_root):
    return {dtype: _run(repo_root, dtype) for dtype in ("float32", "bfloat16")}


def test_the_state_keeps_the_cast_weights_in_bf16_and_no_copy(runs):
    (master, master_states, _), (training, states, _) = runs["float32"], runs["bfloat16"]
    master_state, state = master_states[-1], states[-1]
    setup = training.state
    narrow = set(setup.narrow_weights)
    shapes = {path_str(path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
    # every matrix the float32 run copies is kept in bfloat16; gains and biases keep their copy, the DHEN
    # experts' biases too, whose stacked `expert` dimension [E, out] does not make them matrices
    experts = {path for path in master.state.copied if "/mlp_expert/" in path}
    dims = {path: len(shapes[path]) - (path in experts) for path in master.state.copied}
    assert {path for path in experts if path.endswith("_bias")} and {path for path in experts if path.endswith("_kernel")} <= narrow
    assert narrow == {path for path in master.state.copied if dims[path] >= 2}
    assert set(setup.copied) == set(master.state.copied) - narrow and set(state.compute_params) == set(setup.copied)
    assert any(path.endswith("kernel") for path in narrow) and not any(path.endswith("embedding") for path in narrow)
    assert any(path.endswith("scale") for path in setup.copied) and all(dims[path] == 1 for path in setup.copied)
    assert all(path.endswith(("bias", "scale")) for path in setup.copied)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        assert leaf.dtype == (jnp.bfloat16 if path_str(path) in narrow else jnp.float32), path_str(path)
    abstract = {path_str(path): leaf.dtype for path, leaf in jax.tree_util.tree_leaves_with_path(setup.abstract.params)}
    assert all(abstract[path] == jnp.bfloat16 for path in narrow)
    # the optimizer state's shapes and moment dtypes are the float32 run's, plus the rounding's count
    moments = lambda s: [leaf.dtype for leaf in jax.tree.leaves(s) if leaf.ndim]  # noqa: E731
    assert moments(state.opt_state) == moments(master_state.opt_state)


def _bf16_spacing(x: np.ndarray) -> np.ndarray:
    """bfloat16's spacing at each value of float32 `x` (8 significant bits)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(x), np.finfo(np.float32).tiny)))
    return 2.0 ** (exponent - 7)


def test_a_bf16_weight_step_computes_what_the_float32_master_step_computes(runs):
    """The first step's forward uses the same bfloat16 weights (the float32 run's copy is their cast): the same first
    loss and gradients; the update then lands each bfloat16 weight on the master's within half a spacing of the
    starting weight (its first cast) and one of the result (the stochastic rounding), and the float32 leaves on the
    master's."""
    (_, master, master_losses), (training, states, losses) = runs["float32"], runs["bfloat16"]
    assert losses[0] == master_losses[0]
    # a coarse bound on the later losses (they drift apart as the roundings differ); the derived check is the weights'
    np.testing.assert_allclose(losses, master_losses, rtol=2e-2)
    one, one_master, start = states[1], master[1], master[0]
    narrow = set(training.state.narrow_weights)
    leaves = zip(jax.tree_util.tree_leaves_with_path(one.params), jax.tree.leaves(one_master.params), jax.tree.leaves(start.params), strict=True)
    for (path, got), want, first in leaves:
        got, want, first = (np.asarray(x, np.float32) for x in (got, want, first))
        if path_str(path) in narrow:
            bound = 0.5 * _bf16_spacing(first) + _bf16_spacing(np.maximum(np.abs(want), np.abs(got)))
            assert np.all(np.abs(got - want) <= bound), path_str(path)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=2 * np.spacing(np.abs(want).max()), err_msg=path_str(path))


NEEDS_BF16_STEP = (r"OptimConfig.weights_dtype='bfloat16' needs the step to compute in it, but ModelConfig.compute_dtype is "
                   r"'float32': set model.compute_dtype=bfloat16")


def test_bf16_weights_need_a_bf16_step(repo_root, tmp_path, capsys):
    """Refused when the config is built (a TrainConfig across its parts), and by `state_setup` for a caller
    passing the dtypes itself; `gem-train` refuses the override with exit 2, not a traceback."""
    with pytest.raises(ValueError, match=NEEDS_BF16_STEP):
        _config(repo_root, "bfloat16", compute_dtype="float32")
    config = load_config(str(repo_root / "configs" / "movielens_tiny.py"))
    with pytest.raises(config_tree.ConfigError, match=r"override 'optim.weights_dtype=bfloat16': " + NEEDS_BF16_STEP):
        config_tree.apply_overrides(config, ["optim.weights_dtype=bfloat16"])
    config_tree.apply_overrides(config, ["optim.weights_dtype=bfloat16", "model.compute_dtype=bfloat16"])  # the two together
    with pytest.raises(ValueError, match=NEEDS_BF16_STEP):
        state_setup(model_factory(setup_training(config, init_state=False)[0].dataset, config), make_optimizer(OptimConfig()),
                    make_mesh(config.topology), config.rules, weights_dtype="bfloat16")
    with pytest.raises(SystemExit) as exited:
        cli.train_main(["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(tmp_path / "run"),
                        "--set", "optim.weights_dtype=bfloat16", "--no-progress"])
    assert exited.value.code == 2
    assert re.search(NEEDS_BF16_STEP, capsys.readouterr().err) and not (tmp_path / "run").exists()


def test_a_stopped_bf16_weight_run_resumes_bit_for_bit_and_restores_bf16_weights(runs, repo_root, tmp_path):
    """A job stopped after step 4 and resumed logs the losses of the uninterrupted steps (the fixture's six, taken
    step by step from the same batches), bit for bit: the weights, moments and rounding count all restore."""
    config = _config(repo_root, "bfloat16")
    train_and_evaluate(config, tmp_path / "whole", stop_after_steps=4)  # checkpoints at 3 and 4 (the stop)
    train_and_evaluate(config, tmp_path / "whole")
    records = map(json.loads, (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines())
    assert [r["loss"] for r in records if r["kind"] == "train"] == runs["bfloat16"][2]
    restored = load_params(tmp_path / "whole")
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(restored.params)}
    assert dtypes == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
    # the record says so, and a restart with float32 weights is refused as another run
    record = json.loads((tmp_path / "whole" / run_record.RUN_FILE).read_text())
    assert record["config"]["optim"]["weights_dtype"] == "bfloat16"
    with pytest.raises(run_record.RunMismatchError, match="weights_dtype"):
        train_and_evaluate(_config(repo_root, "float32"), tmp_path / "whole")


def test_records_before_the_field_read_as_float32_weights():
    assert run_record.RECORDED_BEFORE_FIELD["config.optim.weights_dtype"] == "float32"
