"""Public JFA op: jagged softmax attention with an implementation switch."""

from __future__ import annotations

import jax

from pallas_kernels import _dispatch, jagged_layout
from pallas_kernels.jagged_flash_attention import reference
from pallas_kernels.jagged_flash_attention.config import SUPPORTED_HEAD_DIMS


def kernel_supports(q: jax.Array) -> bool:
    """Whether the Mosaic GPU kernels take queries (and same-typed keys/values) like `q`."""
    return q.dtype in (jax.numpy.bfloat16, jax.numpy.float16) and q.shape[-1] in SUPPORTED_HEAD_DIMS


def jagged_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets: jax.Array,
    *,
    max_seq_len: int,
    causal: bool = False,
    scale: float | None = None,
    implementation: str | _dispatch.Implementation | None = None,
) -> jax.Array:
    """Softmax attention inside each sequence of a jagged batch (GEM's JFA).

    For each sequence b with rows `s = offsets[b]:offsets[b+1]`::

        p = softmax((q[s] @ k[s].T) * scale  [+ causal mask])   # per head, float32
        out[s] = p @ v[s]

    Rows at or past `offsets[B]` are slack: ignored on input, zero on output,
    zero gradient. Source: GEM engineering description (Meta, 2025), jagged
    flash attention; FlashAttention-2 (Dao, 2023) for the online softmax.

    Args:
      q, k, v: `[T, H, D]` bf16/f16/f32, B sequences packed back to back.
      offsets: int32 `[B+1]`, `offsets[0] = 0`, non-decreasing, `offsets[B] <= T`.
      max_seq_len: static bound on every sequence length.
      causal: mask keys after the query position within each sequence.
      scale: multiplies the scores; default `1/sqrt(D)`.
      implementation: "xla" (the jnp reference), "pallas" (Mosaic GPU kernels,
        Hopper only; bf16/f16, D in {64, 128}) or None (pallas on a Hopper GPU
        when the kernels take these inputs, else xla).

    Returns:
      `[T, H, D]` in q.dtype.

    Raises:
      ValueError: mismatched shapes, malformed concrete offsets (naming the first
        bad index; traced offsets under `jit` are the caller's guarantee) or an
        unknown implementation.
      NotImplementedError: "pallas" asked for inputs the kernels do not take.
    """
    if q.ndim != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one [T, H, D] shape; got {q.shape}, {k.shape}, {v.shape}")
    jagged_layout.check_offsets(offsets, q.shape[0], max_seq_len)
    impl = _dispatch.resolve(implementation)
    if implementation is None and not kernel_supports(q):
        impl = _dispatch.Implementation.XLA
    if impl is _dispatch.Implementation.XLA:
        return reference.jagged_flash_attention(q, k, v, offsets, max_seq_len=max_seq_len, causal=causal, scale=scale)
    from pallas_kernels.jagged_flash_attention import kernel  # Mosaic GPU; imported only when used

    return kernel.jagged_flash_attention(q, k, v, offsets, max_seq_len=max_seq_len, causal=causal, scale=scale)
