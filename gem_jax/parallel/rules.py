"""Logical-axis rules: how the model's logical axis names map to mesh axes.

Model code names axes by role (`batch`, `embed`, `mlp`, `heads`, `table_rows`, ...);
a rules table per config turns those into `PartitionSpec`s over the mesh axes of
`gem_jax.parallel.mesh`.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gem_jax.parallel.mesh import GPU, NODE, ZONE

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Data parallel over every device; embedding rows sharded over every device (gen 1);
# dense weights replicated.
DATA_PARALLEL_RULES: Rules = (
    ("batch", (ZONE, NODE, GPU)),
    ("table_rows", (ZONE, NODE, GPU)),
)


def logical_to_spec(logical: tuple[str | None, ...] | PartitionSpec, rules: Rules) -> PartitionSpec:
    """Maps logical axis names to a mesh `PartitionSpec`; names without a rule stay replicated.

    A mesh axis is used at most once per spec (the first dimension that claims it wins).
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical:
        axes = table.get(name) if name is not None else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def param_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules):
    """`NamedSharding` tree for an (abstract) nnx parameter state, from its logical axes."""
    specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_to_spec(spec, rules)),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    """Sharding of an array whose leading axis is the batch."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
