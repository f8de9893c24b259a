"""Row-wise updates of unsharded embedding tables: no dense table gradient, no dense optimizer pass.

Differentiating `table[ids]` forms a dense `[rows, d]` gradient (a zero fill and a
scatter-add), and a dense optimizer step then reads and writes every row of the
parameter and its state, although a step touches at most its `n` looked-up rows. For
each unsharded table (placement REPLICATED: every table on one device) whose step
looks up fewer ids than it has rows, the step here instead:

1. differentiates the loss w.r.t. a zero row delta per lookup
   (`gem_jax.shard_context.TableRows`), not w.r.t. the table;
2. sums the row gradients of each distinct id (`jnp.unique` with a static size, then
   `segment_sum`);
3. runs the unchanged optax optimizer on a *row view* of the train state, in which
   each such table, its gradient and the state leaves that mirror it (the Adagrad
   accumulator: `[rows, d]` element-wise, `[rows]` row-wise) are replaced by those
   rows, and scatters the new rows back.

This equals the dense update exactly when the tables' optimizer is row-wise: each
row's new parameter and state depend only on that row's gradient, state and
parameter, and a zero gradient leaves both unchanged. Adagrad without weight decay
is, with either accumulator of `gem_jax.train.optimizer` (`optax.adagrad`, one per
element; `rowwise_adagrad`, one per row); Adam is not (its moments decay on untouched
rows).
The technique is TensorFlow's `SparseApplyAdagrad` over `IndexedSlices` gradients, and
PyTorch's `nn.Embedding(sparse=True)` whose sparse gradients `torch.optim.Adagrad`
applies to the touched rows only.

The optimizer state keeps its structure and shardings (checkpoints are unchanged), and
the metric `grad_norm` is the dense gradient's norm (a distinct row's summed gradient
is that row of the dense gradient). Ids the table's `OutOfRange` policy rejects carry
the id `rows`, one past the last parameter row: their gather is zero-filled and their
scatter dropped, so they update nothing; the unused slots of the static unique-id
buffer carry it too. Sharded tables keep the dense gradient of their shard
(`gem_jax.nn.embeddings`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from gem_jax.batch import Batch
from gem_jax.nn.layers import EMBEDDING_PARAM
from gem_jax.parallel.spmd import ShardedModel
from gem_jax.pytree import mirrored_params, path_keys, path_str


@dataclasses.dataclass(frozen=True)
class SparseGrads:
    """A step's gradients with row-wise tables.

    Attributes:
      grads: the parameter tree's gradients; a row-wise table's leaf holds float
        `[n, d]`: the summed gradient of each row in `rows` (zero in unused slots).
      rows: by leaf index (`jax.tree.leaves(params)` order), int32 `[n]` distinct rows of
        each row-wise table, padded with the table's row count.
    """

    grads: dict
    rows: dict[int, jax.Array]


def unique_row_sums(ids: jax.Array, grads: jax.Array, fill: int) -> tuple[jax.Array, jax.Array]:
    """Sums the gradient rows of equal ids.

    Args:
      ids: int32 `[n]` rows, `fill` for none.
      grads: float `[n, d]`, one gradient row per id.
      fill: an id past every real row.

    Returns:
      `(rows, sums)`: int32 `[n]` the distinct ids in ascending order, then `fill`;
      float `[n, d]` the summed gradient of each (the `fill` slot's sum is that of the
      `fill` ids, zero when they had zero gradients; unused slots are zero).
    """
    n = ids.shape[0]
    rows, inverse = jnp.unique(ids, size=n, fill_value=fill, return_inverse=True)
    return rows, jax.ops.segment_sum(grads, inverse.reshape(n), num_segments=n)


def row_wise_tables(params: dict, lookup_ids: dict[str, list]) -> dict[int, str]:
    """The tables to update row by row: leaf index -> table name.

    A table recorded by the shape probe (an unsharded one) qualifies when its step
    looks up at least one and fewer ids than it has rows (otherwise the dense
    gradient is no larger than the row gradients).

    Args:
      params: the parameter tree.
      lookup_ids: the probe's ids by table name (`ShardedModel.loss_with_rows`), shapes only.
    """
    index = {path_str(path): i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(params))}
    leaves = jax.tree.leaves(params)
    tables = {}
    for name, ids in lookup_ids.items():
        i = index[f"{name}/{EMBEDDING_PARAM}"]
        if 0 < sum(x.size for x in ids) < leaves[i].shape[0]:
            tables[i] = name
    return tables


def sparse_value_and_grad(model: ShardedModel, params: dict, batch: Batch):
    """The loss and its gradients, row-wise for the unsharded tables that qualify (`row_wise_tables`).

    Args:
      model: the sharded model (`StateSetup.sharded_model()`).
      params: the parameter tree, as `TrainState.params`.
      batch: a stacked per-device batch (`BatchPlacement.put`).

    Returns:
      `((loss, (bce [K], stats)), SparseGrads)`, loss and metrics as `ShardedModel.loss`.
    """
    probe = jax.eval_shape(lambda p, b: model.loss_with_rows(p, b)[1][3], params, batch)
    tables = row_wise_tables(params, probe)
    values, treedef = jax.tree.flatten(params)
    dense = {i: v for i, v in enumerate(values) if i not in tables}
    deltas = {name: [jnp.zeros((*x.shape, values[i].shape[1]), values[i].dtype) for x in probe[name]] for i, name in tables.items()}

    def loss_fn(dense, deltas):
        full = treedef.unflatten([dense[i] if i in dense else v for i, v in enumerate(values)])
        loss, (bce, stats, _, ids) = model.loss_with_rows(full, batch, deltas)
        return loss, (bce, stats, ids)

    (loss, (bce, stats, ids)), (dense_grads, delta_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(dense, deltas)
    grads, rows = dict(dense_grads), {}
    for i, name in tables.items():
        d = values[i].shape[1]
        flat_ids = jnp.concatenate([x.reshape(-1) for x in ids[name]])
        flat_grads = jnp.concatenate([g.reshape(-1, d) for g in delta_grads[name]])
        rows[i], grads[i] = unique_row_sums(flat_ids, flat_grads, values[i].shape[0])
    return (loss, (bce, stats)), SparseGrads(treedef.unflatten([grads[i] for i in range(len(values))]), rows)


def apply_sparse_updates(optimizer: optax.GradientTransformation, grads: SparseGrads, params: dict, opt_state):
    """One optimizer step with row-wise tables (see the module docstring).

    Args:
      optimizer: the train optimizer; row-wise on the tables of `grads.rows`.
      grads: from `sparse_value_and_grad`.
      params, opt_state: the current parameters and optimizer state.

    Returns:
      `(params, opt_state)` after the step, with the structures (and, under `jit`
      with the state's shardings, the shardings) of the inputs.
    """
    rows = grads.rows
    param_leaves, param_def = jax.tree.flatten(params)
    state_leaves, state_def = jax.tree.flatten(opt_state)
    index = {path_keys(path): i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(params))}
    # The rows of the row-wise table each leaf is (parameters) or mirrors (the Adagrad accumulator, per element or
    # per row), or None.
    param_rows = [rows.get(i) for i in range(len(param_leaves))]
    state_rows = [None if keys is None else rows.get(index[keys]) for keys in mirrored_params(opt_state, params)]

    def view(leaf, r):
        return leaf if r is None else leaf.at[r].get(mode="fill", fill_value=0)

    def scatter(leaf, new, r):
        return new if r is None else leaf.at[r].set(new, mode="drop")

    param_view = param_def.unflatten([view(x, r) for x, r in zip(param_leaves, param_rows)])
    state_view = state_def.unflatten([view(x, r) for x, r in zip(state_leaves, state_rows)])
    updates, new_state_view = optimizer.update(grads.grads, state_view, param_view)
    new_param_view = jax.tree.leaves(optax.apply_updates(param_view, updates))
    new_params = [scatter(x, new, r) for x, new, r in zip(param_leaves, new_param_view, param_rows)]
    new_state = [scatter(x, new, r) for x, new, r in zip(state_leaves, jax.tree.leaves(new_state_view), state_rows)]
    return param_def.unflatten(new_params), state_def.unflatten(new_state)
