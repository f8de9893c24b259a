"""Jagged flash attention (JFA)."""

from pallas_kernels.jagged_flash_attention.ops import jagged_flash_attention
from pallas_kernels.jagged_flash_attention.config import SAVED_NAME

__all__ = ["SAVED_NAME", "jagged_flash_attention"]
