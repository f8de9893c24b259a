"""The partitioner above the model: sharding rules, the shard_map step, batch placement, jax.distributed."""

from gem_jax.mesh import Topology, make_mesh
from gem_jax.parallel.placement import BatchPlacement, stack_batch
from gem_jax.parallel.rules import DATA_PARALLEL_RULES, HSDP_RULES, ShardingPlan, ShardingRules, plan_sharding
from gem_jax.parallel.spmd import ShardedModel

__all__ = [
    "DATA_PARALLEL_RULES",
    "HSDP_RULES",
    "BatchPlacement",
    "ShardedModel",
    "ShardingPlan",
    "ShardingRules",
    "Topology",
    "make_mesh",
    "plan_sharding",
    "stack_batch",
]
