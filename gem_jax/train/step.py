"""The jitted train and eval steps."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax.data.batch import Batch
from gem_jax.train import metrics
from gem_jax.train.state import StateSetup, TrainState


def make_train_step(setup: StateSetup, optimizer: optax.GradientTransformation, batch_sharding) -> Callable:
    """`train_step(state, batch) -> (state, metrics)`, jitted with donation of `state`.

    The loss is the sum over tasks of the weighted mean BCE. Metrics (all float32
    scalars or `[K]`): loss, per-task BCE and NE against the batch's base rate, and the
    global gradient norm.
    """

    def loss_fn(params, batch: Batch):
        logits = nnx.merge(setup.graphdef, params)(batch)
        bce = metrics.weighted_bce(logits, batch.labels, batch.weights)
        return bce.sum(), bce

    def train_step(state: TrainState, batch: Batch):
        (loss, bce), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        base_rate = (batch.weights[:, None] * batch.labels).sum(0) / jnp.maximum(batch.weights.sum(), 1.0)
        out = {
            "loss": loss,
            "bce": bce,
            "ne": metrics.normalized_entropy(bce, base_rate),
            "grad_norm": optax.global_norm(grads),
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), out

    return jax.jit(train_step, in_shardings=(setup.shardings, batch_sharding), out_shardings=(setup.shardings, None), donate_argnums=0)


def make_eval_step(setup: StateSetup, batch_sharding) -> Callable:
    """`eval_step(params, batch) -> logits [B, K]` (float32), jitted."""

    def eval_step(params, batch: Batch):
        return nnx.merge(setup.graphdef, params)(batch)

    return jax.jit(eval_step, in_shardings=(setup.shardings.params, batch_sharding))
