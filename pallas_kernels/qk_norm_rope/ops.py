"""Public op: the QK-norm and RoPE of a fused QKV projection, as one kernel pass each way on Hopper."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._src import dispatch, manual_axes, row_tiles
from pallas_kernels.qk_norm_rope import kernel, reference

SUPPORT = dispatch.OpSupport(
    "qk_norm_rope",
    kernel_dtypes=kernel.KERNEL_DTYPES,
    kernel_head_dims=kernel.KERNEL_HEAD_DIMS,
    reference_otherwise=True,
    size_limit="at least one token and under 2**31 elements",
)


def _check(qkv, q_scale, k_scale, cos, sin, dtype) -> tuple[int, int, int]:
    """`(T, H, D)` of valid inputs, else a ValueError naming what is wrong."""
    if qkv.ndim != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qk_norm_rope: qkv must be [T, 3, H, D] (or [T, 3*H*D] with heads=H), got {qkv.shape}")
    t, _, h, d = qkv.shape
    if d % 2:
        raise ValueError(f"qk_norm_rope: the head dim D must be even for RoPE, got {d}")
    if not jnp.issubdtype(qkv.dtype, jnp.floating):
        raise ValueError(f"qk_norm_rope: qkv must be floating point, got {qkv.dtype}")
    if dtype is not None and not dispatch.is_floating_dtype(dtype):
        raise ValueError(f"qk_norm_rope: dtype must be a floating dtype (or None: qkv's), got {dtype!r}")
    for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
        if jnp.shape(s) != (d,) or not jnp.issubdtype(jnp.result_type(s), jnp.floating):
            raise ValueError(f"qk_norm_rope: {name} must be a floating [{d}] (the head dim), got {jnp.shape(s)} {jnp.result_type(s)}")
    for name, a in (("cos", cos), ("sin", sin)):
        if jnp.shape(a) not in ((t, d // 2), (t, 1, d // 2)) or jnp.result_type(a) != jnp.float32:
            raise ValueError(f"qk_norm_rope: {name} must be float32 [{t}, {d // 2}] or [{t}, 1, {d // 2}], got {jnp.shape(a)} {jnp.result_type(a)}")
    return t, h, d


def qk_norm_rope(
    qkv: jax.Array,
    q_scale: jax.Array,
    k_scale: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    eps: float = 1e-6,
    dtype=None,
    heads: int | None = None,
    implementation: str | dispatch.Implementation | None = None,
    tile: tuple[int, int] = kernel.TILE,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """QK-norm (RMSNorm of each query and key head, Dehghani et al. 2023, "Scaling Vision
    Transformers to 22B") then rotary position embedding (rotate-half, Su et al. 2021, "RoFormer")
    of a fused QKV projection; v passes through.

    Equivalent jnp (RMSNorm of Zhang & Sennrich 2019 as flax's `nnx.RMSNorm(dtype=float32)`)::

        def norm(x, scale):                                   # float32
            x = x.astype(f32)
            return x * (rsqrt(mean(x * x, axis=-1, keepdims=True) + eps) * scale)
        def rope(y):                                          # y1, y2: the halves of the head
            return concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], -1).astype(dtype)
        q, k, v = rope(norm(qkv[:, 0], q_scale)), rope(norm(qkv[:, 1], k_scale)), qkv[:, 2]

    The "xla" path is that composition (`reference.py`; values and autodiff gradients those of
    flax's RMSNorm followed by the rotation, bit for bit). The Pallas path (`kernel.py`, Triton
    lowering) normalises and rotates a tile of tokens, all heads, in one pass (which also copies v
    out, contiguous for the attention kernels), and differentiates
    in one pass that recomputes the norm from `qkv` and writes the whole `dqkv` (its v slot a copy
    of `dv`); its residuals are `qkv`, the scales and the tables. Its results may differ from the
    reference by an ulp of the output dtype (sums in another order). Each token and head is
    normalised on its own, so a NaN or Inf stays in its token's head, in the outputs and in
    `dqkv`; the scale gradients sum over every token, so they take it up, as the reference's do.
    `cos`/`sin` are taken as constants (functions of integer positions): on the Pallas path their
    cotangents are zero.

    Args:
      qkv: `[T, 3, H, D]` (or `[T, 3*H*D]` with `heads`), floating: the projection, q, k, v slots.
      q_scale, k_scale: floating `[D]`, the RMSNorm scales of the queries and keys.
      cos, sin: float32 `[T, D/2]` or `[T, 1, D/2]`, the RoPE table of each token (radians' cosine
        and sine, e.g. `gem_jax.nn.layers.rope_table`).
      eps: added to the mean square.
      dtype: dtype of q and k (default qkv's).
      heads: H, when `qkv` is `[T, 3*H*D]`.
      implementation: "xla" (the jnp reference), "pallas" or None (pallas on a Hopper GPU). The
        kernels take bf16 and float32 `qkv` with D a power of two from 16 to 256 (`kernel.KERNEL_HEAD_DIMS`,
        the head dims the tests run), at least one token and under 2**31 elements; other inputs (e.g.
        D = 8 or 512, or T = 0) run the reference under either name.
      tile: `(rows, warps)` of a kernel program, tokens and warps, both powers of two (default
        `kernel.TILE`, 16 tokens and 4 warps); the results do not depend on it beyond the order of the
        scale gradients' sums.

    Returns:
      `(q, k, v)`, each `[T, H, D]`: q and k in `dtype`, v = `qkv[:, 2]` in qkv's dtype.

    Raises:
      ValueError: qkv not `[T, 3, H, D]` (or `[T, 3*H*D]` not divisible by `3 * heads`), D odd,
        a non-floating qkv, scale or `dtype`, scales not `[D]`, `cos`/`sin` not float32 `[T, D/2]` or
        `[T, 1, D/2]`, a `tile` not of powers of two, or an unknown implementation name.
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside interpret mode).
    """
    if heads is not None:
        if qkv.ndim != 2 or heads < 1 or qkv.shape[1] % (3 * heads):
            raise ValueError(f"qk_norm_rope: with heads={heads}, qkv must be [T, 3*H*D] with H={heads}, got {qkv.shape}")
        qkv = qkv.reshape(qkv.shape[0], 3, heads, qkv.shape[1] // (3 * heads))
    t, h, d = _check(qkv, q_scale, k_scale, cos, sin, dtype)
    tile = row_tiles.check_tile("qk_norm_rope", tile)
    dtype = jnp.dtype(qkv.dtype if dtype is None else dtype)
    cos, sin = cos.reshape(t, 1, d // 2), sin.reshape(t, 1, d // 2)
    impl = dispatch.choose(SUPPORT, implementation, [qkv.dtype], d).implementation
    if impl is not dispatch.Implementation.PALLAS or not kernel.kernel_takes(qkv.shape, qkv.dtype):
        return reference.qk_norm_rope(qkv, q_scale, k_scale, cos, sin, eps, dtype)
    scales = jnp.stack([q_scale, k_scale]).astype(jnp.float32)
    # Under shard_map every operand varies over the same manual axes before the custom VJP, cast here only (its cotangents keep
    # their primals' types; the cast's transpose sums an invariant scale's gradient over the axes).
    operands = manual_axes.match_axes(qkv.reshape(t, 3 * h * d), scales, cos.reshape(t, d // 2), sin.reshape(t, d // 2))
    outs = _fused(*operands, h, eps, dtype, tile, dispatch.interpreting())
    return tuple(x.reshape(t, h, d) for x in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(qkv, scales, cos, sin, heads, eps, dtype, tile, interpret):
    """`(q, k, v)` `[T, H*D]` of `qkv [T, 3*H*D]`; v from the kernel too, and its cotangent into the backward kernel."""
    return kernel.forward(qkv, scales, cos, sin, heads=heads, eps=eps, dtype=dtype, tile=tile, interpret=interpret)


def _fused_fwd(qkv, scales, cos, sin, heads, eps, dtype, tile, interpret):
    return _fused(qkv, scales, cos, sin, heads, eps, dtype, tile, interpret), (qkv, scales, cos, sin)


def _fused_bwd(heads, eps, dtype, tile, interpret, residuals, cotangents):
    qkv, scales, cos, sin = residuals
    dq, dk, dv = cotangents
    dqkv, dscales = kernel.backward(qkv, scales, cos, sin, dq, dk, dv, heads=heads, eps=eps, tile=tile, interpret=interpret)
    return dqkv, dscales, jnp.zeros_like(cos), jnp.zeros_like(sin)


_fused.defvjp(_fused_fwd, _fused_bwd)
