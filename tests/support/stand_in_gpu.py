"""A stand-in Hopper GPU for `pallas_kernels.compiling_for`: the ops choose and size their kernels without one."""


class Hopper:
    """An H200 as `compiling_for` reads a device: platform, kind, compute capability and SM count."""

    platform, device_kind, compute_capability, core_count = "gpu", "NVIDIA H200", "9.0", 132
