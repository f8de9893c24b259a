"""MXFP8 training matmuls: 32x32 block quantization, Hadamard rotation, stochastic rounding, FP8 GEMM,
the FP8 dense matmul with its custom VJP, and weight quantization on the FSDP shard."""

from pallas_kernels.mxfp8.fsdp import quantize_gathered, shard_gradient
from pallas_kernels.mxfp8.ops import dequantize_mxfp8, gelu_quantize_mxfp8, mxfp8_matmul, quantize_mxfp8, random_hadamard, rmsnorm_quantize_mxfp8
from pallas_kernels.mxfp8.reference import Rounding
from pallas_kernels.mxfp8.vjp import Fp8Gather, Fp8Recipe, Prologue, fp8_matmul, hadamard_signs, quantize_weight

__all__ = [
    "Fp8Gather",
    "Fp8Recipe",
    "Prologue",
    "Rounding",
    "dequantize_mxfp8",
    "fp8_matmul",
    "gelu_quantize_mxfp8",
    "hadamard_signs",
    "mxfp8_matmul",
    "quantize_gathered",
    "quantize_mxfp8",
    "quantize_weight",
    "random_hadamard",
    "rmsnorm_quantize_mxfp8",
    "shard_gradient",
]
