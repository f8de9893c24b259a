"""RMSNorm over the last axis: one Pallas pass forward, one backward."""

from pallas_kernels.rms_norm.ops import rms_norm

__all__ = ["rms_norm"]
