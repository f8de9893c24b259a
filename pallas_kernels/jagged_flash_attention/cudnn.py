"""JFA through cuDNN: jagged rows scattered to a padded layout, cuDNN fused attention with lengths, rows gathered back.

`jax.nn.dot_product_attention` takes padded `[B, N, H, D]` inputs and per-sequence
lengths (cuDNN's PADDING / PADDING_CAUSAL masks); gradients flow through jax's own
VJP of it and through the gather/scatter of the layout change. The layout change
is the same for any `implementation` of `jax.nn.dot_product_attention`, so the CPU
tests check it with "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.jagged_layout import from_padded, to_padded


def jagged_flash_attention(q, k, v, offsets, *, max_seq_len: int, causal: bool = False, scale: float | None = None,
                           window: tuple[int, int] | None = None, implementation: str = "cudnn") -> jax.Array:
    """Jagged softmax attention through `jax.nn.dot_product_attention` on a padded layout.

    Equivalent jnp::

        lengths = offsets[1:] - offsets[:-1]
        qp, kp, vp = (to_padded(x, offsets, max_seq_len) for x in (q, k, v))   # [B, N, H, D]
        out = jax.nn.dot_product_attention(qp, kp, vp, scale=scale, is_causal=causal, local_window_size=window,
                                           query_seq_lengths=lengths, key_value_seq_lengths=lengths)
        return from_padded(out, offsets, T)                                        # slack rows 0

    Same contract as `pallas_kernels.jagged_flash_attention` (which validates the
    arguments); every sequence must fit `max_seq_len` (rows past it are dropped).
    Padding costs `B x max_seq_len` rows of memory and work.

    Args:
      q, k, v: `[T, H, D]`; cuDNN takes bf16/f16 with D a multiple of 8 (<= 256 on Hopper).
      offsets: int32 `[B+1]`.
      max_seq_len: static bound on every sequence length: the padded length N.
      causal: mask keys after the query position within each sequence.
      scale: multiplies the scores; default `1/sqrt(D)`.
      window: `(left, right)` sliding window; cuDNN takes only `causal` with
        `(left, 0)` (passed as `local_window_size`).
      implementation: passed to `jax.nn.dot_product_attention` ("cudnn"; "xla" in tests).

    Returns:
      `[T, H, D]` in q.dtype; slack rows (at or past `offsets[B]`) are 0.
    """
    capacity, _, head_dim = q.shape
    batch = offsets.shape[0] - 1
    if capacity == 0 or batch == 0 or max_seq_len == 0:
        return jnp.zeros_like(q)
    scale = head_dim**-0.5 if scale is None else float(scale)
    if window is not None and implementation == "cudnn" and not (causal and window[1] == 0):
        raise ValueError(f"cuDNN attention takes only causal left windows (left, 0); got window={window}, causal={causal}")
    lengths = (offsets[1:] - offsets[:-1]).astype(jnp.int32)
    qp, kp, vp = (to_padded(x, offsets, max_seq_len) for x in (q, k, v))
    out = jax.nn.dot_product_attention(
        qp,
        kp,
        vp,
        scale=scale,
        is_causal=causal,
        local_window_size=window,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )
    return from_padded(out.astype(q.dtype), offsets, capacity)
