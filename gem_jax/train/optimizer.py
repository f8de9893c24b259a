"""Optimizers: AdamW for dense parameters, Adagrad for embedding tables.

Embedding rows are touched sparsely, so they get Adagrad (Duchi et al., 2011), the usual
choice for recommendation embeddings (DLRM, TorchRec); dense weights get AdamW
(Loshchilov & Hutter, 2019) with linear warm-up and cosine decay.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import optax

from gem_jax.checks import check_bool, check_float, check_int
from gem_jax.nn.layers import EMBEDDING_PARAM
from gem_jax.pytree import path_keys


class ParamGroup(enum.StrEnum):
    DENSE = "dense"
    EMBEDDING = "embedding"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings.

    Attributes:
      learning_rate: peak AdamW learning rate of dense parameters.
      warmup_steps: linear warm-up steps to the peak.
      decay_steps: cosine decay length after warm-up (to 10% of the peak).
      weight_decay: AdamW decoupled weight decay (dense only).
      embedding_learning_rate: Adagrad learning rate of embedding tables.
      grad_clip_norm: global gradient-norm clip of the dense group (0 disables).
      sparse_embedding_updates: update unsharded tables row by row, only the rows a
        step looks up (`gem_jax.train.sparse_tables`): the same Adagrad update
        without a dense table gradient and a dense optimizer pass over every row.
        False differentiates and updates the whole table (the reference path).
        Sharded tables always take the dense gradient of their shard.
    """

    learning_rate: float = 2e-3
    warmup_steps: int = 50
    decay_steps: int = 1000
    weight_decay: float = 1e-4
    embedding_learning_rate: float = 0.05
    grad_clip_norm: float = 1.0
    sparse_embedding_updates: bool = True

    def __post_init__(self):
        check_float(self, "learning_rate", positive=True)
        check_int(self, "warmup_steps", minimum=0)
        check_int(self, "decay_steps", minimum=1)
        check_float(self, "weight_decay", minimum=0.0)
        check_float(self, "embedding_learning_rate", positive=True)
        check_float(self, "grad_clip_norm", minimum=0.0)
        check_bool(self, "sparse_embedding_updates")


def learning_rate_schedule(config: OptimConfig) -> optax.Schedule:
    """The dense learning rate by step: linear warm-up from 0 to the peak, cosine decay to 10% of it.

    Step `k` (0-based count of updates before it) is the rate the `k+1`-th update uses.
    """
    return optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, config.warmup_steps + config.decay_steps, config.learning_rate * 0.1
    )


def param_group(path: tuple) -> ParamGroup:
    """EMBEDDING for embedding-table parameters (named `EMBEDDING_PARAM`), else DENSE."""
    return ParamGroup.EMBEDDING if EMBEDDING_PARAM in path_keys(path) else ParamGroup.DENSE


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """A `multi_transform` routing each parameter to its group's optimizer."""
    dense = [optax.adamw(learning_rate_schedule(config), weight_decay=config.weight_decay)]
    if config.grad_clip_norm:
        dense.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
    return optax.multi_transform(
        {ParamGroup.DENSE: optax.chain(*dense), ParamGroup.EMBEDDING: optax.adagrad(config.embedding_learning_rate)},
        lambda params: jax.tree_util.tree_map_with_path(lambda path, _: param_group(path), params),
    )
