"""Pallas Mosaic GPU kernels for jagged recommendation models, each with a jnp reference.

Standalone: this package never imports `gem_jax`.
"""

from pallas_kernels._dispatch import Implementation
from pallas_kernels.gdpa import gdpa
from pallas_kernels.jagged_flash_attention import jagged_flash_attention

__all__ = ["Implementation", "gdpa", "jagged_flash_attention"]
