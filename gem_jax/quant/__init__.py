"""FP8 (MXFP8) dense layers built on `pallas_kernels.mxfp8` (recipe, custom VJP and on-shard quantization live there)."""

from gem_jax.quant.dense import Fp8Linear
from pallas_kernels.mxfp8 import Fp8Recipe, fp8_matmul, quantize_gathered, quantize_weight, shard_gradient

__all__ = ["Fp8Linear", "Fp8Recipe", "fp8_matmul", "quantize_gathered", "quantize_weight", "shard_gradient"]
