"""FP8 (MXFP8) dense layers built on `pallas_kernels.mxfp8` (recipe, custom VJP and on-shard quantization live there),
and FP8 saved activations (`saved_activations`)."""

from gem_jax.quant.dense import Fp8Linear
from gem_jax.quant.saved_activations import fp8_residual
from pallas_kernels.mxfp8 import Fp8Gather, Fp8Recipe, Prologue, fp8_matmul, quantize_gathered, quantize_weight, shard_gradient

__all__ = ["Fp8Gather", "Fp8Linear", "Fp8Recipe", "Prologue", "fp8_matmul", "fp8_residual", "quantize_gathered", "quantize_weight", "shard_gradient"]
