"""Block-local softmax attention over jagged sequences, with fused RoPE."""

from pallas_kernels.block_local_attention.ops import block_local_attention

__all__ = ["block_local_attention"]
