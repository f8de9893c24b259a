"""Train state, created already sharded: abstract shapes first, then a sharded init.

`jax.eval_shape` gives the state's shapes without allocating; the model's logical axis
annotations and the config's rules give each leaf a `NamedSharding`; the init is then
jitted with those `out_shardings`, so no device ever holds an unsharded copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax import struct
from jax.sharding import Mesh

from gem_jax.parallel import rules as rules_lib


@struct.dataclass
class TrainState:
    """Everything a training step updates.

    Attributes:
      step: int32 scalar, optimizer steps taken.
      params: the model's parameters as a nested dict of arrays (`nnx.to_pure_dict`).
      opt_state: the optax state of `params`.
    """

    step: jax.Array
    params: dict
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class StateSetup:
    """The static pieces around a `TrainState`.

    Attributes:
      graphdef: the model's structure; `nnx.merge(graphdef, params)` rebuilds it.
      shardings: a `TrainState` of `NamedSharding`s.
      abstract: a `TrainState` of `jax.ShapeDtypeStruct`s carrying those shardings
        (the restore target for checkpoints).
    """

    graphdef: nnx.GraphDef
    shardings: TrainState
    abstract: TrainState


def create_train_state(
    model_factory: Callable[[nnx.Rngs], nnx.Module],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: rules_lib.Rules,
    seed: int,
) -> tuple[TrainState, StateSetup]:
    """Initialises the model and optimizer state sharded over `mesh`.

    Args:
      model_factory: builds the model from `nnx.Rngs` (parameters must carry
        logical axis names, see `gem_jax.model.layers`).
      optimizer: the optax transformation.
      mesh, rules: where each logical axis goes.
      seed: parameter-init seed; the same seed gives the same parameters on any mesh.
    """
    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(lambda: model_factory(nnx.Rngs(seed)))
    graphdef, abstract_params = nnx.split(abstract_model)
    param_shardings = nnx.to_pure_dict(rules_lib.param_shardings(abstract_params, mesh, rules))

    def init() -> TrainState:
        with nnx.use_eager_sharding(False):
            params = nnx.to_pure_dict(nnx.split(model_factory(nnx.Rngs(seed)))[1])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    abstract = jax.eval_shape(init)
    replicated = rules_lib.replicated(mesh)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract.opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    state = jax.jit(init, out_shardings=shardings)()
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return state, StateSetup(graphdef=graphdef, shardings=shardings, abstract=abstract)
