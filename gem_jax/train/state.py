"""Train state, created already sharded: abstract shapes first, then a sharded init.

`jax.eval_shape` gives the state's shapes without allocating; the model's logical axis
annotations and the config's rules give each leaf a `NamedSharding`; the init is then
jitted with those `out_shardings`, so no device ever holds an unsharded copy.

With a compute dtype narrower than the parameters' (bfloat16 steps of float32 weights), the
state may keep the dense weights' compute-dtype copy between steps (`TrainState.compute_params`):
the float32 master weights of mixed-precision training (Micikevicius et al., 2018, "Mixed
Precision Training"), whose low-precision copy the optimizer's pass writes as it updates them
(as Apex's and DeepSpeed's fused optimizers do), instead of every step's forward reading the
float32 weights again to cast them (`gem_jax.parallel.spmd.gather_param`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gem_jax.nn.layers import EmbeddingTable
from gem_jax.parallel import rules as rules_lib
from gem_jax.pytree import mirrored_params, mirrors_rows, path_keys, path_str
from gem_jax.parallel.spmd import ShardedModel, cast_param_paths
from gem_jax.train.optimizer import check_weights_dtype


@struct.dataclass
class TrainState:
    """Everything a training step updates.

    Attributes:
      step: int32 scalar, optimizer steps taken.
      params: the model's parameters as a nested dict of arrays (`nnx.to_pure_dict`): float32, but
        the compute dtype for the weights of `StateSetup.narrow_weights`.
      opt_state: the optax state of `params`.
      compute_params: None, or the compute-dtype copy of `params`' dense weights, by
        parameter path (`"seq/layers/0/mlp/up/kernel"`: `StateSetup.copied`), each
        `params`' leaf cast (round to nearest) with its sharding: what the step's forward
        uses in their place. Derived from `params`, so never checkpointed (`checkpointed`)
        and rebuilt on restore (`SavedState.train_state`).
    """

    step: jax.Array
    params: dict
    opt_state: optax.OptState
    compute_params: dict | None = None

    def checkpointed(self) -> SavedState:
        """What a checkpoint holds of this state: all of it but `compute_params`."""
        return SavedState(step=self.step, params=self.params, opt_state=self.opt_state)


@struct.dataclass
class SavedState:
    """A checkpoint's train state: `TrainState`'s step, parameters and optimizer state (the tree checkpoints
    have always held); `train_state` makes the `TrainState` of it."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState

    def train_state(self, abstract: TrainState) -> TrainState:
        """The `TrainState` of this restored state, its `compute_params` made from its parameters as `abstract`
        (the restore target: a `TrainState` of `jax.ShapeDtypeStruct`s with shardings) has them: the same
        paths, dtype and shardings; none when `abstract` has none."""
        copies = None
        if abstract.compute_params:
            paths = tuple(abstract.compute_params)
            dtype = abstract.compute_params[paths[0]].dtype
            shardings = {path: leaf.sharding for path, leaf in abstract.compute_params.items()}
            copies = jax.jit(lambda params: compute_params(params, paths, dtype), out_shardings=shardings)(self.params)
        return TrainState(step=self.step, params=self.params, opt_state=self.opt_state, compute_params=copies)


@dataclasses.dataclass(frozen=True)
class StateSetup:
    """The static pieces around a `TrainState`.

    Attributes:
      graphdef: the model's structure; `nnx.merge(graphdef, params)` rebuilds it.
      shardings: a `TrainState` of `NamedSharding`s.
      abstract: a `TrainState` of `jax.ShapeDtypeStruct`s carrying those shardings
        (the restore target for checkpoints).
      mesh: the device mesh.
      plan: every parameter's sharding and the tables' placements.
      compute_dtype: dtype dense weights are cast to before use in a step.
      narrow_weights: the paths of the weights `TrainState.params` holds in `compute_dtype`
        itself (`OptimConfig.weights_dtype="bfloat16"`: every weight matrix the step casts,
        `weight_matrices`), in `jax.tree.leaves` order; empty when the weights are float32.
    """

    graphdef: nnx.GraphDef
    shardings: TrainState
    abstract: TrainState
    mesh: Mesh
    plan: rules_lib.ShardingPlan
    compute_dtype: str = "float32"
    narrow_weights: tuple[str, ...] = ()

    @property
    def copied(self) -> tuple[str, ...]:
        """The paths of the parameters the state keeps a `compute_dtype` copy of (`TrainState.compute_params`),
        in `jax.tree.leaves` order; empty when it keeps none."""
        return tuple(self.abstract.compute_params or ())

    def sharded_model(self) -> ShardedModel:
        """The model's sharded forward pass and loss (`gem_jax.parallel.spmd`)."""
        return ShardedModel(self.graphdef, self.plan, self.mesh, self.compute_dtype)


def mirror_param_shardings(opt_state, params, param_shardings, default):
    """Shardings for an optimizer state: a leaf that mirrors a parameter
    (`gem_jax.pytree.mirrored_params`: Adam moments, Adagrad accumulators) takes that
    parameter's sharding, a leaf with one value per row of it (row-wise Adagrad
    accumulators, `gem_jax.pytree.mirrors_rows`) the sharding of its rows (the
    parameter's `PartitionSpec` without the last dimension: a row-sharded table's
    accumulator is sharded alike); every other leaf (step counts, masked placeholders)
    gets `default`."""
    params_by_path = {path_keys(path): (leaf.shape, sharding) for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_shardings))}

    def pick(leaf, keys):
        if keys is None:
            return default
        shape, sharding = params_by_path[keys]
        if not mirrors_rows(shape, leaf.shape):
            return sharding
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-1]))

    picked = [pick(leaf, keys) for leaf, keys in zip(jax.tree.leaves(opt_state), mirrored_params(opt_state, params))]
    return jax.tree.unflatten(jax.tree.structure(opt_state), picked)


def compute_params(params: dict, copied: tuple[str, ...], dtype) -> dict | None:
    """`TrainState.compute_params` of `params`: each leaf of a path in `copied` cast to `dtype`; None when `copied` is empty."""
    if not copied:
        return None
    leaves = {path_str(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    return {path: leaves[path].astype(dtype) for path in copied}


def with_leaves_cast(params: dict, paths: tuple[str, ...], dtype) -> dict:
    """`params` with each leaf of a path in `paths` (`path_str`) cast to `dtype`, the others unchanged."""
    paths = frozenset(paths)
    return jax.tree_util.tree_map_with_path(lambda path, leaf: leaf.astype(dtype) if path_str(path) in paths else leaf, params)


def forward_params(state: TrainState) -> dict:
    """The parameter tree a step's forward uses: `state.params` with each copied leaf replaced by its copy."""
    if state.compute_params is None:
        return state.params
    return jax.tree_util.tree_map_with_path(lambda path, leaf: state.compute_params.get(path_str(path), leaf), state.params)


def _init_fn(model_factory: Callable[[nnx.Rngs], nnx.Module], optimizer: optax.GradientTransformation, seed: int,
             copied: tuple[str, ...] = (), compute_dtype: str = "float32", narrow_weights: tuple[str, ...] = ()):
    def init() -> TrainState:
        with nnx.use_eager_sharding(False):
            params = nnx.to_pure_dict(nnx.split(model_factory(nnx.Rngs(seed)))[1])
        opt_state = optimizer.init(params)  # of the float32 weights: moments keep the optimizer's dtypes
        params = with_leaves_cast(params, narrow_weights, compute_dtype)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                          compute_params=compute_params(params, copied, compute_dtype))

    return init


def state_setup(
    model_factory: Callable[[nnx.Rngs], nnx.Module],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: rules_lib.Rules,
    *,
    compute_dtype: str = "float32",
    keep_compute_params: bool = False,
    weights_dtype: str = "float32",
) -> StateSetup:
    """The shapes and shardings of a train state on `mesh`, without allocating it.

    Enough to restore a checkpoint onto `mesh` (`setup.abstract` is the target) or to
    place existing parameters (`setup.shardings`). Arguments as
    `create_train_state`; `keep_compute_params`: the state keeps the `compute_dtype` copy
    of every weight the step casts to it (`gem_jax.parallel.spmd.cast_param_paths`; none
    when `compute_dtype` is the weights' own); `weights_dtype` "bfloat16": the state keeps
    those of them with two or more dimensions besides a stacked expert one (the matrices,
    `weight_matrices`) in bfloat16 instead, with no copy (`OptimConfig.weights_dtype`).

    Raises:
      ValueError: an embedding table of the model exchanges its rows in another dtype
        than `compute_dtype` (the model was built for another compute dtype); `weights_dtype`
        is neither "float32" nor `compute_dtype` (bfloat16 weights of a float32 step).
    """
    check_weights_dtype(weights_dtype, compute_dtype)
    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(lambda: model_factory(nnx.Rngs(0)))
    check_exchange_dtypes(abstract_model, compute_dtype)
    graphdef, _ = nnx.split(abstract_model)
    plan = rules_lib.plan_sharding(abstract_model, dict(mesh.shape), rules)
    param_shardings = plan.shardings(mesh)
    abstract = jax.eval_shape(_init_fn(model_factory, optimizer, 0))
    cast = cast_param_paths(plan, abstract.params, compute_dtype)
    matrices = weight_matrices(plan, abstract.params) if weights_dtype != "float32" else frozenset()
    narrow = tuple(path for path in cast if path in matrices)
    copied = tuple(path for path in cast if path not in narrow) if keep_compute_params else ()
    abstract = abstract.replace(params=jax.eval_shape(lambda p: with_leaves_cast(p, narrow, compute_dtype), abstract.params))
    abstract = abstract.replace(compute_params=jax.eval_shape(lambda p: compute_params(p, copied, compute_dtype), abstract.params))
    replicated = rules_lib.replicated(mesh)
    opt_shardings = mirror_param_shardings(abstract.opt_state, abstract.params, param_shardings, replicated)
    by_path = {path_str(path): sharding for path, sharding in jax.tree_util.tree_leaves_with_path(param_shardings)}
    copy_shardings = {path: by_path[path] for path in copied} if copied else None
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings, compute_params=copy_shardings)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return StateSetup(graphdef, shardings, abstract, mesh, plan, compute_dtype, narrow)


def weight_matrices(plan: rules_lib.ShardingPlan, params: dict) -> frozenset[str]:
    """The paths (`path_str`) of the leaves of `params` (`plan`'s tree) that are weight matrices: two or more
    dimensions besides a stacked `expert` one, so that the DHEN experts' kernels `[E, in, out]` are and
    their biases `[E, out]` are not (`OptimConfig.weights_dtype` keeps biases and gains in float32)."""
    logical = jax.tree.leaves(plan.logical, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return frozenset(
        path_str(path)
        for (path, leaf), names in zip(jax.tree_util.tree_leaves_with_path(params), logical, strict=True)
        if len(leaf.shape) - sum(name == "expert" for name in names) >= 2
    )


def check_exchange_dtypes(model: nnx.Module, compute_dtype: str) -> None:
    """Refuses a model whose tables exchange rows in another dtype than the step's `compute_dtype` (one step,
    one compute dtype: dense weights gathered in one, rows exchanged in another would be a mixed step).

    Raises:
      ValueError: naming the first such table (its module path) and both dtypes.
    """
    for path, node in nnx.iter_graph(model):
        if isinstance(node, EmbeddingTable) and node.exchange_dtype not in (None, jnp.dtype(compute_dtype)):
            where = node.path or "/".join(map(str, path))
            raise ValueError(
                f"embedding table {where!r} exchanges its rows in {node.exchange_dtype.name}, but the step's compute dtype is "
                f"{jnp.dtype(compute_dtype).name}: build the model and the train state with the same compute dtype "
                "(ModelConfig.compute_dtype)"
            )


def create_train_state(
    model_factory: Callable[[nnx.Rngs], nnx.Module],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: rules_lib.Rules,
    seed: int,
    *,
    compute_dtype: str = "float32",
    keep_compute_params: bool = False,
    weights_dtype: str = "float32",
) -> tuple[TrainState, StateSetup]:
    """Initialises the model and optimizer state sharded over `mesh`.

    Args:
      model_factory: builds the model from `nnx.Rngs` (parameters must carry
        logical axis names, see `gem_jax.nn.layers`).
      optimizer: the optax transformation.
      mesh, rules: where each logical axis goes (`gem_jax.parallel.rules`).
      seed: parameter-init seed; the same seed gives the same parameters on any mesh.
      compute_dtype: the model's compute dtype; dense weights are cast to it on
        their shard before the FSDP all-gather. The model's embedding tables must
        exchange their rows in it (`EmbeddingTable.exchange_dtype`, or None).
      keep_compute_params: keep the `compute_dtype` copy of the dense weights in the
        state (`TrainState.compute_params`). False here; the trainer passes
        `OptimConfig.keep_compute_params` (True by default).
      weights_dtype: "float32", or the compute dtype to keep the step's dense weights in
        instead of float32 (`OptimConfig.weights_dtype`; `optimizer` must then round its
        updates into them, as `make_optimizer`'s does).
    """
    setup = state_setup(model_factory, optimizer, mesh, rules, compute_dtype=compute_dtype, keep_compute_params=keep_compute_params,
                        weights_dtype=weights_dtype)
    return init_train_state(model_factory, optimizer, setup, seed), setup


def init_train_state(
    model_factory: Callable[[nnx.Rngs], nnx.Module], optimizer: optax.GradientTransformation, setup: StateSetup, seed: int
) -> TrainState:
    """The model and optimizer state of `setup` (`state_setup`), initialised from `seed` with `setup.shardings`.

    Arguments as `create_train_state`; the same seed gives the same state on any mesh.
    """
    init = _init_fn(model_factory, optimizer, seed, setup.copied, setup.compute_dtype, setup.narrow_weights)
    return jax.jit(init, out_shardings=setup.shardings)()
