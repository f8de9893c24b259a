"""Generalized dot-product attention (GDPA)."""

from pallas_kernels.gdpa.ops import gdpa
from pallas_kernels.gdpa.reference import Activation

__all__ = ["Activation", "gdpa"]
