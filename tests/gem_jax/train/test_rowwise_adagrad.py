"""The tables' Adagrad accumulator per row (`gem_jax.train.optimizer.rowwise_adagrad`) or per element.

Against a NumPy transcription of the update over several steps; the state's shapes and
dtype; which parameter a row accumulator mirrors; a checkpoint of the other accumulator is
refused on restore, not cast; and a run recorded before the choice existed reads as
element-wise. The accumulators' shardings on 8 fake devices are checked in
`tests/gem_jax/parallel/test_parallel_checkpoint.py`.
"""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.data.config import DataConfig
from gem_jax.pytree import mirrored_params
from gem_jax.train import config_tree, run_record
from gem_jax.train.checkpoint import CheckpointConfig, Checkpointer
from gem_jax.train.config import TrainConfig
from gem_jax.train.optimizer import OptimConfig, make_optimizer
from gem_jax.train.state import TrainState

LR, INIT, EPS = 0.05, 0.1, 1e-7  # OptimConfig's embedding_learning_rate; optax.adagrad's accumulator start and eps


def _accumulator(opt_state):
    return opt_state.inner_states["embedding"].inner_state[0].sum_of_squares


def _reference(table, grads, per_row, init=INIT):
    """Adagrad by hand: acc += g^2 (per element) or mean_d(g^2) (per row); row -= lr g / sqrt(acc + eps),
    0 where acc is 0."""
    table, acc = table.astype(np.float64), np.full(table.shape if not per_row else table.shape[:1], init)
    for g in grads:
        g = g.astype(np.float64)
        acc = acc + (np.mean(g**2, axis=1) if per_row else g**2)
        scale = np.where(acc > 0, 1.0 / np.sqrt(acc + EPS), 0.0)
        table = table - LR * g * (scale[:, None] if per_row else scale)
    return table, acc


@pytest.mark.parametrize("init", [INIT, 0.0])
@pytest.mark.parametrize("accumulator", ["row", "element"])
def test_the_update_matches_a_numpy_reference_over_steps(accumulator, init):
    rng = np.random.default_rng(0)
    rows, d, steps = 6, 4, 5
    table = rng.normal(size=(rows, d)).astype(np.float32)
    grads = [rng.normal(size=(rows, d)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(rows, 1)).astype(np.float32) for _ in range(steps)]
    for g in grads:
        g[4] = 0.0  # a row never looked up
    grads[1][0] = 0.0  # a row skipped for one step
    params = {"embed": {"t": {"embedding": jnp.asarray(table)}}}
    optimizer = make_optimizer(OptimConfig(embedding_accumulator=accumulator, embedding_initial_accumulator=init))
    state, p = optimizer.init(params), params
    acc0 = _accumulator(state)["embed"]["t"]["embedding"]
    assert acc0.dtype == jnp.float32 and acc0.shape == ((rows,) if accumulator == "row" else (rows, d))
    for g in grads:
        updates, state = optimizer.update({"embed": {"t": {"embedding": jnp.asarray(g)}}}, state, p)
        p = jax.tree.map(lambda a, b: a + b, p, updates)
    want_table, want_acc = _reference(table, grads, per_row=accumulator == "row", init=init)
    acc = _accumulator(state)["embed"]["t"]["embedding"]
    np.testing.assert_allclose(acc, want_acc, rtol=1e-6)
    np.testing.assert_allclose(p["embed"]["t"]["embedding"], want_table, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(p["embed"]["t"]["embedding"][4], table[4])  # zero gradients: row and
    np.testing.assert_array_equal(acc[4], np.float32(init))  # accumulator unchanged
    if accumulator == "row":  # every entry of a row scaled alike: the update is the gradient times one number per row
        last = np.asarray(updates["embed"]["t"]["embedding"]) / grads[-1]
        np.testing.assert_allclose(last[[0, 1, 2, 3, 5]], last[[0, 1, 2, 3, 5], :1] * np.ones((1, d)), rtol=1e-6)


def test_the_accumulator_is_validated_and_the_default_is_per_row():
    assert OptimConfig().embedding_accumulator == "row" and OptimConfig().embedding_initial_accumulator == INIT
    with pytest.raises(ValueError, match=r"OptimConfig.embedding_accumulator must be one of \('row', 'element'\), got 'rows'"):
        OptimConfig(embedding_accumulator="rows")
    with pytest.raises(ValueError, match="embedding_initial_accumulator"):
        OptimConfig(embedding_initial_accumulator=-0.1)


def test_a_row_accumulator_mirrors_its_table_and_nothing_else():
    params = {"embed": {"t": {"embedding": jnp.zeros((8, 3))}}, "w": jnp.zeros((8,)), "bias": jnp.zeros((3,))}
    state = make_optimizer(OptimConfig()).init(params)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    mirrors = {jax.tree_util.keystr(path): keys for (path, _), keys in zip(leaves, mirrored_params(state, params))}
    rows = [k for k in mirrors if "sum_of_squares" in k]
    assert len(rows) == 1 and mirrors[rows[0]] == ("embed", "t", "embedding")
    # The dense parameters' Adam moments mirror them whole; "w" (shape (8,)) is no row accumulator of anything.
    assert sorted(keys for keys in mirrors.values() if keys) == [("bias",), ("bias",), ("embed", "t", "embedding"), ("w",), ("w",)]


def _state(accumulator):
    params = {"dense": {"kernel": jnp.ones((8, 4))}, "embed": {"item": {"embedding": jnp.arange(64.0).reshape(16, 4)}}}
    opt = make_optimizer(OptimConfig(embedding_accumulator=accumulator))
    return TrainState(step=jnp.ones((), jnp.int32), params=params, opt_state=opt.init(params))


def _data():
    return iter(grain.MapDataset.range(10).to_iter_dataset())


@pytest.mark.parametrize("saved, target", [("element", "row"), ("row", "element")])
def test_a_checkpoint_of_the_other_accumulator_is_refused_not_cast(tmp_path, saved, target):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every_steps=1))
    checkpointer.save(1, _state(saved), _data(), force=True)
    checkpointer.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(target))
    reader = Checkpointer(tmp_path, CheckpointConfig(every_steps=1), read_only=True)
    try:
        with pytest.raises(ValueError, match=r"Requested shape: \(16(, 4)?,?\) is not compatible with the stored shape"):
            reader.restore_state(1, abstract)
    finally:
        reader.close()


def test_a_run_recorded_before_the_choice_reads_as_element_wise(tmp_path):
    config = TrainConfig(data=DataConfig())
    record = run_record.make_record(config, {}, None)
    del record["config"]["optim"]["embedding_accumulator"]
    run_record.write_record(tmp_path, record)
    with pytest.raises(run_record.RunMismatchError, match=r"config.optim.embedding_accumulator: recorded 'element', now 'row'"):
        run_record.check_run(tmp_path, run_record.make_record(config, {}, None), has_checkpoints=True, write=False)
    element = config_tree.apply_overrides(config, ["optim.embedding_accumulator=element"])
    kept = run_record.check_run(tmp_path, run_record.make_record(element, {}, None), has_checkpoints=True, write=False)
    assert config_tree.from_tree(TrainConfig, kept["config"]).optim.embedding_accumulator == "element"
    assert config_tree.from_tree(TrainConfig, kept["config"]).optim.embedding_initial_accumulator == INIT
