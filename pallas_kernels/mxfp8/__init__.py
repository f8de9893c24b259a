"""MXFP8 training matmuls: 32x32 block quantization, Hadamard rotation, stochastic rounding, FP8 GEMM."""

from pallas_kernels.mxfp8.ops import dequantize_mxfp8, mxfp8_matmul, quantize_mxfp8, random_hadamard, rmsnorm_quantize_mxfp8
from pallas_kernels.mxfp8.reference import Rounding

__all__ = ["Rounding", "dequantize_mxfp8", "mxfp8_matmul", "quantize_mxfp8", "random_hadamard", "rmsnorm_quantize_mxfp8"]
