"""Device meshes whose axes follow the network hierarchy.

Axes, outermost first: `zone` (cross-zone links, the slowest), `node` (hosts inside a
zone) and `gpu` (GPUs inside a host, NVLink). GEM's engineering description (Meta,
2025) shards along these levels: HSDP groups inside a zone, replication across zones.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

ZONE, NODE, GPU = "zone", "node", "gpu"
MESH_AXES = (ZONE, NODE, GPU)


@dataclasses.dataclass(frozen=True)
class Topology:
    """How many zones, nodes per zone and GPUs per node the job spans."""

    zones: int = 1
    nodes_per_zone: int = 1
    gpus_per_node: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.zones, self.nodes_per_zone, self.gpus_per_node)

    @property
    def num_devices(self) -> int:
        return int(np.prod(self.shape))


def make_mesh(topology: Topology, devices: list[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes (`zone`, `node`, `gpu`) of shape `topology.shape`.

    Devices are ordered by (process index, device id) so that the innermost axis
    stays inside one process/host.

    Raises:
      ValueError: the device count differs from the topology's.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != topology.num_devices:
        raise ValueError(
            f"topology {topology.shape} needs {topology.num_devices} devices, but {len(devices)} are available"
        )
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(devices, dtype=object).reshape(topology.shape), MESH_AXES)
