"""Public block-local attention op: softmax inside fixed blocks of each sequence, RoPE fused."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import jagged_layout
from pallas_kernels._src import dispatch, jagged_args, shared_lowering
from pallas_kernels.block_local_attention import reference
from pallas_kernels.block_local_attention.config import KERNEL_BLOCK_SIZES, SUPPORTED_HEAD_DIMS

SUPPORT = dispatch.OpSupport(
    "block_local_attention",
    kernel_dtypes=(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)),
    kernel_head_dims=SUPPORTED_HEAD_DIMS,
)


def block_local_attention(
    q,
    k,
    v,
    offsets: jax.Array | None = None,
    *,
    block_size: int = 64,
    positions: jax.Array | None = None,
    rope_base: float | None = None,
    max_seq_len: int | None = None,
    scale: float | None = None,
    implementation: str | dispatch.Implementation | None = None,
):
    """Softmax attention inside fixed blocks aligned to each sequence's start, with fused RoPE.

    Sequence b (rows `offsets[b]:offsets[b+1]`) is cut into blocks of
    `block_size` rows from its first row (the last block partial); each query
    attends to the keys of its own block only. For a block with rows s::

        qr, kr = apply_rope(q[s], pos[s], rope_base), apply_rope(k[s], pos[s], rope_base)
        out[s] = softmax(qr @ kr.T * scale) @ v[s]       # per head, float32

    where `apply_rope` is the rotate-half rotary embedding computed in float32
    and rounded to q's dtype (the convention of `gem_jax.nn.layers.apply_rope`),
    skipped when `rope_base` is None. Rows at or past `offsets[B]` are slack:
    ignored on input, zero on output, zero gradient. Sources: GEM engineering
    description (Meta, 2025), block-local attention with RoPE fused into the
    kernel and its backward; RoFormer (Su et al., 2021) for RoPE.

    Args:
      q, k, v: `[T, H, D]` bf16/f16/f32, D even, or jagged containers of such
        values (with `.values`, `.offsets`, optionally a static `.max_seq_len`).
      offsets: int32 `[B+1]`, `offsets[0] = 0`, non-decreasing, `offsets[B] <= T`.
        Default: the containers' offsets (which must agree).
      block_size: rows per block (static).
      positions: int or float `[T]` RoPE position of each row; default each row's
        index inside its sequence. Needs `rope_base`. No gradient flows to it.
      rope_base: RoPE wavelength base; None: no RoPE.
      max_seq_len: static bound on every sequence length; default q's container's.
      scale: multiplies the scores; default `1/sqrt(D)`.
      implementation: "xla" (the jnp reference), "pallas" (Mosaic GPU kernels;
        Hopper, bf16/f16, D in {64, 128}, block_size 64), or None: pallas on a
        Hopper GPU when the kernels take the inputs and block_size, else xla
        (`pallas_kernels.describe_choice` says which and why).

    Returns:
      `[T, H, D]` in q's dtype; in q's container type when q is a container.

    Raises:
      ValueError: mismatched shapes, an odd head dim under RoPE, a bad
        block_size, positions without rope_base or of the wrong shape, offsets
        missing or disagreeing, a missing max_seq_len, malformed concrete
        offsets, an unknown implementation.
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside
        Mosaic GPU interpret mode).
      NotImplementedError: "pallas" asked for inputs the kernels do not take.
    """
    container, q, k, v, offsets, max_seq_len = jagged_args.self_attention_operands(q, k, v, offsets, max_seq_len)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    if positions is not None and rope_base is None:
        raise ValueError("positions given without rope_base: positions only place RoPE rotations")
    if positions is not None and positions.shape != q.shape[:1]:
        raise ValueError(f"positions must be [T] = {q.shape[:1]}; got {positions.shape}")
    if rope_base is not None and q.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head dim; got D={q.shape[-1]}")
    jagged_layout.check_offsets(offsets, q.shape[0], max_seq_len)
    impl = dispatch.choose(SUPPORT, implementation, [q.dtype, k.dtype, v.dtype], q.shape[-1]).implementation
    if impl is dispatch.Implementation.PALLAS and implementation is None and block_size not in KERNEL_BLOCK_SIZES:
        impl = dispatch.Implementation.XLA  # the kernels take 64-row blocks only
    kwargs = dict(block_size=block_size, positions=positions, rope_base=rope_base, scale=scale)
    if impl is dispatch.Implementation.XLA:
        out = reference.block_local_attention(q, k, v, offsets, max_seq_len=max_seq_len, **kwargs)
    else:
        from pallas_kernels.block_local_attention import vjp  # Mosaic GPU; imported only when used

        static = {name: value for name, value in kwargs.items() if name != "positions"}
        static["bounded_angles"] = vjp.angles_bounded(rope_base, q.shape[-1], max_seq_len, positions is not None)
        out = shared_lowering.call(vjp.block_local_attention, q, k, v, offsets, static=static, positions=positions)
    return out if container is None else jagged_args.with_values(container, out)
