"""FP8 dense layer: a drop-in `nnx.Linear` whose matmul is `pallas_kernels.mxfp8.vjp.fp8_matmul`.

The quantization recipe, the custom VJP (MXFP8 forward and input-gradient GEMMs, a bf16
weight gradient) and the on-shard weight quantization live beside the kernels in
`pallas_kernels.mxfp8`; this module is the Flax layer the model uses.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.mxfp8 import Rounding
from pallas_kernels.mxfp8 import Fp8Recipe, fp8_matmul


class Fp8Linear(nnx.Module):
    """Drop-in `nnx.Linear` whose matmul runs in FP8 (`fp8_matmul`).

    Same constructor and call convention as `flax.nnx.Linear` (parameters `kernel [in, out]`
    and `bias [out]`, same initializers and metadata), so a model swaps one for the other
    with one line. Keep the last layers and task heads as `nnx.Linear` (bf16): FP8 there
    costs accuracy for little speed.

    Args:
      in_features, out_features: sizes; for the 32 recipe both should be multiples of 32
        (partial blocks work but waste GEMM tiles), with `fsdp_axis` the sharded one must
        split into whole blocks.
      use_bias: add a bias (in `dtype`, after the FP8 GEMM).
      dtype: compute/output dtype; None: the promoted dtype of inputs and kernel.
      param_dtype: parameter dtype.
      kernel_init, bias_init: initializers (may carry partitioning metadata).
      recipe: `Fp8Recipe`.
      rngs: for the initializers.
      kernel_metadata, bias_metadata: extra metadata for the parameters.
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

    def __call__(self, inputs: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """`inputs [..., in] -> [..., out]`; `key` feeds stochastic gradient rounding.

        Raises:
          ValueError: the last axis is not `in_features`, or stochastic rounding without a key.
        """
        if inputs.shape[-1] != self.in_features:
            raise ValueError(f"inputs last axis {inputs.shape[-1]} != in_features {self.in_features}")
        if self.recipe.grad_rounding == Rounding.STOCHASTIC and key is None:
            raise ValueError('Fp8Recipe(grad_rounding="stochastic") needs key= at call time')
        kernel = self.kernel[...]
        dtype = self.dtype or jnp.result_type(inputs.dtype, kernel.dtype)
        x = inputs.reshape(-1, self.in_features).astype(dtype)
        y = fp8_matmul(x, kernel, key, self.recipe, kernel.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y.reshape(*inputs.shape[:-1], self.out_features)
