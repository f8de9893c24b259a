"""Jagged flash attention (JFA)."""

from pallas_kernels.jagged_flash_attention.ops import jagged_flash_attention

__all__ = ["jagged_flash_attention"]
