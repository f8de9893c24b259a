"""FP8 dense matmul: MXFP8 forward and input-gradient GEMMs, higher-precision weight gradient (custom_vjp).

For `y = x @ w` (`x [T, in]`, `w [in, out]`) with square-block weight quantization
`(wq, sw) = quantize(w)`:

    forward   y  = mxfp8_matmul(q(x), wq.T)          # b = w^T [out, in], K = in
    dgrad     dx = mxfp8_matmul(q(dy), wq)            # b = w   [in, out], K = out: the same
                                                      # quantization, untransposed bytes
    wgrad     dw = deq(q(x)).T @ dy                   # bf16 inputs, float32 accumulation

The square weight tiles are what let the backward reuse the forward quantization (one
quantization of w per step; only the 8-bit bytes are transposed for the K-major
forward operand). The weight gradient uses the saved FP8 input dequantized to bf16,
which is the exact gradient of the quantized forward with respect to the quantized
weight (straight-through for the rounding), and keeps 8-bit residuals.

Sources: GEM engineering description (Meta, 2025): MXFP8 32x32 blocks, weight gradients
in higher precision, last layers in BF16, weights quantized before the FSDP all-gather;
DeepSeek-V3 (arXiv:2412.19437) section 3.3 for 1x128 / 128x128 blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp8.reference import Rounding
from pallas_kernels.mxfp8.fsdp import quantize_gathered, shard_gradient
from pallas_kernels.mxfp8.ops import dequantize_mxfp8, mxfp8_matmul, quantize_mxfp8


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 dense layer quantizes.

    Attributes:
      block: 32 for MXFP8 (32x32 tiles for activations, weights and gradients, promotion
        every 32 K), or 128 for the 128-wide-K variant (1x128 activation/gradient tiles,
        128x128 weight tiles, promotion every 128 K: DeepSeek-V3's granularity).
      grad_rounding: rounding of the output gradient before the dgrad GEMM; "stochastic"
        needs a `key` at call time.
      fsdp_axis: if set, the kernel (sharded along `fsdp_dim` over this mesh axis, or
        these axes, outermost first) is quantized on each shard and the 8-bit data
        all-gathered (`quantize_gathered`); inside a `shard_map` over those axes the
        kernel given is this device's shard, and its gradient is reduce-scattered back
        to it (`shard_gradient`).
      fsdp_dim: the sharded dimension of the kernel `[in, out]`.
      implementation: for `mxfp8_matmul`: "xla", "pallas" or None (pallas on Hopper).
      config: `pallas_kernels.mxfp8.kernel_matmul.TuningConfig` for the Pallas GEMMs, or
        None for the default of the block size.
    """

    block: int = 32
    grad_rounding: str = "nearest"
    fsdp_axis: str | tuple[str, ...] | None = None
    fsdp_dim: int = 0
    implementation: str | None = None
    config: Any = None

    def __post_init__(self):
        if self.block not in (32, 128):
            raise ValueError(f"Fp8Recipe.block must be 32 or 128, got {self.block}")
        if self.grad_rounding not in tuple(Rounding):
            raise ValueError(f"Fp8Recipe.grad_rounding must be one of {[r.value for r in Rounding]}, got {self.grad_rounding!r}")
        if self.fsdp_dim not in (0, 1):
            raise ValueError(f"Fp8Recipe.fsdp_dim must be 0 or 1, got {self.fsdp_dim}")

    @property
    def act_block(self) -> tuple[int, int]:
        """Quantization tile of activations and output gradients `[T, features]`."""
        return (32, 32) if self.block == 32 else (1, 128)

    @property
    def weight_block(self) -> tuple[int, int]:
        """Quantization tile of the kernel `[in, out]` (square, so its transpose reuses it)."""
        return (self.block, self.block)


def quantize_weight(w: jax.Array, recipe: Fp8Recipe) -> tuple[jax.Array, jax.Array]:
    """`(wq [in, out], sw)`, on the FSDP shard then gathered if `recipe.fsdp_axis` is set."""
    if recipe.fsdp_axis is None:
        return quantize_mxfp8(w, block=recipe.weight_block)
    return quantize_gathered(w, axis_name=recipe.fsdp_axis, dim=recipe.fsdp_dim, block=recipe.weight_block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_matmul(x: jax.Array, w: jax.Array, key: jax.Array | None, recipe: Fp8Recipe, w_dtype: Any) -> jax.Array:
    """`x @ w` with FP8 forward and dgrad GEMMs and a bf16/f32 weight gradient.

    Equivalent jnp (forward)::

        dequantize(quantize(x)) @ dequantize(quantize(w))

    Args:
      x: `[T, in]` float; its dtype is the output dtype.
      w: `[in, out]` float of dtype `w_dtype` (the master weight).
      key: PRNG key for stochastic rounding of the output gradient, or None.
      recipe: the quantization recipe.
      w_dtype: dtype of `w` (the weight gradient is returned in it).

    Returns:
      `[T, out]` in x.dtype.
    """
    return _fp8_matmul_fwd(x, w, key, recipe, w_dtype)[0]


def _fp8_matmul_fwd(x, w, key, recipe, w_dtype):
    del w_dtype
    xq, sx = quantize_mxfp8(x, block=recipe.act_block)
    wq, sw = quantize_weight(w, recipe)
    y = mxfp8_matmul(xq, sx, wq.T, sw.T, out_dtype=x.dtype, implementation=recipe.implementation, config=recipe.config)
    # `w` (the master weight, alive anyway) only lends its sharding to the weight gradient.
    return y, (xq, sx, wq, sw, key, w)


def _with_sharding_of(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` resharded to `like`'s sharding type under an explicit mesh (a no-op otherwise)."""
    want = jax.typeof(like).sharding.spec
    return x if jax.typeof(x).sharding.spec == want else jax.sharding.reshard(x, want)


def _fp8_matmul_bwd(recipe, w_dtype, residuals, dy):
    xq, sx, wq, sw, key, w = residuals
    dyq, sdy = quantize_mxfp8(dy, block=recipe.act_block, rounding=recipe.grad_rounding, key=key)
    dx = mxfp8_matmul(dyq, sdy, wq, sw, out_dtype=dy.dtype, implementation=recipe.implementation, config=recipe.config)
    x16 = dequantize_mxfp8(xq, sx, block=recipe.act_block, dtype=jnp.bfloat16)
    dw = jnp.dot(x16.T, dy.astype(jnp.bfloat16), preferred_element_type=jnp.float32).astype(w_dtype)
    if recipe.fsdp_axis is not None:
        dw = shard_gradient(dw, axis_name=recipe.fsdp_axis, dim=recipe.fsdp_dim)
    return _with_sharding_of(dx, xq), _with_sharding_of(dw, w), None


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)
