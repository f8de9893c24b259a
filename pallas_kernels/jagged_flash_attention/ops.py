"""Public JFA op: jagged softmax attention with an implementation switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import jagged_layout
from pallas_kernels._src import dispatch, jagged_args, shared_lowering
from pallas_kernels.jagged_flash_attention import reference
from pallas_kernels.jagged_flash_attention.config import SUPPORTED_HEAD_DIMS

SUPPORT = dispatch.OpSupport(
    "jagged_flash_attention",
    kernel_dtypes=(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)),
    kernel_head_dims=SUPPORTED_HEAD_DIMS,
    cudnn=True,
)


def jagged_flash_attention(
    q,
    k,
    v,
    offsets: jax.Array | None = None,
    *,
    max_seq_len: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    implementation: str | dispatch.Implementation | None = None,
):
    """Softmax attention inside each sequence of a jagged batch (GEM's JFA).

    For each sequence b with rows `s = offsets[b]:offsets[b+1]`::

        p = softmax((q[s] @ k[s].T) * scale  [+ causal mask])   # per head, float32
        out[s] = p @ v[s]

    Rows at or past `offsets[B]` are slack: ignored on input, zero on output,
    zero gradient. Source: GEM engineering description (Meta, 2025), jagged
    flash attention; FlashAttention-2 (Dao, 2023) for the online softmax.

    Args:
      q, k, v: `[T, H, D]` bf16/f16/f32, B sequences packed back to back; or jagged
        containers of such values (any object with `.values` and `.offsets`, and
        optionally a static `.max_seq_len`, e.g. `gem_jax.Jagged`).
      offsets: int32 `[B+1]`, `offsets[0] = 0`, non-decreasing, `offsets[B] <= T`.
        Default: the containers' offsets. Offsets from several places must agree
        (the same array, or equal concrete values; traced offsets of one shape
        are the caller's guarantee).
      max_seq_len: static bound on every sequence length; default q's container's.
      causal: mask keys after the query position within each sequence.
      scale: multiplies the scores; default `1/sqrt(D)`.
      window: sliding window `(left, right)` of non-negative ints: the query at
        position i sees the keys at positions i - left ..= i + right of its
        sequence (with `causal`, right is 0 in effect: causal sliding window
        `(w, 0)`). The kernels skip key blocks wholly outside the window and
        mask the edge blocks; cuDNN takes only causal left windows (None then
        picks xla where it would pick cudnn). None: the whole sequence. Source: GEM engineering description (Meta, 2025),
        sliding-window self-attention over long histories.
      implementation: "xla" (the jnp reference), "pallas" (Mosaic GPU kernels;
        Hopper, bf16/f16, D in {64, 128}), "cudnn" (`jax.nn.dot_product_attention`
        on a padded `[B, max_seq_len, H, D]` copy; NVIDIA GPUs, bf16/f16), or None:
        pallas on a Hopper GPU when the kernels take the inputs, cudnn on other
        NVIDIA GPUs when cuDNN takes them, else xla (`pallas_kernels.describe_choice`
        says which and why).

    Returns:
      `[T, H, D]` in q's dtype; in q's container type (with these values) when q
      is a container. With max_seq_len 0 every row is slack: zeros.

    Raises:
      ValueError: mismatched shapes, q, k, v of different or non-floating dtypes,
        offsets missing or disagreeing, a missing max_seq_len or one that is not a
        non-negative int, malformed concrete offsets (naming the first bad index;
        traced offsets under `jit` are the caller's guarantee), a malformed
        window, an unknown implementation, or "cudnn" with inputs cuDNN does
        not take (including a window that is not a causal left window).
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside Mosaic
        GPU interpret mode), "cudnn" without an NVIDIA GPU.
      NotImplementedError: "pallas" asked for inputs the kernels do not take.
    """
    container, q, k, v, offsets, max_seq_len = jagged_args.self_attention_operands(q, k, v, offsets, max_seq_len)
    if window is not None:
        if len(window) != 2 or not all(jagged_args.is_count(w) for w in window):
            raise ValueError(f"window must be (left, right) of non-negative ints; got {window!r}")
        window = tuple(int(w) for w in window)
    jagged_layout.check_offsets(offsets, q.shape[0], max_seq_len)
    impl = dispatch.choose(SUPPORT, implementation, [q.dtype, k.dtype, v.dtype], q.shape[-1]).implementation
    if max_seq_len == 0:  # every sequence is empty and every row slack (zero): no implementation has work to launch
        out = jnp.zeros_like(q)
        return out if container is None else jagged_args.with_values(container, out)
    cudnn_window = window is None or (causal and window[1] == 0)
    if impl is dispatch.Implementation.CUDNN and implementation is None and not cudnn_window:
        impl = dispatch.Implementation.XLA  # cuDNN takes only causal left windows
    kwargs = dict(max_seq_len=max_seq_len, causal=causal, scale=scale, window=window)
    if impl is dispatch.Implementation.XLA:
        out = reference.jagged_flash_attention(q, k, v, offsets, **kwargs)
    elif impl is dispatch.Implementation.CUDNN:
        from pallas_kernels.jagged_flash_attention import cudnn

        out = cudnn.jagged_flash_attention(q, k, v, offsets, **kwargs)
    else:
        from pallas_kernels.jagged_flash_attention import vjp  # Mosaic GPU; imported only when used

        out = shared_lowering.call(vjp.jagged_flash_attention, q, k, v, offsets, static=kwargs)
    return out if container is None else jagged_args.with_values(container, out)
