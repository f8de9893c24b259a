"""Row-wise updates of unsharded tables (`gem_jax.train.sparse_tables`) equal the dense Adagrad path.

End to end on the tiny MovieLens model with either Adagrad accumulator, per row and per
element (3 steps, sparse vs dense: parameters, optimizer state, grad_norm; untouched rows
and their accumulators bit-identical; no table-shaped gradient in the step), and piece by piece: the lookup's row deltas under every `OutOfRange` policy, the
unique-id sums, and one optimizer step on a toy tree with duplicates, id 0 and
rejected ids.
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from gem_jax.nn import embeddings
from gem_jax import shard_context as context
from gem_jax.nn.embeddings import Generation, OutOfRange, TableSharding
from gem_jax.train import sparse_tables
from gem_jax.train.config import load_config
from gem_jax.train.optimizer import OptimConfig, make_optimizer
from gem_jax.train.setup import setup_training

STEPS = 3
ITEM = "embed/item"


def _table_shaped(jaxpr, shape, counts):
    """Counts, by primitive, the equations (nested jaxprs included) with a float output of `shape`."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if getattr(var.aval, "shape", None) == shape and jnp.issubdtype(var.aval.dtype, jnp.floating):
                counts[eqn.primitive.name] += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
                    _table_shaped(getattr(sub, "jaxpr", sub), shape, counts)
    return counts


def _item_accumulator(state):
    """The item table's Adagrad accumulator: `[rows]` (per row) or `[rows, d]` (per element)."""
    return state.opt_state.inner_states["embedding"].inner_state[0].sum_of_squares["embed"]["item"]["embedding"]


@pytest.fixture(scope="module", params=["row", "element"])
def runs(request):
    """Per mode (sparse, dense): initial and final state, grad norms, the step's table-shaped ops, the row-wise tables."""
    config = load_config("configs/movielens_tiny.py")
    out = {}
    for sparse in (True, False):
        optim = dataclasses.replace(config.optim, sparse_embedding_updates=sparse, embedding_accumulator=request.param)
        training, state = setup_training(dataclasses.replace(config, optim=optim))
        iterator = training.dataset.train_iterator()
        batches = [training.placement.put(next(iterator)) for _ in range(STEPS)]
        model = training.state.sharded_model()
        probe = jax.eval_shape(lambda p, b: model.loss_with_rows(p, b)[1][3], state.params, batches[0])
        tables = sparse_tables.row_wise_tables(state.params, probe)
        shape = state.params["embed"]["item"]["embedding"].shape
        ops = _table_shaped(jax.make_jaxpr(training.train_step)(state, batches[0]).jaxpr, shape, collections.Counter())
        initial = jax.device_get(state)
        norms = []
        for batch in batches:
            state, metrics = training.train_step(state, batch)
            norms.append(float(metrics["grad_norm"]))
        out[sparse] = {"initial": initial, "final": jax.device_get(state), "norms": norms, "ops": ops, "tables": sorted(tables.values())}
    out["accumulator"] = request.param
    return out


def test_the_large_unsharded_tables_are_row_wise(runs):
    # item (10240 rows) and user (1024 rows) see ~1.1k and 64 ids per step; the others have fewer rows than ids.
    assert runs[True]["tables"] == [ITEM, "embed/user/user"]


def test_sparse_steps_match_dense_steps(runs):
    got, want = runs[True]["final"], runs[False]["final"]
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        # float32 row sums in another order (segment sums against a scatter-add): a few u of each row's sum.
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(runs[True]["norms"], runs[False]["norms"], rtol=1e-6)


def test_untouched_rows_stay_bit_identical(runs):
    start, dense = runs[True]["initial"], runs[False]["final"]
    acc0, table0 = _item_accumulator(start), start.params["embed"]["item"]["embedding"]
    # Rows the dense path left as they were: zero gradient in every step. (A row's accumulator alone
    # does not tell: 0.1 plus a mean square below 0.1 * 2^-24 rounds back to 0.1.)
    same_acc = (_item_accumulator(dense) == acc0).reshape(acc0.shape[0], -1).all(axis=1)
    untouched = same_acc & np.all(dense.params["embed"]["item"]["embedding"] == table0, axis=1)
    assert 0 < untouched.sum() < untouched.size - 100
    final = runs[True]["final"]
    acc, table = _item_accumulator(final), final.params["embed"]["item"]["embedding"]
    np.testing.assert_array_equal(table[untouched], table0[untouched])
    np.testing.assert_array_equal(acc[untouched], acc0[untouched])
    np.testing.assert_array_equal(acc[untouched], np.float32(0.1))  # optax's initial accumulator value, never grown
    assert not np.array_equal(table[~untouched], table0[~untouched])


def test_sparse_step_forms_no_table_shaped_gradient(runs):
    # Only the scatters of the new rows into the parameter and (per element) the accumulator produce the item table's shape.
    assert set(runs[True]["ops"]) <= {"scatter", "stop_gradient", "jit", "pjit"}, runs[True]["ops"]
    assert runs[True]["ops"]["scatter"] == (1 if runs["accumulator"] == "row" else 2)
    assert runs[False]["ops"]["scatter-add"] >= 1  # the dense path's gradient, which the check would see


@pytest.mark.parametrize("policy", list(OutOfRange))
def test_lookup_row_deltas_are_the_dense_row_gradients(policy):
    rng = np.random.default_rng(0)
    num_rows, d = 6, 3
    table = jnp.asarray(rng.normal(size=(embeddings.padded_table_rows(num_rows), d)), jnp.float32)
    ids = jnp.asarray([3, 3, 0, -1, 7, 2, 0], jnp.int32)  # duplicates, padding id 0, two out-of-range ids
    weights = jnp.asarray(rng.normal(size=(ids.shape[0], d)), jnp.float32)
    placement = embeddings.place_table("t", num_rows, table.shape[0], TableSharding(Generation.REPLICATED, policy), {})

    def loss(table, delta):
        rows = context.TableRows(None if delta is None else {"t": [delta]})
        with context.shard_context({}, rows=rows):
            out = embeddings.lookup(table, ids, num_rows, placement)
        return jnp.sum(jnp.sin(out) * weights), rows.ids["t"][0]

    dense = jax.grad(lambda t: loss(t, None)[0])(table)
    (value, recorded), (table_grad, row_grads) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(table, jnp.zeros((ids.shape[0], d)))
    assert float(value) == pytest.approx(float(loss(table, None)[0]), rel=1e-6)
    np.testing.assert_array_equal(table_grad, 0)  # the table itself is not differentiated
    hashed = embeddings.apply_id_policy(ids, num_rows, OutOfRange.HASH)[0]
    want_ids = np.where((ids >= 0) & (ids < num_rows), ids, hashed if policy is OutOfRange.HASH else table.shape[0])
    np.testing.assert_array_equal(recorded, want_ids)
    summed = np.zeros_like(np.asarray(dense))
    np.add.at(summed, np.asarray(recorded)[np.asarray(recorded) < table.shape[0]], np.asarray(row_grads)[np.asarray(recorded) < table.shape[0]])
    np.testing.assert_allclose(summed, dense, rtol=1e-6, atol=1e-7)  # float32 sums of a few rows in another order: a few u
    if policy is not OutOfRange.HASH:
        np.testing.assert_array_equal(row_grads[3:5], 0)  # rejected ids: no gradient


def test_unique_row_sums():
    ids = jnp.asarray([5, 0, 5, 9, 2, 0, 9], jnp.int32)  # 9 is the fill (rejected ids)
    grads = jnp.arange(14, dtype=jnp.float32).reshape(7, 2)
    rows, sums = sparse_tables.unique_row_sums(ids, grads, 9)
    np.testing.assert_array_equal(rows, [0, 2, 5, 9, 9, 9, 9])
    want = np.zeros((7, 2), np.float32)
    want[0], want[1], want[2], want[3] = grads[1] + grads[5], grads[4], grads[0] + grads[2], grads[3] + grads[6]
    np.testing.assert_array_equal(sums, want)


@pytest.mark.parametrize("accumulator", ["row", "element"])
def test_sparse_update_equals_the_dense_optimizer_step(accumulator):
    rng = np.random.default_rng(1)
    rows_, d = 32, 4
    params = {"embed": {"t": {"embedding": jnp.asarray(rng.normal(size=(rows_, d)), jnp.float32)}}, "w": jnp.ones((d,))}
    optimizer = make_optimizer(OptimConfig(embedding_accumulator=accumulator))
    dense_params, sparse_params = params, params
    dense_state = sparse_state = optimizer.init(params)
    for step in range(STEPS):
        ids = jnp.asarray(np.concatenate([[0, 0, rows_, rows_], rng.integers(0, 8, size=6)]), jnp.int32)  # id 0, fill, duplicates
        row_grads = jnp.asarray(rng.normal(size=(ids.shape[0], d)), jnp.float32).at[2:4].set(0.0)  # the fill's gradients are zero
        w_grad = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
        table_grad = jnp.zeros((rows_, d)).at[ids].add(row_grads, mode="drop")
        updates, dense_state = optimizer.update({"embed": {"t": {"embedding": table_grad}}, "w": w_grad}, dense_state, dense_params)
        dense_params = jax.tree.map(lambda p, u: p + u, dense_params, updates)
        uid, sums = sparse_tables.unique_row_sums(ids, row_grads, rows_)
        grads = sparse_tables.SparseGrads({"embed": {"t": {"embedding": sums}}, "w": w_grad}, {0: uid})
        sparse_params, sparse_state = sparse_tables.apply_sparse_updates(optimizer, grads, sparse_params, sparse_state)
    for got, want in zip(jax.tree.leaves((sparse_params, sparse_state)), jax.tree.leaves((dense_params, dense_state))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # as above, then the same elementwise update
    untouched = slice(8, rows_)
    np.testing.assert_array_equal(sparse_params["embed"]["t"]["embedding"][untouched], params["embed"]["t"]["embedding"][untouched])
    accumulator_leaf = sparse_state.inner_states["embedding"].inner_state[0].sum_of_squares["embed"]["t"]["embedding"]
    assert accumulator_leaf.shape == ((rows_,) if accumulator == "row" else (rows_, d))
    np.testing.assert_array_equal(accumulator_leaf[untouched], np.float32(0.1))


def test_the_switch_is_a_bool():
    with pytest.raises(TypeError, match="OptimConfig.sparse_embedding_updates must be a bool"):
        OptimConfig(sparse_embedding_updates=1)


def test_table_rows_record_ids_and_refuse_mismatched_deltas():
    probe = context.TableRows(deltas=None)
    assert probe.take("embed/item", jnp.arange(3)) is None
    assert [ids.tolist() for ids in probe.ids["embed/item"]] == [[0, 1, 2]]

    delta = jnp.zeros((3, 4))
    rows = context.TableRows(deltas={"embed/item": [delta]})
    assert rows.take("embed/user/user", jnp.arange(2)) is None  # a table without deltas: ids recorded only
    assert rows.take("embed/item", jnp.arange(3)) is delta
    with pytest.raises(ValueError, match=r"'embed/item': lookup 2 has no row delta \(only 1 were traced\)"):
        rows.take("embed/item", jnp.arange(3))
    with pytest.raises(ValueError, match="lookup 1 has 5 ids but a delta of 3 rows"):
        context.TableRows(deltas={"embed/item": [delta]}).take("embed/item", jnp.arange(5))
