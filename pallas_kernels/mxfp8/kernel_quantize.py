"""Pallas (Triton lowering) 1x128 FP8 quantization with the layer's prologue fused: one pass over the input.

Each program owns a `[ROWS, 128]` tile of `x [M, K]`: it loads the tile once, applies the
prologue in float32 in registers (nothing, an RMSNorm whose per-row `1/rms` is given, or
the tanh GELU of `x` plus an optional per-column bias), takes each row's absolute maximum,
and writes the E4M3 data and the E8M0 scale bytes::

    v = p(x[rows, k0:k0+128].astype(f32))
    amax = max(|v|, axis=1)                         # NaN counts as Inf: the tile is poisoned
    e = clip(ceil(log2(amax / 448)), -126, 127)     # 0 for amax == 0 (formats.scale_exponent)
    data = clip(v * 2**-e, -448, 448).astype(e4m3)  # ties to even; NaN for a poisoned row tile
    scale_byte = e + 127                            # 255 for a poisoned row tile

so the activation is read once and written once in 8 bits, where XLA materializes the
float32 prologue (the GELU's tanh), reduces it, and reads it again to quantize
(benchmarks/mxfp8.md). The last row tile is masked: rows past `M` are neither read nor
written. The Triton lowering is used because this is a memory-bound row kernel (no
TMA or wgmma): Triton's masked loads and its E4M3 conversion (`cvt.rn.satfinite`) are
what it needs. jax 0.11 marks the Pallas Triton backend deprecated (a DeprecationWarning
when the kernel lowers for a GPU), so this kernel is to move to Mosaic GPU before jax
drops it. The Triton lowering addresses the 8-bit output with 32-bit offsets, so inputs of
2**31 elements or more go to the jnp reference (`ops.quantize_kernel_takes`).

Equivalent jnp: `reference.quantize(p(x), block=(1, 128))`. Bytes may differ by one E4M3
code where the GPU's `tanhf` and XLA's tanh differ by an ulp, or where the RMSNorm's mean
square is summed in another order (benchmarks/mxfp8.md counts them on an H200).

With a random Hadamard rotation (`hadamard_signs`, `Fp8Recipe(hadamard=True)`) the tile is
rotated between the prologue and the amax, `v <- v @ diag(s) H_128 / sqrt(128)`: one
`[64, 128] @ [128, 128]` bf16 dot with float32 accumulation per program, the +-1 `H_128`
(exact in bf16) read as a second operand, `v * s` rounded to bf16. An Inf or NaN spreads
over its row's 128-block, the tile it poisons anyway, so poisoning is unchanged: NaN data and
scale byte 255 for that row tile, as the reference (whose rotation propagates Inf/NaN the same
way). A finite row block whose rotated values exceed float32's range becomes Inf and is
poisoned too. The rotation's operands and code exist only under that static flag: without it
the kernel takes three operands and has no dot. Equivalent jnp: `reference.quantize(p(x),
block=(1, 128), hadamard_signs=s)` (`reference.rotate(..., bf16_operands=True)`); the dot may sum in
another order on the GPU, so a byte may sit one E4M3 code away, and a scale one step away
where a tile's amax sits at a scale boundary (`mxfp8_bench.py --quantize` counts them).

Sources: DeepSeek-V3 (arXiv:2412.19437) section 3.3 for 1x128 activation tiles; Transformer
Engine's fused LayerNorm/activation cast kernels for the prologue in the cast; QuaRot
(arXiv:2404.00456) for the random Hadamard rotation of a GEMM's contraction axis.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._src import manual_axes
from pallas_kernels._src.triton_call import triton_call
from pallas_kernels.mxfp8 import formats, reference

BLOCK = 128  # K extent of one scale (1x128 tiles)
ROWS = 64  # rows per program


class Kind(enum.Enum):
    """The prologue applied to the tile before quantizing."""

    NONE = "none"
    RMSNORM = "rmsnorm"  # v = x * inv_rms[row] * gain[col]
    GELU = "gelu"  # v = gelu(x + bias[col]) (no bias: gelu(x)), tanh approximation (jax.nn.gelu)


def _scale_exponent(amax: jax.Array) -> jax.Array:
    """`formats.scale_exponent` from the float32 bits (int ops only, as Triton lowers them).

    For a normal `amax = 1.m * 2**(E - 127)`, `ceil(log2(amax / 448)) = E - 135 + (1.m > 1.75)`;
    subnormal maxima clamp to -126 like the reference; zero gives 0.
    """
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    biased = lax.shift_right_logical(bits, jnp.int32(23)) & 0xFF
    above = ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    exp = jnp.where(amax > 0, biased - 135 + above, 0)
    return jnp.clip(exp, formats.MIN_SCALE_EXP, formats.MAX_SCALE_EXP)


def _rotate(v: jax.Array, signs: jax.Array, h: jax.Array) -> jax.Array:
    """`v @ diag(signs) H_128 / sqrt(128)` of a float32 tile: the +-1 products are exact in
    bf16 x bf16 -> float32, so only `bf16(v * signs)` and the float32 sum round."""
    u = (v * signs[None, :]).astype(jnp.bfloat16)
    return jnp.dot(u, h, preferred_element_type=jnp.float32) * np.float32(1.0 / np.sqrt(BLOCK))


def _quantize_tile(x_ref, inv_rms_ref, col_ref, *refs, m: int, kind: Kind, has_col: bool, rotate: bool):
    # With `rotate` the refs are (signs [K] float32, H_128 bf16, data, scales), else (data, scales).
    *rotation_refs, data_ref, scale_ref = refs
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * ROWS, ROWS)
    cols = pl.ds(j * BLOCK, BLOCK)
    valid = i * ROWS + lax.broadcasted_iota(jnp.int32, (ROWS,), 0) < m
    v = plt.load(x_ref.at[rows, cols], mask=valid[:, None], other=0.0).astype(jnp.float32)
    if kind is Kind.RMSNORM:
        inv_rms = plt.load(inv_rms_ref.at[rows], mask=valid, other=0.0)
        v = v * inv_rms[:, None] * col_ref[cols].astype(jnp.float32)[None, :]
    elif kind is Kind.GELU:
        if has_col:
            v = v + col_ref[cols].astype(jnp.float32)[None, :]
        v = jax.nn.gelu(v, approximate=True)
    if rotate:
        signs_ref, h_ref = rotation_refs
        v = _rotate(v, signs_ref[cols], h_ref[...])
    amax = jnp.max(jnp.where(jnp.isnan(v), jnp.inf, jnp.abs(v)), axis=1)
    poisoned = amax == jnp.inf
    exp = _scale_exponent(jnp.where(poisoned, 0.0, amax))
    scaled = v * lax.bitcast_convert_type((formats.E8M0_BIAS - exp) << 23, jnp.float32)[:, None]
    scaled = jnp.where(poisoned[:, None], jnp.nan, jnp.clip(scaled, -formats.E4M3_MAX, formats.E4M3_MAX))
    plt.store(data_ref.at[rows, cols], scaled.astype(jnp.float8_e4m3fn), mask=valid[:, None])
    byte = jnp.where(poisoned, formats.E8M0_NAN, exp + formats.E8M0_BIAS).astype(jnp.uint8)
    plt.store(scale_ref.at[rows, j], byte, mask=valid)


def quantize_rows(
    x: jax.Array,
    kind: Kind = Kind.NONE,
    *,
    inv_rms: jax.Array | None = None,
    gain: jax.Array | None = None,
    bias: jax.Array | None = None,
    hadamard_signs: jax.Array | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """`(data float8_e4m3fn [M, K], scales float8_e8m0fnu [M, K/128])` of `p(x)` (or of `p(x) @ R`) in 1x128 tiles.

    Args:
      x: `[M, K]` bf16 or float32, `K` a multiple of 128 (the caller routes other widths to
        the jnp reference).
      kind: the prologue `p`.
      inv_rms: `[M]` float32 `rsqrt(mean(x**2, -1) + eps)`, with `Kind.RMSNORM` only.
      gain: `[K]` RMSNorm gain, with `Kind.RMSNORM` only.
      bias: `[K]` bias added before the GELU, with `Kind.GELU` only, or None.
      hadamard_signs: `[K]` +-1 floats, or None. Given, the tile is rotated after the
        prologue and before its amax by `R = diag(hadamard_signs) blockdiag(H_128) / sqrt(128)`
        (`reference.rotate(..., bf16_operands=True)`: a `[64, 128] @ [128, 128]` bf16 dot with float32
        accumulation per program). Without it the kernel has no rotation operands and no dot.
      interpret: run the Pallas interpreter (CPU tests).

    Raises:
      ValueError: `x` not 2-D with `K` a multiple of 128, the RMSNorm operands missing, of
        the wrong shape or given with another kind, a bias of the wrong shape or without
        `Kind.GELU`, or `hadamard_signs` not `[K]`.
    """
    if x.ndim != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"quantize_rows: x must be [M, K] with K a multiple of {BLOCK}, got {x.shape}")
    m, k = x.shape
    shape = lambda a: None if a is None else jnp.shape(a)  # noqa: E731
    given = (inv_rms is not None, gain is not None)
    if given != ((kind is Kind.RMSNORM),) * 2:
        raise ValueError(f"quantize_rows: inv_rms and gain come with Kind.RMSNORM, and only with it; got {shape(inv_rms)} and {shape(gain)} with {kind}")
    if bias is not None and kind is not Kind.GELU:
        raise ValueError(f"quantize_rows: bias comes with Kind.GELU only; got one with {kind}")
    if kind is Kind.RMSNORM:
        if shape(inv_rms) != (m,) or shape(gain) != (k,):
            raise ValueError(f"quantize_rows: RMSNORM needs inv_rms [{m}] and gain [{k}], got {shape(inv_rms)} and {shape(gain)}")
        col = gain
    else:
        if bias is not None and shape(bias) != (k,):
            raise ValueError(f"quantize_rows: bias must be [{k}], got {shape(bias)}")
        inv_rms, col = jnp.zeros((1,), jnp.float32), bias
    has_col = col is not None
    col = jnp.zeros((1,), jnp.float32) if col is None else col  # unread placeholder
    operands = (x, inv_rms.astype(jnp.float32), col)
    if hadamard_signs is not None:  # only then does the kernel take (and read) the rotation's operands
        reference.check_hadamard_signs(hadamard_signs, k, BLOCK, "quantize_rows")
        h = jnp.asarray(reference.hadamard_matrix(BLOCK), jnp.bfloat16)  # +-1: exact in bf16
        operands += (jnp.asarray(hadamard_signs, jnp.float32), h)
    # Under shard_map every operand and result is typed by the manual axes it varies over.
    operands = manual_axes.match_axes(*operands)
    x = operands[0]
    vary = jax.typeof(x).manual_axis_type
    out_shape = (
        jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn, manual_axis_type=vary),
        jax.ShapeDtypeStruct((m, k // BLOCK), jnp.uint8, manual_axis_type=vary),
    )
    rotate = hadamard_signs is not None
    kernel = functools.partial(_quantize_tile, m=m, kind=kind, has_col=has_col, rotate=rotate)
    data, scale_bytes = triton_call(
        kernel,
        operands,
        out_shape=out_shape,
        grid=(pl.cdiv(m, ROWS), k // BLOCK),
        name=f"mxfp8_quantize_{kind.value}" + ("_hadamard" if rotate else ""),
        interpret=interpret,
    )
    return data, lax.bitcast_convert_type(scale_bytes, jnp.float8_e8m0fnu)
