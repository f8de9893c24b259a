"""Public GDPA op: generalized (activation) attention over jagged Q and KV."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels import jagged_layout
from pallas_kernels._src import dispatch, jagged_args, shared_lowering
from pallas_kernels.gdpa import config, reference
from pallas_kernels.gdpa.reference import Activation


SUPPORT = dispatch.OpSupport(
    "gdpa",
    kernel_dtypes=(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)),
    kernel_head_dims=config.SUPPORTED_HEAD_DIMS,
)  # no cuDNN path: cuDNN has no activation attention


def gdpa(
    q,
    k,
    v,
    q_offsets: jax.Array | None = None,
    kv_offsets: jax.Array | None = None,
    *,
    max_seq_len_q: int | None = None,
    max_seq_len_kv: int | None = None,
    activation: str | Activation = Activation.GELU,
    scale: float | None = None,
    output_scale: float = 1.0,
    broadcast_q: bool = False,
    causal: bool = False,
    implementation: str | dispatch.Implementation | None = None,
):
    """Generalized dot-product attention (GEM's GDPA): an activation instead of softmax.

    For each sequence b, with Q rows `q_offsets[b]:q_offsets[b+1]` and KV rows
    `kv_offsets[b]:kv_offsets[b+1]`::

        out_b = act((Q_b @ K_b.T) * scale) @ V_b * output_scale   # per head, float32 inside

    No normalisation over keys, so a zero-length KV gives a zero output.
    Sources: GEM engineering description (Meta, 2025), GDPA; HSTU pointwise
    attention (Zhai et al., 2024).

    Args:
      q: `[Tq, H, D]` jagged queries, or with `broadcast_q` one dense `[Lq, H, D]`
        set of learned queries shared by every sequence.
      k, v: `[Tkv, H, D]` jagged keys and values.
        Jagged operands may also be jagged containers: any object with `.values`
        and `.offsets`, optionally a static `.max_seq_len` (e.g. `gem_jax.Jagged`).
      q_offsets: int32 `[B+1]`, `offsets[0] = 0`, non-decreasing, `offsets[B] <= Tq`
        (ignored, may be None, with `broadcast_q`). Default: q's container's.
      kv_offsets: int32 `[B+1]`, likewise with `offsets[B] <= Tkv`. Default: the
        offsets of k's and v's containers. Offsets from several places must agree
        (the same array, or equal concrete values; traced offsets of one shape
        are the caller's guarantee).
      max_seq_len_q, max_seq_len_kv: static bounds (>= 0) on the lengths; default
        q's and k's containers' `max_seq_len` (with `broadcast_q`, max_seq_len_q is
        Lq, q's row count, and may be left None). Every
        sequence must fit its bound: concrete offsets are checked here, traced
        ones (under `jit`) cannot be, and a longer sequence then gives results
        that differ between implementations.
      activation: "gelu" (tanh form), "gelu_erf", "silu", "relu", "none", or
        "gelu_poly6" (a polynomial that matches GELU only for |scores| <= 1.5;
        see `pallas_kernels.gdpa.activations`).
      scale: applied to the scores before the activation; default `1/sqrt(D)`.
      output_scale: a finite Python number, applied to the float32 output before
        its cast, inside the kernels' last step (no pass of its own); HSTU's 1/N
        (Zhai et al., 2024), which cannot go into `scale`, as SiLU is not
        homogeneous.
      broadcast_q: pooled attention with dense learned queries.
      causal: jagged self-attention where query i of a sequence sees keys
        0..i of the same sequence (HSTU's pointwise causal attention, Zhai et
        al., 2024; its division by the length bound N is `output_scale=1/N`).
        Needs `q_offsets == kv_offsets` (concrete ones are checked; traced ones
        are the caller's guarantee) and no `broadcast_q`. The kernels skip the
        tiles above the diagonal (their work list visits only column steps on
        the causal side of each row tile) and mask the diagonal tiles.
      implementation: "xla" (the jnp reference), "pallas" (the Mosaic GPU kernels;
        Hopper, bf16/f16 inputs, D in {64, 128}) or None: "pallas" on a Hopper GPU
        when the kernels take these inputs, else "xla". GDPA has no "cudnn" path
        (cuDNN has no activation attention): "cudnn" is a ValueError, so a model
        whose setting is "cudnn" passes None (or "xla") to gdpa.

    Slack rows (past `offsets[B]`) may hold anything, NaN included. Real rows
    must be finite: the kernels' boundary tiles read a neighbouring sequence's
    rows (masked out, but 0 * inf is NaN).

    Returns:
      `[Tq, H, D]` (slack rows zero), or `[B * Lq, H, D]` with `broadcast_q`; q.dtype.
      In q's container type (with these values) when q is a container.

    Raises:
      ValueError: mismatched shapes, offsets or bounds missing, offsets that
        disagree, malformed concrete offsets (naming the first bad index), a
        negative bound, a `broadcast_q` max_seq_len_q other than Lq, unknown
        activation or implementation, an
        `output_scale` that is not a finite number (a traced one included),
        "cudnn"; with
        "pallas", inputs the kernels do not take (dtype, head dim).
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside
        Mosaic GPU interpret mode).
    """
    container = q if jagged_args.is_jagged(q) else None
    if broadcast_q and container is not None:
        raise ValueError("broadcast_q takes dense learned queries [Lq, H, D], not a jagged container")
    kv_offsets = jagged_args.shared_offsets(kv_offsets, "kv_offsets", k=k, v=v)
    if kv_offsets is None:
        raise ValueError("kv_offsets missing: pass kv_offsets=, or k and v as jagged containers (with .values and .offsets)")
    if broadcast_q:
        if max_seq_len_q is not None and jagged_args.bound(max_seq_len_q, None, "max_seq_len_q", "q") != q.shape[0]:
            raise ValueError(f"with broadcast_q, max_seq_len_q is q's row count Lq = {q.shape[0]} (or None), got {max_seq_len_q!r}")
        max_seq_len_q = q.shape[0]
    else:
        q_offsets = jagged_args.shared_offsets(q_offsets, "q_offsets", q=q)
        if q_offsets is None:
            raise ValueError("q_offsets missing: pass q_offsets=, or q as a jagged container, or broadcast_q=True")
        max_seq_len_q = jagged_args.bound(max_seq_len_q, container, "max_seq_len_q", "q")
    max_seq_len_kv = jagged_args.bound(max_seq_len_kv, k if jagged_args.is_jagged(k) else v, "max_seq_len_kv", "k")
    q, k, v = (jagged_args.values_of(x) for x in (q, k, v))
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q [Tq, H, D] and k, v [Tkv, H, D] must share H and D; got {q.shape}, {k.shape}, {v.shape}")
    if not broadcast_q and q_offsets.shape != kv_offsets.shape:
        shapes = f"{q_offsets.shape} and {kv_offsets.shape}"
        raise ValueError(f"q_offsets and kv_offsets must both be int32 [B+1] unless broadcast_q=True; got {shapes}")
    jagged_layout.check_offsets(kv_offsets, k.shape[0], max_seq_len_kv, name="kv_offsets")
    if not broadcast_q:
        jagged_layout.check_offsets(q_offsets, q.shape[0], max_seq_len_q, name="q_offsets")
    reference.activation_fn(activation)  # validates the name
    if not isinstance(output_scale, numbers.Real) or not math.isfinite(output_scale):
        raise ValueError(f"output_scale must be a finite Python number (the kernels take it as a constant), got {output_scale!r}")
    if causal and broadcast_q:
        raise ValueError("causal needs jagged queries (self-attention), not broadcast_q")
    if causal:
        jagged_args.check_same("q_offsets", q_offsets, "kv_offsets", kv_offsets)
    impl = dispatch.choose(SUPPORT, implementation, [q.dtype, k.dtype, v.dtype], q.shape[-1]).implementation
    kwargs = dict(
        max_seq_len_q=max_seq_len_q,
        max_seq_len_kv=max_seq_len_kv,
        activation=activation,
        scale=scale,
        output_scale=output_scale,
        broadcast_q=broadcast_q,
    )
    if impl is dispatch.Implementation.XLA:
        out = reference.gdpa(q, k, v, q_offsets, kv_offsets, causal=causal, **kwargs)
    else:
        from pallas_kernels.gdpa import vjp  # Mosaic GPU; imported only when used

        out = shared_lowering.call(vjp.gdpa, q, k, v, q_offsets, kv_offsets, static=dict(kwargs, causal=causal))
    return out if container is None else jagged_args.with_values(container, out)
