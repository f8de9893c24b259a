"""The network-hierarchy mesh: shape, device order, host checks, clear errors."""

import dataclasses

import jax
import numpy as np
import pytest

from gem_jax.mesh import EXPERT, GPU, MESH_AXES, NODE, ZONE, Topology, device_grid, make_mesh


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    slice_index: int = 0


def cluster(hosts: int, gpus: int, *, processes_per_host: int = 1, shuffle_seed=None):
    """Devices of `hosts` NVLink slices with `gpus` each; ids interleaved so that id order is not host order."""
    devices = []
    for h in range(hosts):
        for g in range(gpus):
            devices.append(FakeDevice(id=g * hosts + h, process_index=h * processes_per_host + g * processes_per_host // gpus, slice_index=h))
    if shuffle_seed is not None:
        np.random.default_rng(shuffle_seed).shuffle(devices)
    return devices


def test_topology_shape_and_validation():
    topo = Topology(zones=2, nodes_per_zone=3, gpus_per_node=8, experts_per_node=2)
    assert topo.shape == (2, 3, 2, 4) and topo.num_devices == 48
    assert topo.axis_sizes == {ZONE: 2, NODE: 3, EXPERT: 2, GPU: 4}
    with pytest.raises(ValueError, match="experts_per_node 3 must divide gpus_per_node 8"):
        Topology(gpus_per_node=8, experts_per_node=3)
    with pytest.raises(ValueError, match="nodes_per_zone must be a positive int"):
        Topology(nodes_per_zone=0)


def test_inner_axes_stay_inside_a_host_and_zones_group_hosts():
    topo = Topology(zones=2, nodes_per_zone=2, gpus_per_node=4, experts_per_node=2)
    grid = device_grid(topo, cluster(4, 4, shuffle_seed=np.random.default_rng().integers(1 << 30)))
    assert grid.shape == (2, 2, 2, 2)
    for z in range(2):
        for n in range(2):
            node = grid[z, n].ravel()
            assert len({d.slice_index for d in node}) == 1  # expert and gpu axes: one host
            assert node[0].slice_index == 2 * z + n  # zone-major host order
    # Devices that differ only on `zone` are on different hosts, in different zones.
    assert grid[0, 1, 1, 0].slice_index != grid[1, 1, 1, 0].slice_index


def test_one_process_per_gpu_multi_process_layout():
    devices = cluster(2, 4, processes_per_host=4)  # process id = 4 * host + gpu
    grid = device_grid(Topology(nodes_per_zone=2, gpus_per_node=4), devices)
    assert [d.process_index for d in grid[0, 1].ravel()] == [4, 5, 6, 7]


def test_device_count_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs 16 devices, but 8 were given"):
        device_grid(Topology(zones=2, nodes_per_zone=2, gpus_per_node=4), cluster(2, 4))


def test_a_host_larger_than_gpus_per_node_is_rejected():
    with pytest.raises(ValueError, match="slice 0 spans mesh nodes 0 and 1"):
        device_grid(Topology(nodes_per_zone=4, gpus_per_node=2), cluster(2, 4))
    multi = [FakeDevice(id=i, process_index=i // 4) for i in range(8)]  # 2 processes of 4 devices, no slice ids
    with pytest.raises(ValueError, match="process 0 owns devices on mesh nodes 0 and 1"):
        device_grid(Topology(nodes_per_zone=4, gpus_per_node=2), multi)


def test_make_mesh_on_the_live_devices():
    mesh = make_mesh(Topology(), jax.devices()[:1])
    assert mesh.axis_names == MESH_AXES and mesh.devices.shape == (1, 1, 1, 1)
