"""Logical-axis rules: how the model's logical axis names map to mesh axes, per config.

Model code names parameter axes by role (`embed`, `mlp`, `heads`, `expert`, `norm`,
`table_rows`, `table_dim`); a `ShardingRules` turns those into `PartitionSpec`s over the
axes of `gem_jax.mesh`, and picks each embedding table's generation
(`gem_jax.nn.embeddings`). Two presets:

- `DATA_PARALLEL_RULES`: dense weights replicated (their gradients all-reduced),
  tables row-sharded over every device (gen 1).
- `HSDP_RULES`: dense weights FSDP-sharded over the GPUs of a zone and replicated
  across zones (GEM's HSDP; MaxText's `ici_fsdp` x `dcn_data`), the DHEN expert group
  spread over the expert axis of each node and FSDP-sharded across the node's other
  GPUs and the zone's nodes, tables model-parallel inside the zone (gen 2).

The batch is always split over every device (`gem_jax.parallel.placement`). A dimension
takes the longest prefix of its rule's axes whose size product divides it (so no rule
fails on an odd width) and an axis serves at most one dimension of a parameter.
`ShardingPlan.table_rows` lists every parameter's spec and bytes per device; the
golden-table test guards that no large parameter stays replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gem_jax.nn.layers import EMBEDDING_PARAM, EmbeddingTable
from gem_jax.quant import Fp8Linear
from gem_jax.nn.embeddings import Generation, TablePlacement, TableSharding, place_table
from gem_jax.mesh import EXPERT, GROUP_AXES, live_axes
from gem_jax.pytree import path_keys, path_str
from pallas_kernels.mxfp8 import Fp8Gather

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """A config's sharding choices.

    Attributes:
      logical: `(logical axis name, mesh axes)` pairs; names without a pair stay
        replicated.
      tables: `(table path, TableSharding)` per table ("embed/item", "embed/user/user").
      default_table: the sharding of tables not in `tables`.
    """

    logical: tuple[tuple[str, Axes], ...] = ()
    tables: tuple[tuple[str, TableSharding], ...] = ()
    default_table: TableSharding = TableSharding()

    def table(self, name: str) -> TableSharding:
        return dict(self.tables).get(name, self.default_table)


Rules = ShardingRules

DATA_PARALLEL_RULES = ShardingRules(default_table=TableSharding(Generation.GLOBAL))

HSDP_RULES = ShardingRules(
    logical=(
        ("expert", (EXPERT,)),
        ("embed", GROUP_AXES),
        ("mlp", GROUP_AXES),
        ("heads", GROUP_AXES),
    ),
    default_table=TableSharding(Generation.GROUP),
)


def logical_to_spec(
    logical: tuple[str | None, ...] | PartitionSpec,
    rules: ShardingRules,
    shape: tuple[int, ...] | None = None,
    axis_sizes: dict[str, int] | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a mesh `PartitionSpec`.

    Args:
      logical: one logical name (or None) per dimension.
      rules: the rules.
      shape, axis_sizes: when given, axes of size 1 are dropped and a dimension keeps
        the longest prefix of its axes whose product divides its size.

    Returns:
      A spec with one entry per dimension; a mesh axis appears at most once (the
      first dimension that can use it wins).
    """
    table = dict(rules.logical)
    used: set[str] = set()
    out = []
    for dim, name in enumerate(logical):
        axes = tuple(a for a in (table.get(name, ()) if name is not None else ()) if a not in used)
        if axis_sizes is not None:
            axes = live_axes(axis_sizes, axes)
        if shape is not None and axis_sizes is not None:
            while axes and shape[dim] % math.prod(axis_sizes[a] for a in axes):
                axes = axes[:-1]
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def _spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    out = []
    for entry in spec:
        out += [entry] if isinstance(entry, str) else list(entry or ())
    return tuple(out)


def spec_from_axes(axes: Axes, ndim: int, dim: int = 0) -> PartitionSpec:
    """A spec sharding dimension `dim` over `axes` (outermost first), the others replicated."""
    entry = axes[0] if len(axes) == 1 else (axes or None)
    return PartitionSpec(*(entry if d == dim else None for d in range(ndim)))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Every parameter's sharding on one mesh.

    Attributes:
      specs: pure-dict tree (as `nnx.to_pure_dict`) of mesh `PartitionSpec`s.
      logical: the same tree of logical-name `PartitionSpec`s.
      tables: the embedding tables' placements, by module path.
      axis_sizes: the mesh's axis sizes.
      fp8: the FP8 layers (`gem_jax.quant.Fp8Linear`) whose kernels are quantized on
        the shard, by module path ("sequence_tower/blocks/0/qkv"): the sharded step
        all-gathers such a kernel (in the compute dtype) over every axis of its spec
        except `axes` of dimension `dim`, and the layer quantizes that chunk and
        all-gathers its 8-bit data and scales over `axes`. `axes` is the longest outer
        part of the dimension's axes whose chunks hold whole quantization blocks, so the
        result is bit-identical to quantizing the gathered kernel.
    """

    specs: dict
    logical: dict
    tables: dict[str, TablePlacement]
    axis_sizes: dict[str, int]
    fp8: dict[str, Fp8Gather] = dataclasses.field(default_factory=dict)

    def shardings(self, mesh: Mesh) -> dict:
        """The `NamedSharding` tree of `specs` on `mesh`."""
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def table_rows(self, abstract_params: dict) -> list[dict]:
        """One record per parameter: path, shape, dtype, logical axes, spec, bytes per device."""
        rows = []
        leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
        specs = jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        logical = jax.tree.leaves(self.logical, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for (path, leaf), spec, names in zip(leaves, specs, logical):
            shards = math.prod(self.axis_sizes[a] for a in _spec_axes(spec))
            nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
            rows.append(
                {
                    "path": path_str(path),
                    "shape": list(leaf.shape),
                    "dtype": str(leaf.dtype),
                    "logical": [n for n in names],
                    "spec": [list(e) if isinstance(e, tuple) else e for e in spec],
                    "bytes": nbytes,
                    "bytes_per_device": nbytes // shards,
                }
            )
        return rows


def fp8_gather(spec: PartitionSpec, shape: tuple[int, ...], block: int, axis_sizes: dict[str, int]) -> Fp8Gather | None:
    """Where an FP8 kernel of `shape` sharded as `spec` is quantized on the shard (see `ShardingPlan.fp8`).

    Picks the dimension whose longest outer run of axes leaves chunks of whole
    `block`s and spans the most devices; None when no chunk smaller than the kernel
    holds whole blocks (the kernel is then gathered first and quantized after).
    """
    best = None
    for dim, entry in enumerate(spec):
        axes = _spec_axes(PartitionSpec(entry))
        for k in range(len(axes), 0, -1):
            devices = math.prod(axis_sizes[a] for a in axes[:k])
            if shape[dim] % (devices * block) == 0:
                if best is None or devices > best[0]:
                    best = (devices, Fp8Gather(dim, axes[:k]))
                break
    return None if best is None else best[1]


def plan_sharding(abstract_model: nnx.Module, axis_sizes: dict[str, int], rules: ShardingRules) -> ShardingPlan:
    """Resolves `rules` for every parameter of `abstract_model` (from `nnx.eval_shape`) on a mesh.

    Embedding tables (`EmbeddingTable`) are row-sharded by their table's generation;
    every other parameter by its logical axis names. The sharded kernels of FP8 layers
    are quantized on the shard where their blocks allow (`fp8_gather`).

    Args:
      abstract_model: the model, abstract (no arrays needed).
      axis_sizes: mesh axis sizes (`Mesh.shape` or `Topology.axis_sizes`).
      rules: the config's rules.

    Raises:
      ValueError: `rules.tables` names a table the model does not have (the model's tables listed),
        or a table or FP8 layer whose `path` is not its module path (a model that did not call
        `gem_jax.nn.layers.name_layers`: the sharded step finds them by it).
    """
    _, abstract_params = nnx.split(abstract_model)
    placements: dict[str, TablePlacement] = {}
    for path, module in nnx.iter_modules(abstract_model):
        if isinstance(module, (EmbeddingTable, Fp8Linear)) and module.path != path_str(path):
            raise ValueError(
                f"{type(module).__name__} at {path_str(path)!r} has path {module.path!r}: "
                "the model must name its layers once built (gem_jax.nn.layers.name_layers)"
            )
        if isinstance(module, EmbeddingTable):
            name = path_str(path)
            padded = getattr(module, EMBEDDING_PARAM).shape[0]
            placements[name] = place_table(name, module.num_rows, padded, rules.table(name), axis_sizes)
    unknown = [name for name, _ in rules.tables if name not in placements]
    if unknown:
        raise ValueError(
            f"ShardingRules.tables names {unknown}, not embedding tables of this model; its tables are {sorted(placements)} "
            "(features' tables are embed/user/<name> and embed/item_features/<name>)"
        )
    logical = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    shapes = nnx.to_pure_dict(abstract_params)

    def spec_of(path, names, leaf):
        keys = path_keys(path)
        if keys and keys[-1] == EMBEDDING_PARAM:
            placement = placements[path_str(keys[:-1])]
            return spec_from_axes(placement.row_axes, len(leaf.shape))
        names = tuple(names) if isinstance(names, PartitionSpec) else (None,) * len(leaf.shape)
        return logical_to_spec(names, rules, leaf.shape, axis_sizes)

    specs = jax.tree_util.tree_map_with_path(spec_of, logical, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))
    fp8 = {}
    for path, module in nnx.iter_modules(abstract_model):
        if isinstance(module, Fp8Linear):
            name = path_str(path)
            kernel_spec = functools.reduce(lambda tree, key: tree[key], (*path_keys(path), "kernel"), specs)
            gather = fp8_gather(kernel_spec, module.kernel.shape, module.recipe.block, axis_sizes)
            if gather is not None:
                fp8[name] = gather
    return ShardingPlan(specs=specs, logical=logical, tables=placements, axis_sizes=dict(axis_sizes), fp8=fp8)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
