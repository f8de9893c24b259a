"""Public GDPA op: generalized (activation) attention over jagged Q and KV."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch, jagged_layout
from pallas_kernels.gdpa import config, reference
from pallas_kernels.gdpa.reference import Activation


def kernel_supports(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether the Mosaic GPU kernels take these operands: one dtype, bf16 or f16, D in {64, 128}."""
    same = k.dtype == q.dtype and v.dtype == q.dtype
    return same and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] in config.SUPPORTED_HEAD_DIMS


def gdpa(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offsets: jax.Array | None,
    kv_offsets: jax.Array,
    *,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    activation: str | Activation = Activation.GELU,
    scale: float | None = None,
    broadcast_q: bool = False,
    implementation: str | _dispatch.Implementation | None = None,
) -> jax.Array:
    """Generalized dot-product attention (GEM's GDPA): an activation instead of softmax.

    For each sequence b, with Q rows `q_offsets[b]:q_offsets[b+1]` and KV rows
    `kv_offsets[b]:kv_offsets[b+1]`::

        out_b = act((Q_b @ K_b.T) * scale) @ V_b        # per head, float32 inside

    No normalisation over keys, so a zero-length KV gives a zero output.
    Sources: GEM engineering description (Meta, 2025), GDPA; HSTU pointwise
    attention (Zhai et al., 2024).

    Args:
      q: `[Tq, H, D]` jagged queries, or with `broadcast_q` one dense `[Lq, H, D]`
        set of learned queries shared by every sequence.
      k, v: `[Tkv, H, D]` jagged keys and values.
      q_offsets: int32 `[B+1]`, `offsets[0] = 0`, non-decreasing, `offsets[B] <= Tq`
        (ignored, may be None, with `broadcast_q`).
      kv_offsets: int32 `[B+1]`, likewise with `offsets[B] <= Tkv`.
      max_seq_len_q, max_seq_len_kv: static bounds (>= 0) on the lengths. Every
        sequence must fit its bound: concrete offsets are checked here, traced
        ones (under `jit`) cannot be, and a longer sequence then gives results
        that differ between implementations.
      activation: "gelu" (tanh form), "gelu_erf", "silu", "relu", "none", or
        "gelu_poly6" (a polynomial that matches GELU only for |scores| <= 1.5;
        see `pallas_kernels.gdpa.activations`).
      scale: applied to the scores before the activation; default `1/sqrt(D)`.
      broadcast_q: pooled attention with dense learned queries.
      implementation: "xla" (the jnp reference), "pallas" (the Mosaic GPU kernels;
        Hopper, bf16/f16 inputs, D in {64, 128}) or None: "pallas" on a Hopper GPU
        when the kernels take these inputs, else "xla".

    Slack rows (past `offsets[B]`) may hold anything, NaN included. Real rows
    must be finite: the kernels' boundary tiles read a neighbouring sequence's
    rows (masked out, but 0 * inf is NaN).

    Returns:
      `[Tq, H, D]` (slack rows zero), or `[B * Lq, H, D]` with `broadcast_q`; q.dtype.

    Raises:
      ValueError: mismatched shapes, malformed concrete offsets (naming the
        first bad index), a negative bound, unknown activation or implementation;
        with "pallas", inputs the kernels do not take (dtype, head dim).
    """
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q [Tq, H, D] and k, v [Tkv, H, D] must share H and D; got {q.shape}, {k.shape}, {v.shape}")
    if not broadcast_q and (q_offsets is None or q_offsets.shape != kv_offsets.shape):
        got = None if q_offsets is None else q_offsets.shape
        raise ValueError(
            f"q_offsets and kv_offsets must both be int32 [B+1] unless broadcast_q=True; got {got} and {kv_offsets.shape}"
        )
    if max_seq_len_q < 0 or max_seq_len_kv < 0:
        raise ValueError(f"max_seq_len_q and max_seq_len_kv must be >= 0; got {max_seq_len_q}, {max_seq_len_kv}")
    jagged_layout.check_offsets(kv_offsets, k.shape[0], max_seq_len_kv, name="kv_offsets")
    if not broadcast_q:
        jagged_layout.check_offsets(q_offsets, q.shape[0], max_seq_len_q, name="q_offsets")
    reference.activation_fn(activation)  # validates the name
    impl = _dispatch.resolve(implementation)
    if implementation is None and not kernel_supports(q, k, v):
        impl = _dispatch.Implementation.XLA
    kwargs = dict(
        max_seq_len_q=max_seq_len_q,
        max_seq_len_kv=max_seq_len_kv,
        activation=activation,
        scale=scale,
        broadcast_q=broadcast_q,
    )
    if impl is _dispatch.Implementation.XLA:
        return reference.gdpa(q, k, v, q_offsets, kv_offsets, **kwargs)
    from pallas_kernels.gdpa import kernel  # Mosaic GPU; imported only when used

    return kernel.gdpa(q, k, v, q_offsets, kv_offsets, **kwargs)
