"""RMSNorm over the last axis: one Pallas pass forward, one backward."""

from pallas_kernels.rms_norm.ops import rms_norm, rms_norm_backward

__all__ = ["rms_norm", "rms_norm_backward"]
