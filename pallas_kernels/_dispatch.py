"""Choosing between the Pallas Mosaic GPU kernels and their jnp references."""

from __future__ import annotations

import enum

import jax


class Implementation(enum.StrEnum):
    """Which implementation an op runs."""

    XLA = "xla"  # the pure-jnp reference compiled by XLA (the spec; runs anywhere)
    PALLAS = "pallas"  # the Pallas Mosaic GPU kernels (Hopper, sm_90a)


def is_hopper_gpu(device: jax.Device | None = None) -> bool:
    """True when `device` (default: the first device) is an NVIDIA Hopper GPU."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False
    return getattr(device, "compute_capability", "") in ("9.0",) or "H100" in device.device_kind or "H200" in device.device_kind


def resolve(implementation: str | Implementation | None) -> Implementation:
    """`None` -> PALLAS on a Hopper GPU, else XLA; strings are parsed.

    Raises:
      ValueError: an unknown implementation name.
    """
    if implementation is None:
        return Implementation.PALLAS if is_hopper_gpu() else Implementation.XLA
    try:
        return Implementation(implementation)
    except ValueError:
        raise ValueError(
            f"unknown implementation {implementation!r}; expected one of {[i.value for i in Implementation]} or None"
        ) from None
