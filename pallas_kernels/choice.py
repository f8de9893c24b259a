"""Which implementation an op's `implementation=None` (or a given name) runs here, and why.

For start-up logs: `describe_choice("gdpa", jnp.bfloat16, 64)` returns the
`Implementation` the op would run for such inputs on this machine and a
one-line reason, from the same decision the op makes.
"""

from __future__ import annotations

import jax

from pallas_kernels._src import dispatch
from pallas_kernels.block_local_attention import ops as block_local_ops
from pallas_kernels.gdpa import ops as gdpa_ops
from pallas_kernels.gelu_grad_matmul import ops as gelu_grad_matmul_ops
from pallas_kernels.jagged_flash_attention import ops as jfa_ops
from pallas_kernels.mxfp8 import ops as mxfp8_ops
from pallas_kernels.qk_norm_rope import ops as qk_norm_rope_ops
from pallas_kernels.rms_norm import ops as rms_norm_ops

_OPS = {op.name: op for op in (jfa_ops.SUPPORT, gdpa_ops.SUPPORT, block_local_ops.SUPPORT, mxfp8_ops.SUPPORT, *mxfp8_ops.QUANTIZE_SUPPORTS, qk_norm_rope_ops.SUPPORT, rms_norm_ops.SUPPORT, gelu_grad_matmul_ops.SUPPORT)}


def _support(op_name: str) -> dispatch.OpSupport:
    try:
        return _OPS[op_name]
    except KeyError:
        raise ValueError(f"unknown op {op_name!r}; expected one of {sorted(_OPS)}") from None


def implementations(op_name: str) -> tuple[dispatch.Implementation, ...]:
    """The implementation names `op_name` accepts besides None (e.g. gdpa has no CUDNN).

    Raises:
      ValueError: an unknown op name.
    """
    return _support(op_name).implementations


def describe_choice(
    op_name: str,
    dtype,
    head_dim: int | None = None,
    *,
    implementation: str | dispatch.Implementation | None = None,
    device: jax.Device | None = None,
) -> dispatch.Choice:
    """The implementation `op_name` runs for q/k/v of `dtype` and `head_dim`, and a one-line reason.

    Args:
      op_name: "jagged_flash_attention", "gdpa", "block_local_attention", "mxfp8_matmul",
        "quantize_mxfp8", "rmsnorm_quantize_mxfp8", "gelu_quantize_mxfp8", "qk_norm_rope", "rms_norm" or "gelu_grad_matmul".
      dtype: the inputs' dtype (e.g. jnp.bfloat16).
      head_dim: the attention head dim D (None for the mxfp8 ops and gelu_grad_matmul; the normalised width d for rms_norm).
      implementation: the setting the op will get (None: the op chooses).
      device: the device to decide for (default: the first device).

    Returns:
      `Choice(implementation, reason)`, e.g. `(Implementation.PALLAS, "Hopper GPU (gpu NVIDIA
      H200 (compute capability 9.0)) and the Pallas kernels take these inputs")`.

    Raises:
      ValueError: an unknown op or implementation name, or "cudnn" for an op without it.
      ImplementationUnavailableError: a name this machine cannot run, as the op raises it.
    """
    return dispatch.choose(_support(op_name), implementation, [dtype], head_dim, device)
