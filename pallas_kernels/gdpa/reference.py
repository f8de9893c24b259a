"""Pure-jnp generalized dot-product attention: the semantic spec of GDPA and its "xla" path.

`out_b = act((Q_b K_b^T) * scale) V_b` per sequence, no softmax. Q and KV are
jagged with separate offsets; both are padded to their static maxima inside
(B x Nq x Nkv work, never a T x T matrix over the packed batch). The matmuls take
their operands in the inputs' dtype and accumulate in float32; scores and the
activation run in float32, and the activated scores are cast to V's dtype for the
second matmul, as the kernels do (no float32 GEMM for bfloat16 inputs).
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp

from pallas_kernels.jagged_layout import from_padded, to_padded
from pallas_kernels.mixed_precision import einsum_float32


class Activation(enum.StrEnum):
    GELU = "gelu"  # tanh approximation (Hendrycks & Gimpel, 2016)
    GELU_ERF = "gelu_erf"  # exact erf form
    # Degree-6 Maclaurin polynomial of gelu_erf; matches GELU only for small |x|
    # (see `pallas_kernels.gdpa.activations`).
    GELU_POLY6 = "gelu_poly6"
    SILU = "silu"
    RELU = "relu"
    NONE = "none"  # linear attention


def activation_fn(activation: str | Activation):
    """The float32 elementwise function for `activation`.

    Raises:
      ValueError: an unknown activation name.
    """
    try:
        activation = Activation(activation)
    except ValueError:
        raise ValueError(f"unknown activation {activation!r}; expected one of {[a.value for a in Activation]}") from None
    return {
        Activation.GELU: lambda x: jax.nn.gelu(x, approximate=True),
        Activation.GELU_ERF: lambda x: jax.nn.gelu(x, approximate=False),
        Activation.GELU_POLY6: _gelu_poly6,
        Activation.SILU: jax.nn.silu,
        Activation.RELU: jax.nn.relu,
        Activation.NONE: lambda x: x,
    }[activation]


def _gelu_poly6(x):
    """x/2 + x^2 (c2 + x^2 (c4 + x^2 c6)): the degree-6 Maclaurin polynomial of erf GELU."""
    c2 = 1.0 / math.sqrt(2.0 * math.pi)
    x2 = x * x
    return 0.5 * x + x2 * (c2 + x2 * (-c2 / 6.0 + x2 * (c2 / 40.0)))


def gdpa_padded(q, k, v, q_lengths, kv_lengths, *, activation, scale: float, causal: bool = False):
    """`act(Q K^T * scale) V` on padded inputs; q `[B, Nq, H, D]`, k/v `[B, Nkv, H, D]`.

    Padded KV positions contribute nothing; padded query rows give 0; with
    `causal`, keys after the query's position contribute nothing. Returns
    float32 `[B, Nq, H, D]`.
    """
    act = activation_fn(activation)
    s = einsum_float32("bqhd,bkhd->bhqk", q, k) * scale
    q_pos = jnp.arange(q.shape[1])
    kv_pos = jnp.arange(k.shape[1])
    mask = (q_pos[None, :] < q_lengths[:, None])[:, None, :, None] & (kv_pos[None, :] < kv_lengths[:, None])[:, None, None, :]
    if causal:
        mask = mask & (kv_pos[None, :] <= q_pos[:, None])[None, None]
    p = jnp.where(mask, act(jnp.where(mask, s, 0.0)), 0.0)
    return einsum_float32("bhqk,bkhd->bqhd", p.astype(v.dtype), v)


def gdpa(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    *,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    activation: str | Activation = Activation.GELU,
    scale: float | None = None,
    output_scale: float = 1.0,
    broadcast_q: bool = False,
    causal: bool = False,
):
    """Reference for `pallas_kernels.gdpa` (same arguments)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kp, vp = (to_padded(x, kv_offsets, max_seq_len_kv) for x in (k, v))
    kv_lengths = kv_offsets[1:] - kv_offsets[:-1]
    batch = kv_offsets.shape[0] - 1
    if broadcast_q:
        lq = q.shape[0]
        qp = jnp.broadcast_to(q[None], (batch,) + q.shape)
        out = gdpa_padded(qp, kp, vp, jnp.full((batch,), lq), kv_lengths, activation=activation, scale=scale)
        return (out * output_scale).reshape((batch * lq,) + q.shape[1:]).astype(q.dtype)
    qp = to_padded(q, q_offsets, max_seq_len_q)
    q_lengths = q_offsets[1:] - q_offsets[:-1]
    out = gdpa_padded(qp, kp, vp, q_lengths, kv_lengths, activation=activation, scale=scale, causal=causal)
    return from_padded(out * output_scale, q_offsets, q.shape[0]).astype(q.dtype)
