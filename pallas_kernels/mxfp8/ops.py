"""Public MXFP8 ops: block quantization, the random Hadamard rotation and the block-scaled FP8 matmul.

`quantize_mxfp8`, `rmsnorm_quantize_mxfp8` and `gelu_quantize_mxfp8` run a one-pass Pallas kernel
(`kernel_quantize.py`) for 1x128 tiles on a GPU, else their jnp reference; `dequantize_mxfp8` and
`random_hadamard` run their jnp reference (XLA fuses them well); `mxfp8_matmul(a, a_scales, b,
b_scales) = a @ b.T` has a Mosaic GPU kernel (`kernel_matmul.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._src import dispatch
from pallas_kernels.mxfp8 import formats, kernel_quantize, reference

K_BLOCKS = (32, 128)  # K extent of one scale block (and of one promotion in the kernel)
A_ROW_BLOCKS = (1, 32, 128)  # rows of `a` sharing a scale: 1x128 activations, 32x32 MX tiles
B_ROW_BLOCKS = (32, 128)  # rows of `b` sharing a scale: 32x32 MX tiles, 128x128 weight blocks

SUPPORT = dispatch.OpSupport("mxfp8_matmul")  # the kernel takes every input the op accepts
_QUANTIZE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
QUANTIZE_SUPPORTS = tuple(  # the one-pass 1x128 quantize kernel behind each quantization op
    dispatch.OpSupport(name, kernel_dtypes=_QUANTIZE_DTYPES)
    for name in ("quantize_mxfp8", "rmsnorm_quantize_mxfp8", "gelu_quantize_mxfp8")
)
_QUANTIZE, _RMSNORM_QUANTIZE, _GELU_QUANTIZE = QUANTIZE_SUPPORTS


def _infer_block(extent: int, n_blocks: int, candidates, what: str) -> int:
    for c in candidates:
        if math.ceil(extent / c) == n_blocks:
            return c
    raise ValueError(
        f"{what}: {n_blocks} scale blocks for extent {extent} matches no supported block size {candidates} "
        f"(want ceil({extent}/block) blocks)"
    )


def scale_blocks(a_shape, a_scales_shape, b_shape, b_scales_shape) -> tuple[tuple[int, int], tuple[int, int]]:
    """The `(rows, K)` block shapes of `a` and `b` implied by their scale shapes.

    Raises:
      ValueError: shapes that match no supported granularity, or different K blocks.
    """
    (m, k), (n, _) = a_shape, b_shape
    if len(a_scales_shape) != 2 or len(b_scales_shape) != 2:
        raise ValueError(f"scales must be 2-D; got {a_scales_shape} and {b_scales_shape}")
    if a_scales_shape[1] != b_scales_shape[1]:
        raise ValueError(f"a_scales {a_scales_shape} and b_scales {b_scales_shape} must have the same number of K blocks")
    kb = _infer_block(k, a_scales_shape[1], K_BLOCKS, "K blocks of a_scales")
    ra = _infer_block(m, a_scales_shape[0], A_ROW_BLOCKS, "row blocks of a_scales")
    rb = _infer_block(n, b_scales_shape[0], B_ROW_BLOCKS, "row blocks of b_scales")
    return (ra, kb), (rb, kb)


def mxfp8_matmul(
    a: jax.Array,
    a_scales: jax.Array,
    b: jax.Array,
    b_scales: jax.Array,
    *,
    b_contracting_dim: int = 1,
    out_dtype=jnp.bfloat16,
    implementation: str | dispatch.Implementation | None = None,
    config=None,
) -> jax.Array:
    """Block-scaled FP8 GEMM `a @ b.T` (b `[N, K]`) or `a @ b` (b `[K, N]`), scales applied in float32.

    Equivalent jnp::

        A = a.astype(f32) * repeat(a_scales, blocks)         # dequantize_mxfp8
        B = b.astype(f32) * repeat(b_scales, blocks)
        out = (A @ B.T if b_contracting_dim == 1 else A @ B).astype(out_dtype)   # float32 accumulation

    The Pallas kernel (Hopper) runs FP8 wgmma per K block and promotes every block into a
    float32 accumulator on the CUDA cores (DeepSeek-V3, arXiv:2412.19437 section 3.3):
    every 32 K for MXFP8 32x32 scales, every 128 K for the 1x128 / 128x128 variant. Hopper
    has no block-scaled MMA, so the 32-wide promotion costs CUDA-core work of the same
    order as the MMA (see kernel_matmul.py).

    Layouts: Hopper's FP8 wgmma reads only K-major operands, so the kernel path copies a
    `[K, N]` `b` (`b_contracting_dim=0`) into `[N, K]` first: pass `b` that way only when it is
    small (a weight), never an activation. The "xla" path takes either layout as it is. The
    kernel path pads operands (a copy) only when M, N or K is not a multiple of the tile
    (`TuningConfig.m_multiple`, `n_multiple`, `k_multiple`).

    Args:
      a: float8_e4m3fn `[M, K]` (K-major), from `quantize_mxfp8`.
      a_scales: float8_e8m0fnu `[ceil(M/ra), ceil(K/kb)]` with ra in {1, 32, 128}, kb in {32, 128}.
      b: float8_e4m3fn `[N, K]` (K-major: the weight stored as `[out, in]`), or `[K, N]` with
        `b_contracting_dim=0` (the weight stored as `[in, out]`).
      b_scales: float8_e8m0fnu `[ceil(N/rb), ceil(K/kb)]` (or `[ceil(K/kb), ceil(N/rb)]` with
        `b_contracting_dim=0`) with rb in {32, 128}, the same kb.
      b_contracting_dim: the axis of `b` that is K: 1 (default) or 0.
      out_dtype: result dtype (bfloat16 or float32).
      implementation: "xla" (reference), "pallas" (Hopper kernel) or None (pallas on a Hopper
        GPU, else xla). There is no "cudnn" path.
      config: `kernel_matmul.TuningConfig` for the Pallas kernel (None: the default for kb).

    Returns:
      `[M, N]` in `out_dtype`. NaN scale bytes (255) make their rows/columns NaN. Scale
      products outside the float32 normal range overflow to Inf or flush to zero.

    Raises:
      ValueError: wrong dtypes, mismatched shapes, unsupported block granularity, a
        `b_contracting_dim` other than 0 or 1, or an unknown implementation (or "cudnn").
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside Mosaic GPU
        interpret mode).
    """
    if b_contracting_dim not in (0, 1):
        raise ValueError(f"b_contracting_dim must be 0 ([K, N] b) or 1 ([N, K] b), got {b_contracting_dim}")
    # Shapes of b and its scales as [N, K]: the orientation the checks and the kernel use.
    b_nk, b_scales_nk = (b.shape, b_scales.shape) if b_contracting_dim == 1 else (b.shape[::-1], b_scales.shape[::-1])
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b_nk[1]:
        raise ValueError(
            f"a must be [M, K] and b [N, K] (b_contracting_dim=1) or [K, N] (0) with the same K; "
            f"got {a.shape} and {b.shape} with b_contracting_dim={b_contracting_dim}"
        )
    if a.dtype != jnp.float8_e4m3fn or b.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"a and b must be float8_e4m3fn; got {a.dtype} and {b.dtype}")
    if a_scales.dtype != jnp.float8_e8m0fnu or b_scales.dtype != jnp.float8_e8m0fnu:
        raise ValueError(f"scales must be float8_e8m0fnu; got {a_scales.dtype} and {b_scales.dtype}")
    a_block, b_block = scale_blocks(a.shape, a_scales.shape, b_nk, b_scales_nk)
    impl = dispatch.choose(SUPPORT, implementation, [a.dtype, b.dtype]).implementation
    (m, k), n = a.shape, b_nk[0]
    if impl is dispatch.Implementation.XLA or m == 0 or n == 0 or k == 0:
        b_own = b_block if b_contracting_dim == 1 else b_block[::-1]
        return reference.matmul(
            a, a_scales, b, b_scales, a_block=a_block, b_block=b_own, b_contracting_dim=b_contracting_dim, out_dtype=out_dtype
        )
    return _pallas_matmul(a, a_scales, b, b_scales, a_block, b_block, b_contracting_dim, out_dtype, config)


def _pad_to(x: jax.Array, shape, value) -> jax.Array:
    pads = [(0, t - s) for s, t in zip(x.shape, shape)]
    return x if not any(p for _, p in pads) else jnp.pad(x, pads, constant_values=value)


def _kernel_scales(scales_k_major: jax.Array, group: int, rows: int, shape) -> jax.Array:
    """float32 `shape = [K/kb, rows padded]`: one scale per row, from E8M0 `[K/kb, ceil(rows/group)]`.

    Padding rows get scale 1 (their data is 0). The input is the scales' K-block-major
    layout that the kernel reads; it has `1 / (group * kb)` of the data's elements.
    """
    return _pad_to(jnp.repeat(formats.decode_e8m0(scales_k_major), group, axis=1)[:, :rows], shape, 1.0)


def _pallas_matmul(a, a_scales, b, b_scales, a_block, b_block, b_contracting_dim, out_dtype, config):
    from pallas_kernels.mxfp8 import kernel_matmul  # Mosaic GPU; imported only when used

    (m, k) = a.shape
    kb = a_block[1]
    if b_contracting_dim == 0:
        # The FP8 wgmma reads K-major operands only: the [K, N] operand (a weight) is copied to [N, K]
        # once; its scales are already K-block-major.
        b, b_scales_k_major = b.T, b_scales
    else:
        b_scales_k_major = b_scales.T  # [N/rb, K/kb] -> [K/kb, N/rb]: the weight's scales, 1/(rb kb) of its size
    n = b.shape[0]
    config = config or kernel_matmul.default_config(kb)
    mp = math.ceil(m / config.m_multiple) * config.m_multiple
    np_ = math.ceil(n / config.n_multiple) * config.n_multiple
    kp = math.ceil(k / config.k_multiple(kb)) * config.k_multiple(kb)
    a8 = _pad_to(a, (mp, kp), 0)  # no copy when M and K fit the tiles (token capacities are multiples of 128)
    b8 = _pad_to(b, (np_, kp), 0)
    # Per-row / per-column float32 scales [K/kb, rows]. The activation's E8M0 scales are turned
    # K-block-major here (a_scales.T: 1/(ra kb) of the activation's elements), fused into the expansion.
    rs = _kernel_scales(a_scales.T, a_block[0], m, (kp // kb, mp))
    cs = _kernel_scales(b_scales_k_major, b_block[0], n, (kp // kb, np_))
    out = kernel_matmul.scaled_matmul(a8, b8, rs, cs, block_k=kb, col_group=b_block[0], out_dtype=out_dtype, config=config)
    return out if (mp, np_) == (m, n) else out[:m, :n]

def quantize_kernel_takes(shape, dtype, block, rounding) -> bool:
    """Whether the one-pass quantize kernel takes an input of `shape` and `dtype` at `block` tiles.

    It takes 2-D bf16/float32 inputs with at least one element and fewer than 2**31 (its 8-bit
    output is addressed with 32-bit offsets), whole 128-column blocks, 1x128 tiles and nearest
    rounding; the ops run the jnp reference for everything else.
    """
    return (
        len(shape) == 2
        and 0 < shape[0] * shape[1] < 2**31
        and shape[1] % kernel_quantize.BLOCK == 0
        and tuple(block) == (1, kernel_quantize.BLOCK)
        and rounding == reference.Rounding.NEAREST
        and jnp.dtype(dtype) in _QUANTIZE_DTYPES
    )


def _row_kernel(op: dispatch.OpSupport, x: jax.Array, block, rounding, implementation, hadamard_signs) -> bool:
    """Whether `op` runs the kernel on `x`: the implementation (checked first, for every input)
    is "pallas" or None on a Hopper GPU, and the kernel takes the input. Checks `hadamard_signs`
    (if given) for every input too, naming `op`."""
    block = reference.check_block(block)
    impl = dispatch.choose(op, implementation, [x.dtype]).implementation
    if hadamard_signs is not None:
        reference.check_hadamard_signs(hadamard_signs, x.shape[-1], block[1], op.name)
    return impl is dispatch.Implementation.PALLAS and quantize_kernel_takes(x.shape, x.dtype, block, rounding)


def quantize_mxfp8(
    x: jax.Array, *, block=(32, 32), rounding="nearest", key=None, hadamard_signs=None, implementation=None
) -> tuple[jax.Array, jax.Array]:
    """Block-scaled FP8 quantization with power-of-two (E8M0) scales, one per `block` tile.

    Equivalent jnp (per tile T of `x`, `block = (br, bc)`)::

        amax = max(|T|)
        e = ceil(log2(amax / 448)) if amax > 0 else 0       # never clips: max|T| / 2**e <= 448
        data[T] = round(T / 2**e).astype(float8_e4m3fn)     # RNE, or stochastic with `key`
        scales[T] = 2**e as float8_e8m0fnu

    Scale rule: rounds the exponent up, unlike the OCP MX v1.0 rule `floor(log2(amax)) - 8`
    which saturates block maxima in (448, 512) x 2**e (up to 12.5% error on the block
    maximum) and can diverge in training (NVIDIA MXFP8 recipe, arXiv:2506.08027).
    Exponents are clamped to [-126, 127]: an all-zero tile gets scale 1 and zero data; a
    tile whose maximum is below 448 * 2**-126 gets scale 2**-126 (no float32 subnormal
    scale, so no NaN or Inf from flush-to-zero), and its elements round on E4M3's
    subnormal grid. Inf/NaN policy: a tile holding any Inf or NaN is poisoned: its scale
    is the E8M0 NaN byte (255) and all its data NaN, so every product reading it is NaN.

    With square tiles (32x32 MXFP8 tiles, 128x128 weight tiles) the transpose reuses the
    quantization: `quantize_mxfp8(x.T) == (data.T, scales.T)` bit for bit (nearest rounding).

    Random Hadamard rotation (`hadamard_signs`): the op quantizes `x @ R` instead of `x`, with
    `R = diag(hadamard_signs) blockdiag(H_bc) / sqrt(bc)` over blocks of `bc = block[1]` columns
    (one scale tile's width, so a tile's outliers spread within it). Equivalent jnp::

        u = (x.astype(f32) * hadamard_signs).astype(bf16)                  # the only extra rounding
        v = (u.reshape(R, C/bc, bc) @ H_bc.astype(bf16)).reshape(R, C)     # float32 accumulation
        quantize(v * f32(1 / sqrt(bc)))                                    # reference.rotate(..., bf16_operands=True)

    A tile holding Inf or NaN is poisoned as without the rotation (it spreads within the tile).
    A finite tile whose rotated values pass float32's range (|x| ~ 3e37 and above) turns Inf
    and is poisoned too.

    Args:
      x: `[R, C]` float (bf16/f32); the last tiles may be partial.
      block: `(rows, cols)` of one scale tile; (32, 32) for MXFP8, (1, 128) / (128, 128)
        for the 128-wide-K GEMM variant.
      rounding: "nearest" (ties to even) or "stochastic" (unbiased, ulp-aware on E4M3's
        normal and subnormal grid; needs `key`).
      key: PRNG key for stochastic rounding.
      hadamard_signs: `[C]` +-1 floats (e.g. `reference.random_signs`), or None (no rotation).
        `C` must be a multiple of `block[1]`, a power of two.
      implementation: "xla" (the jnp reference), "pallas" or None (pallas on a Hopper GPU).
        The Pallas kernel (`kernel_quantize.py`: one read of `x`, one 8-bit write) takes the
        inputs `quantize_kernel_takes` names (1x128 tiles of a bf16/float32 `x` whose C is a
        multiple of 128, nearest rounding); other inputs run the reference under either name.

    Returns:
      `(data, scales)`: float8_e4m3fn `[R, C]` and float8_e8m0fnu `[ceil(R/br), ceil(C/bc)]`.

    Raises:
      ValueError: `x` not 2-D, a bad block, an unknown rounding, stochastic without a key, or
        `hadamard_signs` not `[C]` or `C` not in whole power-of-two blocks of `block[1]`.
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside interpret mode).
    """
    if _row_kernel(_QUANTIZE, x, block, rounding, implementation, hadamard_signs):
        return kernel_quantize.quantize_rows(x, kernel_quantize.Kind.NONE, hadamard_signs=hadamard_signs, interpret=dispatch.interpreting())
    return reference.quantize(x, block=block, rounding=rounding, key=key, hadamard_signs=hadamard_signs)


def dequantize_mxfp8(data: jax.Array, scales: jax.Array, *, block=(32, 32), dtype=jnp.float32) -> jax.Array:
    """`data * scale` for every tile: the inverse of `quantize_mxfp8` up to rounding.

    Args:
      data: float8_e4m3fn `[R, C]`.
      scales: float8_e8m0fnu `[ceil(R/br), ceil(C/bc)]`.
      block: the `(rows, cols)` tile the scales were computed with.
      dtype: result dtype.

    Returns:
      `[R, C]` in `dtype` (exact in float32: products of E4M3 values and powers of two).

    Raises:
      ValueError: wrong dtypes or scales that do not match `data` and `block`.
    """
    return reference.dequantize(data, scales, block=block, dtype=dtype)


def rmsnorm_quantize_mxfp8(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float = 1e-6,
    block=(32, 32),
    rounding="nearest",
    key=None,
    hadamard_signs=None,
    implementation=None,
) -> tuple[jax.Array, jax.Array]:
    """RMSNorm fused with block quantization: `quantize_mxfp8(rmsnorm(x) * weight)`.

    Equivalent jnp::

        y = x * rsqrt(mean(x**2, axis=-1, keepdims=True) + eps) * weight    # float32
        return quantize_mxfp8(y, block=block, rounding=rounding, key=key, hadamard_signs=hadamard_signs)

    The normalized activation is never written in high precision: only the FP8 data and
    the scales leave the fusion (GEM: quantization fused into the preceding norm).
    Forward only: `fp8_matmul(..., prologue=Prologue.RMSNORM)` is the differentiable FP8
    layer built on it (its backward runs through the norm).

    Args:
      x: `[R, C]` float.
      weight: `[C]` float, the RMSNorm gain.
      eps: added to the mean square.
      block, rounding, key, hadamard_signs, implementation: as in `quantize_mxfp8` (the rotation
        follows the norm, in the same pass on the kernel path); on the kernel path the
        per-row `rsqrt(mean(x**2) + eps)` is one XLA row reduction and the kernel applies it
        with the gain while quantizing. XLA may sum the mean square in another order than in
        the reference's own fusion, so a byte may differ by one code now and then (2 of 16.8 M
        at 4099 x 4096 on an H200).

    Returns:
      `(data, scales)` as in `quantize_mxfp8`.

    Raises:
      ValueError: mismatched shapes, or the errors of `quantize_mxfp8`.
    """
    if _row_kernel(_RMSNORM_QUANTIZE, x, block, rounding, implementation, hadamard_signs) and weight.shape == (x.shape[1],):
        inv_rms = reference.inv_rms(x, eps)[:, 0]
        kind = kernel_quantize.Kind.RMSNORM
        return kernel_quantize.quantize_rows(
            x, kind, inv_rms=inv_rms, gain=weight, hadamard_signs=hadamard_signs, interpret=dispatch.interpreting()
        )
    return reference.rmsnorm_quantize(x, weight, eps=eps, block=block, rounding=rounding, key=key, hadamard_signs=hadamard_signs)


def gelu_quantize_mxfp8(
    x: jax.Array,
    *,
    bias: jax.Array | None = None,
    block=(32, 32),
    rounding="nearest",
    key=None,
    hadamard_signs=None,
    implementation=None,
) -> tuple[jax.Array, jax.Array]:
    """The tanh GELU fused with block quantization: `quantize_mxfp8(jax.nn.gelu(x + bias))`, in float32.

    Equivalent jnp::

        v = x.astype(jnp.float32) + (0 if bias is None else bias.astype(jnp.float32))
        return quantize_mxfp8(jax.nn.gelu(v), block=block, rounding=rounding, key=key, hadamard_signs=hadamard_signs)

    On the kernel path (see `quantize_mxfp8`) the GELU runs in registers and its output is
    never written in high precision; XLA would write it in float32 and read it twice (the
    amax, then the cast). Forward only: `fp8_matmul(..., prologue=Prologue.GELU)` is the
    differentiable layer.

    Args:
      x: `[R, C]` float, the MLP's pre-activation (without its bias when `bias` is given).
      bias: `[C]` float added before the GELU (the first MLP layer's bias), or None.
      block, rounding, key, hadamard_signs, implementation: as in `quantize_mxfp8` (the
        rotation follows the GELU).

    Returns:
      `(data, scales)` as in `quantize_mxfp8`. On the kernel path an element may land one
      E4M3 code away from the reference now and then: the GPU's `tanhf` and XLA's tanh
      differ by an ulp (0.003% of the bytes at 4099 x 4096 on an H200).

    Raises:
      ValueError: a `bias` that is not `[C]`, or the errors of `quantize_mxfp8`.
    """
    if x.ndim != 2:
        raise ValueError(f"gelu_quantize_mxfp8: x must be 2-D [R, C], got shape {x.shape}")
    if bias is not None and jnp.shape(bias) != (x.shape[1],):
        raise ValueError(f"gelu_quantize_mxfp8: bias must be [{x.shape[1]}] for x {x.shape}, got {jnp.shape(bias)}")
    if _row_kernel(_GELU_QUANTIZE, x, block, rounding, implementation, hadamard_signs):
        kind = kernel_quantize.Kind.GELU
        return kernel_quantize.quantize_rows(x, kind, bias=bias, hadamard_signs=hadamard_signs, interpret=dispatch.interpreting())
    return reference.quantize(reference.gelu(x, bias), block=block, rounding=rounding, key=key, hadamard_signs=hadamard_signs)


def random_hadamard(x: jax.Array, *, key: jax.Array, block: int = 32, inverse: bool = False) -> jax.Array:
    """Rotates the last axis of `x` by `R = diag(s) H_b / sqrt(b)` (or by `R^T` if `inverse`).

    Equivalent jnp::

        s = jax.random.rademacher(key, (C,))
        R = s[:, None] * scipy.linalg.block_diag(*[H_b] * (C // b)) / sqrt(b)
        out = x @ R            # inverse: x @ R.T, so random_hadamard(random_hadamard(x), inverse=True) == x

    Args:
      x: `[..., C]` floating, `C` a multiple of `block`.
      key: PRNG key; the same key gives the same rotation.
      block: Hadamard order `b`, a power of two (32 or 128 match the MXFP8 blocks).
      inverse: apply `R^T = R^{-1}` instead.

    Returns:
      Same shape and dtype as `x` (computed in float32).

    Raises:
      ValueError: `block` not a power of two, or `C` not a multiple of it.
    """
    return reference.random_hadamard(x, key=key, block=block, inverse=inverse)
