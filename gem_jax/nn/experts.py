"""Expert parallelism for a group of experts whose outputs are summed (the DHEN MLP experts).

GEM's engineering description (Meta, 2025): DHEN experts are spread over the GPUs of a
node, each expert's weights FSDP-sharded across nodes, and activations exchanged inside
the node. Here the experts of a group are stacked on a leading `expert` dimension that
the rules shard over the mesh's `expert` axis (NVLink), while their other dimensions are
FSDP-sharded over the remaining axes of the zone. On one expert slot of a node:

1. all-gather the inputs of the slot's peers over `expert`: `[E*b, width]`;
2. run the slot's own experts on all of them and sum their outputs;
3. reduce-scatter over `expert`: each GPU gets the sum over every expert for its own
   `b` examples.

Every expert sees every example (DHEN is a dense ensemble), so the FLOPs per GPU match
data parallelism; what moves is activations over NVLink instead of every expert's
weights (the FSDP all-gather brings only the slot's experts). The backward pass is the
transpose: all-gather of output gradients, reduce-scatter of input gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from gem_jax import shard_context as context
from gem_jax.mesh import EXPERT


def expert_parallel(apply: Callable[[jax.Array], jax.Array], x: jax.Array, *, local_experts: int, num_experts: int) -> jax.Array:
    """Sum over all `num_experts` experts of `apply`, with experts spread over the `expert` axis.

    Equivalent jnp (on one device, `apply` summing all experts)::

        apply(x)

    Args:
      apply: `[rows, width] -> [rows, width]`: the sum of this device's experts' outputs.
      x: `[b, width]` this device's inputs.
      local_experts: experts held by this device (the stacked parameter's leading size).
      num_experts: experts of the whole group.

    Returns:
      `[b, width]`: the sum over every expert of the group.

    Raises:
      ValueError: the device holds a part of the group but no sharded step is active,
        or the split does not match the `expert` axis.
    """
    if local_experts == num_experts:
        return apply(x)
    ctx = context.active()
    slots = ctx.axis_sizes[EXPERT] if ctx is not None else 1
    if ctx is None or local_experts * slots != num_experts:
        raise ValueError(f"{local_experts} of {num_experts} experts on this device do not match {slots} expert slots")
    gathered = jax.lax.all_gather(x, EXPERT, axis=0, tiled=True)
    return jax.lax.psum_scatter(apply(gathered), EXPERT, scatter_dimension=0, tiled=True)
