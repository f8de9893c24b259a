"""The model under one `shard_map`: per-device jagged batches, HSDP weights, sharded tables and experts.

Every device runs the unchanged model on its own jagged batch (offsets local to it;
`gem_jax.parallel.placement` builds the stacked per-device layout). Before the forward
pass, each dense parameter is cast to the compute dtype on its shard and all-gathered
over the axes that shard it (FSDP); it is first marked as varying over the axes that
replicate it. Reverse-mode differentiation turns these into GEM's HSDP gradient path:
the all-gather's transpose is a reduce-scatter inside the zone and the replication's
transpose an all-reduce across zones, on the reduce-scattered shard (MaxText's
hierarchical FSDP, done here explicitly). The kernel of an FP8 layer is quantized on
its shard instead, and the 8-bit data and scales are all-gathered (GEM: weights
quantized on the local FSDP shard; `ShardingPlan.fp8`) over the axes whose chunks
hold whole quantization blocks, after a gather in the compute dtype over the others;
its gradient comes back through the same reduce-scatter and all-reduce. The DHEN
expert group keeps its `expert` dimension sharded (`gem_jax.nn.experts`) and
embedding tables stay as shards for the sharded lookup (`gem_jax.nn.embeddings`).

What the layers need of this (axis sizes, each FP8 layer's `Fp8Gather` and each
table's placement, by module path) reaches them through one
`gem_jax.shard_context.ShardContext`, built once per step from the plan; the merged
model itself is used as it is, and its numerics (FP8 recipes, the dtype embedding rows
are exchanged in) are its own, from `ModelConfig`.

The loss is the weighted mean BCE over the *global* batch: each device's weighted sum
and weight total are summed over all devices before the division, so the loss and its
gradients equal the single-device result on the same examples.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from gem_jax.batch import Batch
from gem_jax import shard_context as context
from gem_jax.nn.layers import EMBEDDING_PARAM
from gem_jax.mesh import live_axes
from gem_jax.pytree import path_keys, path_str
from gem_jax.parallel.rules import Fp8Gather, ShardingPlan, spec_from_axes
from gem_jax.model import loss as loss_lib


class Role(enum.Enum):
    """How the sharded step treats a parameter."""

    DENSE = "dense"  # all-gathered (FSDP) before use
    EXPERT = "expert"  # all-gathered except its `expert` dimension
    TABLE = "table"  # used as a shard by the sharded lookup


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _entry_axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def param_roles(plan: ShardingPlan) -> dict:
    """Pure-dict tree of `Role`s, parallel to `plan.specs`."""

    def role(path, names):
        if path_keys(path)[-1] == EMBEDDING_PARAM:
            return Role.TABLE
        return Role.EXPERT if "expert" in tuple(names) else Role.DENSE

    return jax.tree_util.tree_map_with_path(role, plan.logical, is_leaf=_is_spec)


def casts(role: Role, dtype, compute_dtype) -> bool:
    """Whether `gather_param` casts a parameter of `role` and `dtype` to `compute_dtype` (None: keep): DENSE and
    EXPERT parameters of a floating dtype other than it."""
    return (
        role is not Role.TABLE
        and compute_dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and jnp.dtype(dtype) != jnp.dtype(compute_dtype)
    )


def cast_param_paths(plan: ShardingPlan, params: dict, compute_dtype) -> tuple[str, ...]:
    """The paths (`path_str`) of the leaves of `params` (arrays or `jax.ShapeDtypeStruct`s, `plan`'s tree) that
    `gather_param` casts to `compute_dtype` (`casts`), in `jax.tree.leaves` order; empty for "float32" steps
    of float32 weights."""
    roles = jax.tree.leaves(param_roles(plan), is_leaf=lambda x: isinstance(x, Role))
    return tuple(
        path_str(path)
        for (path, leaf), role in zip(jax.tree_util.tree_leaves_with_path(params), roles, strict=True)
        if casts(role, leaf.dtype, compute_dtype)
    )


def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def gather_param(
    x: jax.Array,
    spec: PartitionSpec,
    names: PartitionSpec,
    role: Role,
    axis_sizes: dict[str, int],
    dtype,
    fp8: Fp8Gather | None = None,
) -> jax.Array:
    """One parameter shard -> the array the model uses on this device (inside `shard_map`).

    DENSE and EXPERT: cast to `dtype` (a float compute dtype, or None to keep) on the
    shard, mark varying over the live axes the spec does not mention, all-gather every
    sharded dimension (EXPERT: except the `expert` one; an FP8 kernel: except `fp8.axes`
    of dimension `fp8.dim`, which its layer gathers in 8 bits). TABLE: unchanged.
    """
    if role is Role.TABLE:
        return x
    if casts(role, x.dtype, dtype):
        x = x.astype(dtype)
    mentioned = {a for entry in spec for a in _entry_axes(entry)}
    unmentioned = tuple(a for a in live_axes(axis_sizes) if a not in mentioned)
    if unmentioned:
        x = jax.lax.pcast(x, unmentioned, to="varying")
    names = tuple(names) + (None,) * (x.ndim - len(tuple(names)))
    for dim, entry in enumerate(spec):
        axes = _entry_axes(entry)
        if fp8 is not None and dim == fp8.dim:
            axes = axes[len(fp8.axes) :]  # the inner axes: the layer quantizes their gathered chunk
        if axes and not (role is Role.EXPERT and names[dim] == "expert"):
            x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    return x


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """The model's forward pass and loss over a stacked per-device batch.

    Attributes:
      graphdef: the model's structure (`nnx.split`).
      plan: every parameter's sharding (`gem_jax.parallel.rules.plan_sharding`).
      mesh: the device mesh.
      compute_dtype: dense weights are cast to it on their shard before the
        all-gather ("float32" keeps them); the trainer passes the model's
        `compute_dtype`. Embedding rows cross the network in each table's own
        `exchange_dtype`, which the model set from its config when it was built.
    """

    graphdef: nnx.GraphDef
    plan: ShardingPlan
    mesh: Mesh
    compute_dtype: str = "float32"

    @property
    def batch_spec(self) -> PartitionSpec:
        """Spec of every stacked-batch leaf: leading device axis over every live mesh axis."""
        return spec_from_axes(live_axes(self.plan.axis_sizes), 1)

    def _forward(self, params: dict, batch: Batch, rows: context.TableRows | None = None):
        """Per device: (logits [b, K], stats, the local batch)."""
        sizes = self.plan.axis_sizes
        local = jax.tree.map(lambda x: x[0], batch)
        roles = param_roles(self.plan)
        dtype = jnp.dtype(self.compute_dtype)

        def gather(path, x, spec, names, role):
            keys = path_keys(path)
            fp8 = self.plan.fp8.get(path_str(keys[:-1])) if keys[-1] == "kernel" else None
            return gather_param(x, spec, names, role, sizes, dtype, fp8)

        full = jax.tree_util.tree_map_with_path(
            gather, params, self.plan.specs, self.plan.logical, roles, is_leaf=lambda x: _is_spec(x) or isinstance(x, Role)
        )
        with context.shard_context(sizes, fp8=self.plan.fp8, tables=self.plan.tables, rows=rows) as ctx:
            logits = nnx.merge(self.graphdef, full)(local)
        return logits, dict(ctx.stats), local

    def _shard_map(self, body, out_specs, *extra_specs):
        in_specs = (self.plan.specs, self.batch_spec, *extra_specs)
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def _local_loss(self, params: dict, batch: Batch, rows: context.TableRows | None):
        """Per device: `(loss, (bce [K], stats, logits [1, b, K]))` over the global batch."""
        logits, stats, local = self._forward(params, batch, rows)
        axes = live_axes(self.plan.axis_sizes)
        weight = local.weights.sum()
        total = loss_lib.weighted_bce(logits, local.labels, local.weights) * jnp.maximum(weight, 1.0)
        total, weight = _psum((total, weight), axes)
        bce = total / jnp.maximum(weight, 1.0)
        return bce.sum(), (bce, _psum(stats, axes), logits[None])

    def _loss_specs(self):
        axes = live_axes(self.plan.axis_sizes)
        return (PartitionSpec(), (PartitionSpec(), PartitionSpec(), spec_from_axes(axes, 3)))

    def loss(self, params: dict, batch: Batch):
        """`(loss, (bce [K], stats, logits [B, K]))` over the global batch; differentiable in `params`.

        Args:
          params: the parameter tree, sharded as `plan.specs`.
          batch: the stacked per-device batch (`gem_jax.parallel.placement.stack_batch`).

        Returns:
          loss: float32 scalar, the sum over tasks of the weighted mean BCE.
          bce: float32 `[K]` per task.
          stats: counters summed over devices (`<table>/out_of_range`,
            `<table>/overflow`, `<table>/sent_rows`: int32; `<table>/sent_bytes`: float32).
          logits: float32, examples in global order.
        """
        body = lambda params, batch: self._local_loss(params, batch, None)  # noqa: E731
        loss, (bce, stats, logits) = self._shard_map(body, self._loss_specs())(params, batch)
        return loss, (bce, stats, logits.reshape(-1, logits.shape[-1]))

    def loss_with_rows(self, params: dict, batch: Batch, deltas: dict[str, list[jax.Array]] | None = None):
        """`loss` whose unsharded tables' lookups take row deltas (`gem_jax.shard_context.TableRows`).

        Args:
          params, batch: as `loss`.
          deltas: by table name (module path, "embed/item"), one float `[D, n_i, d]`
            per lookup in trace order (`D` devices, `n_i` ids per device; zeros);
            the gradient w.r.t. each is the gradient of the rows that lookup gathered.
            None: a shape probe (no deltas; run it under `jax.eval_shape`).

        Returns:
          `(loss, (bce, stats, logits, ids))`: as `loss`, and `ids` by table name, one
          int32 `[D, n_i]` per lookup of every unsharded table: the row looked up, or the
          table's parameter row count where the id policy rejected the id.
        """
        axes = live_axes(self.plan.axis_sizes)

        def body(params, batch, local_deltas):
            rows = context.TableRows(None if deltas is None else jax.tree.map(lambda x: x[0], local_deltas))
            loss, aux = self._local_loss(params, batch, rows)
            return loss, (*aux, jax.tree.map(lambda x: x[None], rows.ids))

        loss_spec, aux_specs = self._loss_specs()
        out_specs = (loss_spec, (*aux_specs, spec_from_axes(axes, 2)))
        mapped = self._shard_map(body, out_specs, spec_from_axes(axes, 3))
        loss, (bce, stats, logits, ids) = mapped(params, batch, {} if deltas is None else deltas)
        return loss, (bce, stats, logits.reshape(-1, logits.shape[-1]), ids)

    def trace_local_loss(self, fn, params: dict, batch: Batch) -> None:
        """Traces `fn(local_loss, params)` inside the step's `shard_map`, computing nothing.

        For measurements of what one device's step holds (e.g. the residuals its
        backward keeps): `local_loss(params)` is the loss as one device computes it (a
        float32 scalar, as `loss`), on its part of `batch`, with this device's view of
        `params`; `fn` runs once, at trace time (`jax.eval_shape` of the `shard_map`),
        and its return value is ignored. `params` and `batch` may be
        `jax.ShapeDtypeStruct`s.
        """

        def body(params, batch):
            fn(lambda p: self._local_loss(p, batch, None)[0], params)
            return jnp.zeros((), jnp.float32)

        jax.eval_shape(self._shard_map(body, PartitionSpec()), params, batch)

    def logits(self, params: dict, batch: Batch) -> jax.Array:
        """float32 `[B, K]` logits of the stacked batch, examples in global order."""

        def body(params, batch):
            return self._forward(params, batch)[0][None]

        stacked = self._shard_map(body, spec_from_axes(live_axes(self.plan.axis_sizes), 3))(params, batch)
        return stacked.reshape(-1, stacked.shape[-1])
