"""The jitted train and eval steps over stacked per-device batches (`gem_jax.parallel`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from gem_jax.batch import Batch
from gem_jax.parallel.placement import BatchPlacement
from gem_jax.train import sparse_tables
from gem_jax.train.state import StateSetup, TrainState, compute_params, forward_params


def make_train_step(
    setup: StateSetup, optimizer: optax.GradientTransformation, placement: BatchPlacement, *, sparse_embedding_updates: bool = True
) -> Callable:
    """`train_step(state, batch) -> (state, metrics)`, jitted with donation of `state`.

    `batch` is a stacked per-device batch (`placement.put(host_batch)`). The loss is
    the sum over tasks of the weighted mean BCE over the global batch. Metrics (float32
    scalars or `[K]`): loss, per-task BCE, the weight of the batch's real examples
    (`examples`) and per task of its positives and negatives (`positives`, `negatives`:
    a log window's NE is pooled from them, `gem_jax.train.window`), the global gradient norm; int32 lookup counters `<table>/out_of_range` and
    `<table>/overflow` (check them with `gem_jax.nn.embeddings.check_lookup_stats`),
    and for sharded tables `<table>/sent_rows` (int32) and `<table>/sent_bytes` (float32).

    The forward uses `state.compute_params` in place of the weights they copy
    (`gem_jax.train.state.forward_params`); their gradients are widened to the weights'
    dtype, the values the cast's own derivative gives, and the step writes the next copy.
    Gradients of weights kept in bfloat16 (`OptimConfig.weights_dtype`) are widened to
    float32 for the optimizer, which rounds its update back into them.

    With `sparse_embedding_updates`, unsharded tables are updated row by row
    (`gem_jax.train.sparse_tables`: the same update, without a dense table gradient);
    `optimizer` must then be row-wise on the tables (`gem_jax.train.optimizer`'s is).
    """
    model = setup.sharded_model()

    def train_step(state: TrainState, batch: Batch):
        forward = forward_params(state)
        if sparse_embedding_updates:
            (loss, (bce, stats)), sparse = sparse_tables.sparse_value_and_grad(model, forward, batch)
            grads = as_update_dtypes(sparse.grads, state.params)
            params, opt_state = sparse_tables.apply_sparse_updates(optimizer, dataclasses.replace(sparse, grads=grads), state.params, state.opt_state)
        else:
            (loss, (bce, stats, _)), grads = jax.value_and_grad(model.loss, has_aux=True)(forward, batch)
            grads = as_update_dtypes(grads, state.params)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        labels, weights = batch.labels.reshape(-1, batch.labels.shape[-1]), batch.weights.reshape(-1)
        out = {
            "loss": loss,
            "bce": bce,
            "examples": weights.sum(),
            "positives": (weights[:, None] * labels).sum(0),
            "negatives": (weights[:, None] * (1 - labels)).sum(0),
            "grad_norm": optax.tree.norm(grads),
            **stats,
        }
        copies = compute_params(params, setup.copied, setup.compute_dtype)  # written by the update's pass
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state, compute_params=copies), out

    return jax.jit(
        train_step, in_shardings=(setup.shardings, placement.sharding), out_shardings=(setup.shardings, None), donate_argnums=0
    )


def as_update_dtypes(grads: dict, params: dict) -> dict:
    """`grads` with every leaf in its parameter's dtype widened to at least float32: a copied weight's gradient
    arrives in the copy's dtype, a bfloat16 weight's in bfloat16, and the optimizer computes in float32."""
    return jax.tree.map(lambda g, p: g.astype(jnp.promote_types(p.dtype, jnp.float32)), grads, params)


def make_eval_step(setup: StateSetup, placement: BatchPlacement) -> Callable:
    """`eval_step(params, batch) -> dict`, jitted; every output replicated on every device, examples in global order.

    The dict holds `logits` float32 `[B, K]` and the batch's `labels` float32
    `[B, K]`, `weights` float32 `[B]` and `candidate_item` int32 `[B]`: in a
    multi-process run each process builds only its part of the batch, so the
    metrics are computed from these outputs, which every process holds whole.
    """
    model = setup.sharded_model()
    replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())

    def eval_step(params, batch: Batch) -> dict[str, jax.Array]:
        labels = batch.labels
        return {
            "logits": model.logits(params, batch),
            "labels": labels.reshape(-1, labels.shape[-1]),
            "weights": batch.weights.reshape(-1),
            "candidate_item": batch.candidate_item.reshape(-1),
        }

    return jax.jit(eval_step, in_shardings=(setup.shardings.params, placement.sharding), out_shardings=replicated)
