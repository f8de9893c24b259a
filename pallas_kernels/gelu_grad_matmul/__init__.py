"""The backward of an MLP's tanh GELU through its down-projection GEMM, with the bias gradient: one
Hopper GEMM with a DGELU + bias-gradient epilogue (cuBLASLt's DGELU_BGRAD fusion)."""

from pallas_kernels.gelu_grad_matmul.kernel import TuningConfig, default_config
from pallas_kernels.gelu_grad_matmul.ops import SUPPORT, gelu_grad_matmul, runs_kernel
from pallas_kernels.gelu_grad_matmul.reference import gelu_tanh_grad

__all__ = ["SUPPORT", "TuningConfig", "default_config", "gelu_grad_matmul", "gelu_tanh_grad", "runs_kernel"]
