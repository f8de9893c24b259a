"""Device meshes whose axes follow the network hierarchy.

Axes, outermost first:

- `zone`: zones of a data centre, joined by the slowest (cross-zone RoCE) links;
- `node`: hosts inside a zone (intra-zone RoCE);
- `expert` and `gpu`: the GPUs inside one host (NVLink), split into `experts_per_node`
  expert slots of `gpus_per_node / experts_per_node` GPUs each.

GEM's engineering description (Meta, 2025) shards along these levels: FSDP groups
inside a zone and replication across zones (HSDP), DHEN experts spread over the GPUs of
a node, sparse tables model-parallel inside a group. JAX's own helpers
(`jax.experimental.mesh_utils.create_hybrid_device_mesh`) model two levels only, so the
device array is built here by hand from the devices' slice (NVLink domain) and process
ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

ZONE, NODE, EXPERT, GPU = "zone", "node", "expert", "gpu"
MESH_AXES = (ZONE, NODE, EXPERT, GPU)
GROUP_AXES = (NODE, EXPERT, GPU)  # one zone: an FSDP / model-parallel group
INTRA_NODE_AXES = (EXPERT, GPU)  # the GPUs of one host


def live_axes(axis_sizes, axes: Sequence[str] = MESH_AXES) -> tuple[str, ...]:
    """The axes of `axes` (default: every mesh axis, outermost first) whose size is > 1.

    Collectives over an axis of size 1 are no-ops, and a spec that names one shards
    nothing, so partitioning code works on these axes only.

    Args:
      axis_sizes: a mapping from axis name to size, a `Mesh` or its `.shape`, or
        `(name, size)` pairs.
      axes: the axes to filter, in order.
    """
    sizes = dict(getattr(axis_sizes, "shape", axis_sizes))
    return tuple(a for a in axes if sizes[a] > 1)


@dataclasses.dataclass(frozen=True)
class Topology:
    """How many zones, nodes per zone, GPUs per node and expert slots per node a job spans.

    Attributes:
      zones: replica groups (HSDP replicates dense weights across them).
      nodes_per_zone: hosts per zone.
      gpus_per_node: GPUs per host (one NVLink domain).
      experts_per_node: expert slots per host; must divide `gpus_per_node`.
    """

    zones: int = 1
    nodes_per_zone: int = 1
    gpus_per_node: int = 1
    experts_per_node: int = 1

    def __post_init__(self):
        for name in ("zones", "nodes_per_zone", "gpus_per_node", "experts_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {value!r}")
        if self.gpus_per_node % self.experts_per_node:
            raise ValueError(
                f"experts_per_node {self.experts_per_node} must divide gpus_per_node {self.gpus_per_node}"
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape over `MESH_AXES`: (zones, nodes_per_zone, experts_per_node, GPUs per expert slot)."""
        return (self.zones, self.nodes_per_zone, self.experts_per_node, self.gpus_per_node // self.experts_per_node)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, self.shape))

    @property
    def num_devices(self) -> int:
        return self.zones * self.nodes_per_zone * self.gpus_per_node


def _node_key(device: jax.Device) -> tuple[int, int, int]:
    """Sort key that keeps a host's devices together: (slice / NVLink domain, process, device id)."""
    return (getattr(device, "slice_index", 0) or 0, device.process_index, device.id)


def device_grid(topology: Topology, devices: Sequence) -> np.ndarray:
    """The devices as an object array of shape `topology.shape` (see `make_mesh`).

    Devices are ordered by (slice index, process index, device id), so that the
    innermost axes (`expert`, `gpu`) hold the GPUs of one host and `node` steps from
    host to host.

    Raises:
      ValueError: the device count differs from the topology's, or a host (slice or
        process) would straddle two mesh nodes.
    """
    devices = sorted(devices, key=_node_key)
    if len(devices) != topology.num_devices:
        raise ValueError(
            f"topology {topology.zones} zones x {topology.nodes_per_zone} nodes x {topology.gpus_per_node} GPUs "
            f"needs {topology.num_devices} devices, but {len(devices)} were given"
        )
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    grid = grid.reshape(topology.shape)
    _check_hosts(grid, topology)
    return grid


def make_mesh(topology: Topology, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` over `MESH_AXES` with shape `topology.shape`.

    Multi-host GPU jobs get one slice per NVLink domain from `jax.distributed.initialize`;
    without slice ids, processes must be numbered node-major (SLURM's default block
    distribution does this).

    Args:
      topology: zones, nodes per zone, GPUs per node, expert slots per node.
      devices: the devices to use (default: `jax.devices()`).

    Returns:
      A `jax.sharding.Mesh` with `Auto` axis types over `device_grid(topology, devices)`.

    Raises:
      ValueError: as `device_grid`.
    """
    return Mesh(device_grid(topology, jax.devices() if devices is None else devices), MESH_AXES)


def _check_hosts(grid: np.ndarray, topology: Topology) -> None:
    """Raises if a slice spans two mesh nodes or a mesh node two slices, or, in a
    multi-process job, one process's devices span two mesh nodes. (A single process
    may own every device, e.g. fake CPU devices standing in for several hosts.)"""
    per_node = grid.reshape(topology.zones * topology.nodes_per_zone, topology.gpus_per_node)
    slices = {getattr(d, "slice_index", 0) or 0 for d in grid.flat}
    multi_process = len({d.process_index for d in grid.flat}) > 1
    owner_of_slice: dict[int, int] = {}
    owner_of_process: dict[int, int] = {}
    for node, row in enumerate(per_node):
        node_slices = {getattr(d, "slice_index", 0) or 0 for d in row}
        if len(slices) > 1 and len(node_slices) > 1:
            raise ValueError(f"mesh node {node} mixes devices of NVLink slices {sorted(node_slices)}; check the topology")
        for d in row:
            if len(slices) > 1:
                s = getattr(d, "slice_index", 0) or 0
                if owner_of_slice.setdefault(s, node) != node:
                    raise ValueError(
                        f"slice {s} spans mesh nodes {owner_of_slice[s]} and {node}: gpus_per_node "
                        f"{topology.gpus_per_node} is smaller than a host"
                    )
            if multi_process and owner_of_process.setdefault(d.process_index, node) != node:
                raise ValueError(
                    f"process {d.process_index} owns devices on mesh nodes {owner_of_process[d.process_index]} and "
                    f"{node}: gpus_per_node {topology.gpus_per_node} is smaller than the devices of one process"
                )
