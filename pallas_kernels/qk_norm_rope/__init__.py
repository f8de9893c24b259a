"""QK-norm + RoPE of a fused QKV projection: one Pallas pass forward, one backward."""

from pallas_kernels.qk_norm_rope.ops import qk_norm_rope

__all__ = ["qk_norm_rope"]
