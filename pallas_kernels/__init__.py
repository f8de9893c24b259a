"""Pallas Mosaic GPU kernels for jagged recommendation models, each with a jnp reference.

Standalone: this package never imports `gem_jax`.
"""

from pallas_kernels._src.dispatch import Choice, Implementation, ImplementationUnavailableError, compiling_for
from pallas_kernels.block_local_attention import block_local_attention
from pallas_kernels.choice import describe_choice, implementations
from pallas_kernels.gdpa import gdpa
from pallas_kernels.gelu_grad_matmul import gelu_grad_matmul
from pallas_kernels.jagged_flash_attention import jagged_flash_attention
from pallas_kernels.mxfp8 import dequantize_mxfp8, gelu_quantize_mxfp8, mxfp8_matmul, quantize_mxfp8, random_hadamard, rmsnorm_quantize_mxfp8
from pallas_kernels.qk_norm_rope import qk_norm_rope
from pallas_kernels.rms_norm import rms_norm, rms_norm_backward

__all__ = [
    "block_local_attention",
    "Choice",
    "compiling_for",
    "Implementation",
    "ImplementationUnavailableError",
    "dequantize_mxfp8",
    "describe_choice",
    "gdpa",
    "gelu_grad_matmul",
    "gelu_quantize_mxfp8",
    "implementations",
    "jagged_flash_attention",
    "mxfp8_matmul",
    "qk_norm_rope",
    "quantize_mxfp8",
    "random_hadamard",
    "rms_norm",
    "rms_norm_backward",
    "rmsnorm_quantize_mxfp8",
]
