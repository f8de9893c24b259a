"""MXFP8 training matmuls: 32x32 block quantization, Hadamard rotation, stochastic rounding, FP8 GEMM."""

from pallas_kernels.mxfp8.hadamard import random_hadamard
from pallas_kernels.mxfp8.matmul import mxfp8_matmul
from pallas_kernels.mxfp8.quantize import dequantize_mxfp8, quantize_mxfp8, rmsnorm_quantize_mxfp8
from pallas_kernels.mxfp8.reference import Rounding

__all__ = ["Rounding", "dequantize_mxfp8", "mxfp8_matmul", "quantize_mxfp8", "random_hadamard", "rmsnorm_quantize_mxfp8"]
