"""FP8 (MXFP8) dense layers built on `pallas_kernels.mxfp8`."""

from gem_jax.quant.dense import Fp8Linear, Fp8Recipe, fp8_matmul, quantize_weight
from gem_jax.quant.fsdp import quantize_gathered

__all__ = ["Fp8Linear", "Fp8Recipe", "fp8_matmul", "quantize_gathered", "quantize_weight"]
