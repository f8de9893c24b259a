"""FP8 dense layer: a drop-in `nnx.Linear` whose matmul is `pallas_kernels.mxfp8.vjp.fp8_matmul`.

The quantization recipe, the custom VJP (MXFP8 forward and input-gradient GEMMs, a bf16
weight gradient, the RMSNorm or GELU before the layer fused into its input quantization)
and the on-shard weight quantization live beside the kernels in `pallas_kernels.mxfp8`;
this module is the Flax layer the model uses. Inside a sharded step the layer takes
its kernel's `Fp8Gather` (where the kernel is sharded) from the step's context by its
module path (`gem_jax.shard_context`); its recipe holds the numerics alone.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import shard_context
from pallas_kernels.mxfp8 import Fp8Recipe, Prologue, Rounding, fp8_matmul


class Fp8Linear(nnx.Module):
    """Drop-in `nnx.Linear` whose matmul runs in FP8 (`fp8_matmul`).

    Same constructor and call convention as `flax.nnx.Linear` (parameters `kernel [in, out]`
    and `bias [out]`, same initializers and metadata), so a model swaps one for the other
    with one line. Keep the last layers and task heads as `nnx.Linear` (bf16): FP8 there
    costs accuracy for little speed.

    Args:
      in_features, out_features: sizes; for the 32 recipe both should be multiples of 32
        (partial blocks work but waste GEMM tiles); a kernel quantized on its shard
        (`Fp8Gather`) must split into whole blocks along the sharded one.
      use_bias: add a bias (in `dtype`, after the FP8 GEMM).
      dtype: compute/output dtype; None: the promoted dtype of inputs and kernel.
      param_dtype: parameter dtype.
      kernel_init, bias_init: initializers (may carry partitioning metadata).
      recipe: `Fp8Recipe`.
      rngs: for the initializers.
      kernel_metadata, bias_metadata: extra metadata for the parameters.

    Attributes:
      path: the layer's module path in its model ("sequence_tower/blocks/0/qkv"), set
        once when the model is built (`gem_jax.nn.layers.name_layers`), or None: inside
        a sharded step the layer's `Fp8Gather` is the one the step's context holds for
        this path (`gem_jax.shard_context.fp8_gather`); without one the kernel is whole.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=nnx.initializers.lecun_normal(),
        bias_init=nnx.initializers.zeros_init(),
        recipe: Fp8Recipe = Fp8Recipe(),
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype), **kernel_metadata)
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.recipe = recipe
        self.path: str | None = None

    def __call__(
        self,
        inputs: jax.Array,
        *,
        norm: nnx.RMSNorm | None = None,
        gelu: bool = False,
        input_bias: jax.Array | None = None,
        add_bias: bool = True,
        key: jax.Array | None = None,
        keep_input: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """`inputs [..., in] -> [..., out]`: `self(inputs)`, `self(norm(inputs))` or `self(gelu(inputs + input_bias))`.

        With `norm` (an `nnx.RMSNorm` over the last axis of width `in`, its parameter left in
        the norm module) or `gelu=True` (`jax.nn.gelu`, tanh approximation), the norm or GELU
        runs in float32 in the input's quantization pass and its output is never written in
        high precision; the backward goes through it (`Prologue`), the norm's under the norm's
        `implementation` (`gem_jax.nn.layers.RMSNorm`: the one-pass backward kernel with "pallas",
        or None on a Hopper GPU; flax's `nnx.RMSNorm`: "xla"; `fp8_matmul(norm_implementation=)`).
        `key` feeds stochastic gradient rounding.

        An MLP's first layer may leave its bias to the second: `h = up(x, add_bias=False)`
        then `down(h, gelu=True, input_bias=up.bias[...])` adds it in float32 inside the
        GELU's quantization pass, so `h` is written once (by the GEMM) instead of rewritten
        with the bias before the GELU reads it. The bias's gradient flows back through
        `input_bias`.

        `keep_input` (with `norm`): return `(out, inputs)` for a pre-norm residual block that adds
        its branch to the returned `inputs`; their gradient joins the norm's backward pass
        (`fp8_matmul(keep_input=True)`), unless `inputs` are cast to another dtype first.

        Raises:
          ValueError: the last axis is not `in_features`, stochastic rounding without a key,
            both `norm` and `gelu`, `input_bias` without `gelu`, or a norm that is not a
            scaled RMSNorm over `in_features`, or `keep_input` without `norm`.
        """
        if inputs.shape[-1] != self.in_features:
            raise ValueError(f"inputs last axis {inputs.shape[-1]} != in_features {self.in_features}")
        if self.recipe.grad_rounding == Rounding.STOCHASTIC and key is None:
            raise ValueError('Fp8Recipe(grad_rounding="stochastic") needs key= at call time')
        kernel = self.kernel[...]
        gather = shard_context.fp8_gather(self.path)
        dtype = self.dtype or jnp.result_type(inputs.dtype, kernel.dtype)
        x = inputs.reshape(-1, self.in_features).astype(dtype)
        if norm is not None and gelu:
            raise ValueError("Fp8Linear: pass norm= or gelu=True, not both")
        if input_bias is not None and not gelu:
            raise ValueError("Fp8Linear: input_bias is added before the GELU: pass it with gelu=True")
        if keep_input and norm is None:
            raise ValueError("Fp8Linear: keep_input passes the input of the norm through: pass it with norm=")
        if norm is not None:
            scale = self._norm_scale(norm, inputs.dtype)
            through = keep_input and x.dtype == inputs.dtype  # a cast input's two cotangents are summed by XLA
            y = fp8_matmul(
                x, kernel, key, self.recipe, kernel.dtype, gather=gather, prologue=Prologue.RMSNORM, norm_scale=scale, eps=norm.epsilon,
                norm_implementation=getattr(norm, "implementation", "xla"), keep_input=through,
            )
            if through:
                y, x = y
                inputs = x.reshape(inputs.shape)
        else:
            prologue = Prologue.GELU if gelu else Prologue.NONE
            y = fp8_matmul(x, kernel, key, self.recipe, kernel.dtype, gather=gather, prologue=prologue, input_bias=input_bias)
        if self.bias is not None and add_bias:
            y = y + self.bias[...].astype(dtype)
        out = y.reshape(*inputs.shape[:-1], self.out_features)
        return (out, inputs) if keep_input else out

    def _norm_scale(self, norm: nnx.RMSNorm, input_dtype) -> jax.Array:
        """The gain of `norm` in its compute dtype (as `nnx.RMSNorm` casts it), after checking the norm."""
        if not isinstance(norm, nnx.RMSNorm) or norm.scale is None:
            raise ValueError(f"Fp8Linear: norm must be an nnx.RMSNorm with a scale, got {type(norm).__name__}")
        if norm.num_features != self.in_features or norm.reduction_axes not in (-1, (-1,)) or norm.feature_axes not in (-1, (-1,)):
            raise ValueError(
                f"Fp8Linear: norm must normalize the last axis of width in_features={self.in_features}; got "
                f"num_features={norm.num_features}, reduction_axes={norm.reduction_axes}, feature_axes={norm.feature_axes}"
            )
        if norm.axis_name is not None:
            raise ValueError("Fp8Linear: a norm with cross-device statistics (axis_name) cannot be fused")
        scale = norm.scale[...]
        return scale.astype(norm.dtype or jnp.result_type(input_dtype, scale.dtype))
