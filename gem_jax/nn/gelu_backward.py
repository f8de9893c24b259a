"""An MLP's bias, GELU and down-projection whose backward runs the GELU's gradient in the GEMM's epilogue.

`bias_gelu_dense(h, up_bias, kernel, bias)` is `gelu(h + up_bias) @ kernel + bias`, the second half of
`Linear -> GELU -> Linear` from the first GEMM's product without its bias. The forward is the same
program XLA builds for `nnx.Linear(gelu(nnx.Linear(x)))` (on the GPU the first GEMM's cuBLAS epilogue
adds the bias and applies the GELU, keeping the pre-activation beside the output). The backward takes
the pre-activation's gradient and the up-projection bias's gradient from
`pallas_kernels.gelu_grad_matmul`: one GEMM pass whose epilogue multiplies by the GELU's derivative and
sums the columns (cuBLASLt's `DGELU_BGRAD` epilogue), where autodiff writes the GEMM's product, reads it
back beside the pre-activation and sums the result in a pass of its own (`benchmarks/step.md`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels
from pallas_kernels.gelu_grad_matmul import ops as gelu_grad
from pallas_kernels._src import manual_axes


def bias_gelu_dense(
    h: jax.Array, up_bias: jax.Array, kernel: jax.Array, bias: jax.Array, *, implementation: pallas_kernels.Implementation | None
) -> jax.Array:
    """`jax.nn.gelu(h + up_bias) @ kernel + bias` (the tanh GELU), differentiable in all four operands.

    The jnp equivalent, with the same forward values: `jnp.dot(jax.nn.gelu(h + up_bias), kernel) + bias`.
    Its backward differs from autodiff's in rounding only: the GEMM's float32 accumulator is multiplied
    by the GELU's derivative (computed in float32) before one rounding to `h`'s dtype, where autodiff
    rounds the product first; the biases' gradients are float32 sums rounded once.

    Args:
      h: `[..., N]`, the up-projection's GEMM product without its bias, in the compute dtype; its rows
        (all leading axes together) must be a multiple of 128 (token capacities are).
      up_bias: `[N]`, the up-projection's bias in `h`'s dtype.
      kernel: `[N, K]`, the down-projection's kernel in `h`'s dtype (flax's `[in, out]`).
      bias: `[K]`, the down-projection's bias in `h`'s dtype.
      implementation: the gradient's implementation, `pallas_kernels.gelu_grad_matmul`'s.

    Returns:
      `[..., K]` in `h`'s dtype.

    Raises:
      ValueError: operands of different dtypes; from `pallas_kernels.gelu_grad_matmul` in the backward (its
        shapes and rows).
    """
    dtypes = {name: jnp.result_type(x) for name, x in (("h", h), ("up_bias", up_bias), ("kernel", kernel), ("bias", bias))}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"bias_gelu_dense: h, up_bias, kernel and bias must share one dtype (the compute dtype), got {dtypes}")
    h, up_bias, kernel, bias = manual_axes.match_axes(h, up_bias, kernel, bias)
    return _bias_gelu_dense(h, up_bias, kernel, bias, implementation)


def takes(implementation: pallas_kernels.Implementation | None, rows: int, hidden: int, out: int, dtype) -> bool:
    """Whether `bias_gelu_dense` runs `pallas_kernels.gelu_grad_matmul`'s kernel for a layer pair of `rows`
    tokens, `hidden` and `out` features in `dtype` under `implementation` (None: where the kernel takes them).

    Raises:
      ValueError: "pallas" asked for inputs the kernel does not take (naming why).
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside interpret mode).
    """
    dy = jax.ShapeDtypeStruct((rows, out), dtype)
    w = jax.ShapeDtypeStruct((hidden, out), dtype)
    h = jax.ShapeDtypeStruct((rows, hidden), dtype)
    return gelu_grad.runs_kernel(dy, w, h, implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _bias_gelu_dense(h, up_bias, kernel, bias, implementation):
    return _forward(h + up_bias, kernel, bias)


def _forward(pre, kernel, bias):
    """`gelu(pre) @ kernel + bias`, as `nnx.Linear` computes it (`dot_general` over the last axis)."""
    y = lax.dot_general(jax.nn.gelu(pre), kernel, (((pre.ndim - 1,), (0,)), ((), ())))
    return y + bias


def _fwd(h, up_bias, kernel, bias, implementation):
    pre = h + up_bias
    return _forward(pre, kernel, bias), (pre, kernel, bias)


def _bwd(implementation, residuals, dy):
    pre, kernel, bias = residuals
    n, k = kernel.shape
    pre2, dy2 = pre.reshape(-1, n), dy.reshape(-1, k)
    dh, d_up_bias = gelu_grad.gelu_grad_matmul(dy2, kernel, pre2, implementation=implementation)
    # The down-projection's kernel gradient reads the GELU recomputed from the pre-activation (as under
    # `jax.checkpoint(jax.nn.gelu)`, `gem_jax.nn.layers.gelu`).
    d_kernel = lax.dot_general(jax.nn.gelu(pre2), dy2, (((0,), (0,)), ((), ())))
    d_bias = dy2.astype(jnp.float32).sum(axis=0)
    return dh.reshape(pre.shape), d_up_bias.astype(pre.dtype), d_kernel.astype(kernel.dtype), d_bias.astype(bias.dtype)


_bias_gelu_dense.defvjp(_fwd, _bwd)
