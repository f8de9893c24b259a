"""FP8 dense matmul: MXFP8 forward and input-gradient GEMMs, bf16 weight gradient (custom_vjp),
with an optional RMSNorm or GELU on the input fused into the input's quantization.

For `y = p(x) @ w` (`x [T, in]`, `w [in, out]`, `p` the identity, an RMSNorm or a GELU of `x + b`) with
square-block weight quantization `(wq, sw) = quantize(w)`:

    forward   xq = quantize(p(x))                     # p(x) never written in high precision
              y  = mxfp8_matmul(xq, wq)               # b = wq [in, out] = [K, N]
    dgrad     dp = mxfp8_matmul(q(dy), wq)            # b = wq [in, out] = [N, K], K = out
              dx = vjp(p)(dp)                         # through the norm or the GELU, float32
    wgrad     dw = deq(xq)^T dy                       # bf16 operands, float32 accumulation:
                                                      # dot_general contracting dim 0 of both

With `Fp8Recipe(hadamard=True)` the contraction axis is rotated by the orthogonal
`R = diag(s) blockdiag(H_b) / sqrt(b)` (`b = recipe.block`, fixed signs `hadamard_signs(in)`),
so `p(x) @ w = (p(x) R)(R^T w)` and an outlier feature spreads over its block before scaling:

    forward   xq = quantize(p(x) R)                   # the rotation in the same pass (kernel: 128)
              wq = quantize(R^T w)                    # float32 jnp rotation of w's rows
              y  = mxfp8_matmul(xq, wq)
    dgrad     dp = mxfp8_matmul(q(dy), wq) R^T        # the GEMM's output dtype, rotated back with bf16
                                                      # operands (reference.rotate(..., bf16_operands=True)), then vjp(p)
    wgrad     dw = R (deq(xq)^T dy)                   # the [in, out] gradient's rows rotated back

(QuaRot, arXiv:2404.00456, for rotating both operands of a GEMM; GEM's FP8 recipe for a random
Hadamard rotation in FP8 training.)

No operand is transposed and nothing is quantized twice: the weight is quantized once per
step with square tiles, so the same bytes and scales serve the forward (contracted over
dim 0) and dgrad (over dim 1); the input and the output gradient are quantized once each,
in the layout the model has, and the weight gradient contracts the token axis of both
operands in place (cuBLAS takes the transposed operand as it is). Only the Pallas GEMM
needs one copy: Hopper's FP8 wgmma reads K-major operands, so the forward copies the 8-bit
weight to `[out, in]` (`mxfp8_matmul`, `b_contracting_dim=0`). The weight gradient uses
the saved FP8 input dequantized to bf16, the exact gradient of the quantized forward with
respect to the quantized weight (straight-through for the rounding), and keeps 8-bit
residuals.

Sources: GEM engineering description (Meta, 2025): MXFP8 32x32 blocks, weight gradients
in higher precision, last layers in BF16, weights quantized before the FSDP all-gather,
quantization fused into the preceding norm; DeepSeek-V3 (arXiv:2412.19437) section 3.3
for 1x128 / 128x128 blocks; Transformer Engine's LayerNormLinear / LayerNormMLP for the
norm fused into the FP8 cast.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._src import manual_axes, shared_lowering
from pallas_kernels._src.dispatch import Implementation
from pallas_kernels.mxfp8 import reference
from pallas_kernels.mxfp8.fsdp import gathered_extent, local_part, quantize_gathered, shard_gradient
from pallas_kernels.mxfp8.ops import dequantize_mxfp8, gelu_quantize_mxfp8, mxfp8_matmul, quantize_mxfp8, rmsnorm_quantize_mxfp8
from pallas_kernels.mxfp8.reference import Rounding
from pallas_kernels.rms_norm import rms_norm_backward


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 dense layer quantizes: the numerics alone (where its kernel is sharded is an `Fp8Gather`).

    Attributes:
      block: 32 for MXFP8 (32x32 tiles for activations, weights and gradients, promotion
        every 32 K), or 128 for the 128-wide-K variant (1x128 activation/gradient tiles,
        128x128 weight tiles, promotion every 128 K: DeepSeek-V3's granularity).
      grad_rounding: rounding of the output gradient before the dgrad GEMM; "stochastic"
        needs a `key` at call time.
      implementation: for `mxfp8_matmul` and the input and output-gradient quantizations
        (`quantize_mxfp8` and its fused forms): "xla", "pallas" or None (pallas on Hopper).
      config: `pallas_kernels.mxfp8.kernel_matmul.TuningConfig` for the Pallas GEMMs, or
        None for the default of the block size.
      hadamard: rotate the contraction axis (`in`) by a random Hadamard `R` in blocks of
        `block` before quantizing, so an outlier spreads over its block (`fp8_matmul`). The
        signs are fixed: `hadamard_signs(in)`, the same `R` for every layer of that width.
    """

    block: int = 32
    grad_rounding: str = "nearest"
    implementation: str | None = None
    config: Any = None
    hadamard: bool = False

    def __post_init__(self):
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"Fp8Recipe.hadamard must be a bool, got {self.hadamard!r}")
        if self.block not in (32, 128):
            raise ValueError(f"Fp8Recipe.block must be 32 or 128, got {self.block}")
        if self.grad_rounding not in tuple(Rounding):
            raise ValueError(f"Fp8Recipe.grad_rounding must be one of {[r.value for r in Rounding]}, got {self.grad_rounding!r}")
        try:
            hash(self.config)
        except TypeError:
            raise ValueError(f"Fp8Recipe.config must be hashable (a TuningConfig or None), got {type(self.config).__name__}") from None

    @property
    def act_block(self) -> tuple[int, int]:
        """Quantization tile of activations and output gradients `[T, features]`."""
        return (32, 32) if self.block == 32 else (1, 128)

    @property
    def weight_block(self) -> tuple[int, int]:
        """Quantization tile of the kernel `[in, out]` (square, so its transpose reuses it)."""
        return (self.block, self.block)


@dataclasses.dataclass(frozen=True)
class Fp8Gather:
    """Where an FP8 layer's sharded kernel is quantized: on the shard, its 8-bit data and scales all-gathered.

    Inside a `shard_map` over `axes` the kernel `fp8_matmul` is given is this device's
    shard along dimension `dim` of `[in, out]`; it is quantized there, the 8-bit data and
    scales all-gathered over `axes` (`quantize_gathered`), and its gradient is
    reduce-scattered back to the shard (`shard_gradient`). Bit-identical to quantizing the
    gathered kernel when every shard holds whole quantization blocks.

    Attributes:
      dim: the sharded dimension of the kernel `[in, out]`: 0 or 1.
      axes: the mesh axes it is sharded over, outermost first (one name: that axis).

    Raises:
      ValueError: `dim` not 0 or 1, or no axis named.
    """

    dim: int
    axes: tuple[str, ...]

    def __post_init__(self):
        if self.dim not in (0, 1):
            raise ValueError(f"Fp8Gather.dim must be 0 or 1, got {self.dim}")
        # A static (hashed) argument of the layer's jit: a tuple, whichever sequence was given.
        object.__setattr__(self, "axes", (self.axes,) if isinstance(self.axes, str) else tuple(self.axes))
        if not self.axes:
            raise ValueError("Fp8Gather.axes names no mesh axis")


HADAMARD_SEED = 0  # Fp8Recipe(hadamard=True): the signs of R come from jax.random.key(HADAMARD_SEED)


@functools.cache
def hadamard_signs(n: int) -> np.ndarray:
    """The +-1 float32 signs `[n]` of `Fp8Recipe(hadamard=True)`'s rotation of `n` input features.

    `reference.random_signs(jax.random.key(HADAMARD_SEED), n)`: fixed, so every layer with `n`
    inputs (and every step) rotates by the same `R`, a constant of the compiled program.
    """
    with jax.ensure_compile_time_eval():
        signs = np.array(reference.random_signs(jax.random.key(HADAMARD_SEED), n))
    signs.flags.writeable = False  # cached and shared by every layer of this width
    return signs


def _input_signs(n: int, recipe: Fp8Recipe) -> np.ndarray | None:
    """The rotation's signs for `n` input features, or None without `recipe.hadamard`."""
    if not recipe.hadamard:
        return None
    if n % recipe.block:
        raise ValueError(f"Fp8Recipe(hadamard=True) rotates the input features in blocks of {recipe.block}; got {n} features")
    return hadamard_signs(n)


def _rotate_weight(w: jax.Array, recipe: Fp8Recipe, gather: Fp8Gather | None) -> jax.Array:
    """float32 `R^T @ w`: the rows of `w [in, out]` (or of this device's row shard of it) rotated."""
    row_shards = gather is not None and gather.dim == 0
    n_in = gathered_extent(w, axis_name=gather.axes) if row_shards else w.shape[0]
    signs = jnp.asarray(_input_signs(n_in, recipe))
    if n_in != w.shape[0]:  # a row shard inside shard_map: its slice of the signs
        signs = local_part(signs, axis_name=gather.axes, size=w.shape[0])
    return reference.rotate(w, signs, block=recipe.block, axis=0)


def quantize_weight(w: jax.Array, recipe: Fp8Recipe, gather: Fp8Gather | None = None) -> tuple[jax.Array, jax.Array]:
    """`(wq [in, out], sw)` of `w` (of `R^T @ w` with `recipe.hadamard`); with a `gather`, `w` is
    this device's shard, quantized there and gathered."""
    if recipe.hadamard:
        w = _rotate_weight(w, recipe, gather)
    if gather is None:
        return quantize_mxfp8(w, block=recipe.weight_block)
    return quantize_gathered(w, axis_name=gather.axes, dim=gather.dim, block=recipe.weight_block)


class Prologue(enum.Enum):
    """What `fp8_matmul` applies to its input before quantizing it, in the same fusion.

    NONE: the input itself.
    RMSNORM: `x * rsqrt(mean(x**2, -1) + eps) * norm_scale` in float32 (`reference.rmsnorm`;
      Zhang & Sennrich, 2019), quantized by `rmsnorm_quantize_mxfp8`.
    GELU: `jax.nn.gelu(x + input_bias)` (tanh approximation) in float32: the MLP's hidden
      activation, with the first MLP layer's bias added here when that layer defers it
      (`Fp8Linear(add_bias=False)`), so its output is not rewritten with the bias first.
    """

    NONE = "none"
    RMSNORM = "rmsnorm"
    GELU = "gelu"


def fp8_matmul(
    x: jax.Array,
    w: jax.Array,
    key: jax.Array | None,
    recipe: Fp8Recipe,
    w_dtype: Any,
    *,
    gather: Fp8Gather | None = None,
    prologue: Prologue | str = Prologue.NONE,
    norm_scale: jax.Array | None = None,
    input_bias: jax.Array | None = None,
    eps: float = 1e-6,
    norm_implementation: str | None = "xla",
    keep_input: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`p(x) @ w` with FP8 forward and dgrad GEMMs and a bf16 weight gradient (float32 accumulation).

    Equivalent jnp (forward)::

        dequantize(quantize(p(x))) @ dequantize(quantize(w))

    with `p` the `prologue`: the identity, `rmsnorm(x) * norm_scale` or `gelu(x + input_bias)`, computed in
    float32 and quantized in the same pass (the normed or activated input is never written in
    high precision). The backward runs through `p` exactly: the GELU by `jax.vjp` of its float32
    form, the RMSNorm by `pallas_kernels.rms_norm_backward` (`norm_implementation`).
    With `recipe.hadamard`, `dequantize(quantize(p(x) R)) @ dequantize(quantize(R^T w))`,
    `dp = (q(dy) @ wq^T) R^T` and `dw = R (deq(xq)^T dy)` (the module docstring's algebra;
    `R` from `hadamard_signs(in)` in blocks of `recipe.block`; `in` must be a multiple of it).

    Args:
      x: `[T, in]` float; its dtype is the output dtype.
      w: `[in, out]` float of dtype `w_dtype` (the master weight); with a `gather`
        (inside `shard_map`) this device's shard of it along `gather.dim`.
      key: PRNG key for stochastic rounding of the output gradient, or None.
      recipe: the quantization recipe.
      w_dtype: dtype of `w` (the weight gradient is returned in it).
      gather: where `w` is sharded (`Fp8Gather`), or None: `w` is the whole kernel.
      prologue: `Prologue` (or its value).
      norm_scale: `[in]` RMSNorm gain, with `Prologue.RMSNORM` only (its gradient is returned
        in its dtype).
      input_bias: `[in]` bias added to `x` in float32 before the GELU, with `Prologue.GELU`
        only, or None (its gradient is returned in its dtype).
      eps: RMSNorm epsilon, added to the mean square.
      norm_implementation: the RMSNorm prologue's backward: "xla" (default), autodiff of its
        float32 form as the prologue computes it (XLA runs it as several passes; a passed-through
        input's cotangent is added to the rounded `dx`, as autodiff adds it); "pallas" (or None:
        pallas on Hopper, else the reference), `pallas_kernels.rms_norm_backward`, the norm's
        one-pass backward kernel, the cotangent added in float32 before the rounding (what
        `Fp8Linear` runs under the model's default norm implementation on a Hopper GPU). Checked
        against "xla" in the interpreter and on an H100, 0.49 against 0.88 ms a backward at a
        `gem_h200` step's rows (`benchmarks/fp8_norm_backward_bench.py`).
      keep_input: with `Prologue.RMSNORM`, also return `x` itself, for the residual branch of a
        pre-norm block (`h = x + f(rms_norm(x))`): its cotangent joins the norm's backward (with
        the kernel, inside its one pass, as `rms_norm(return_input=True)`; under "xla", added to
        the rounded `dx` as autodiff adds the two cotangents of `x`).

    Returns:
      `[T, out]` in x.dtype; with `keep_input`, `([T, out], x)`.

    Raises:
      ValueError: `x` or `w` not 2-D or of different inner sizes (w's rows counted gathered
        with a `gather`), an unknown prologue, or
        `norm_scale` missing (RMSNORM), of the wrong shape, or given without RMSNORM, or
        `input_bias` given without GELU or of the wrong shape, `keep_input` or a
        `norm_implementation` other than "xla" without RMSNORM, an unknown `norm_implementation`,
        or with `recipe.hadamard` an `in` that is not a multiple of `recipe.block`.
      ImplementationUnavailableError: `norm_implementation="pallas"` without a Hopper GPU
        (outside interpret mode), when the backward is traced.
    """
    prologue = Prologue(prologue)
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"fp8_matmul: x must be [T, in] and w [in, out]; got {x.shape} and {w.shape}")
    in_rows = w.shape[0] if gather is None or gather.dim != 0 else gathered_extent(w, axis_name=gather.axes)
    if x.shape[1] != in_rows:
        raise ValueError(f"fp8_matmul: x has {x.shape[1]} input features, w {in_rows} rows (w {w.shape}, {gather})")
    if (prologue is Prologue.RMSNORM) != (norm_scale is not None):
        raise ValueError(f"fp8_matmul: norm_scale is required with Prologue.RMSNORM and only with it (prologue={prologue})")
    if input_bias is not None and prologue is not Prologue.GELU:
        raise ValueError(f"fp8_matmul: input_bias is added before the GELU prologue only (prologue={prologue})")
    if keep_input and prologue is not Prologue.RMSNORM:
        raise ValueError(f"fp8_matmul: keep_input passes the input of the RMSNorm prologue through, not of {prologue}")
    if norm_implementation not in (None, Implementation.XLA, Implementation.PALLAS):
        raise ValueError(f"fp8_matmul: norm_implementation must be 'xla', 'pallas' or None, got {norm_implementation!r}")
    if norm_implementation != "xla" and prologue is not Prologue.RMSNORM:
        raise ValueError(f"fp8_matmul: norm_implementation chooses the RMSNorm prologue's backward, not {prologue}'s")
    for name, param in (("norm_scale", norm_scale), ("input_bias", input_bias)):
        if param is not None and jnp.shape(param) != (x.shape[1],):
            raise ValueError(f"fp8_matmul: {name} must be [{x.shape[1]}], got {jnp.shape(param)}")
    param = norm_scale if prologue is Prologue.RMSNORM else input_bias
    norm = _Norm(float(eps), norm_implementation, bool(keep_input))
    static = dict(recipe=recipe, gather=gather, w_dtype=jnp.dtype(w_dtype), prologue=prologue, norm=norm)
    return shared_lowering.call(_fp8_matmul_by_name, x, param, w, key, static=static)


@dataclasses.dataclass(frozen=True)
class _Norm:
    """The RMSNorm prologue's options (`fp8_matmul`'s eps, norm_implementation, keep_input)."""

    eps: float
    implementation: str | None
    keep_input: bool

    @property
    def kernel(self) -> bool:
        """Whether the backward goes through `rms_norm_backward` (any implementation but the default "xla")."""
        return self.implementation != "xla"


def _fp8_matmul_by_name(x, param, w, key, *, recipe, gather, w_dtype, prologue, norm):
    return _fp8_matmul(x, param, w, key, recipe, gather, w_dtype, prologue, norm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fp8_matmul(x, param, w, key, recipe, gather, w_dtype, prologue, norm):
    return _fp8_matmul_fwd(x, param, w, key, recipe, gather, w_dtype, prologue, norm)[0]


def _quantize_input(x, param, recipe, prologue, eps: float):
    """`quantize(p(x))`, or `quantize(p(x) @ R)` with `recipe.hadamard` (one pass on the kernel path)."""
    opts = dict(block=recipe.act_block, hadamard_signs=_input_signs(x.shape[1], recipe), implementation=recipe.implementation)
    if prologue is Prologue.RMSNORM:
        return rmsnorm_quantize_mxfp8(x, param, eps=eps, **opts)
    if prologue is Prologue.GELU:
        return gelu_quantize_mxfp8(x, bias=param, **opts)
    return quantize_mxfp8(x, **opts)


def _fp8_matmul_fwd(x, param, w, key, recipe, gather, w_dtype, prologue, norm):
    del w_dtype
    xq, sx = _quantize_input(x, param, recipe, prologue, norm.eps)
    wq, sw = quantize_weight(w, recipe, gather)
    y = mxfp8_matmul(
        xq, sx, wq, sw, b_contracting_dim=0, out_dtype=x.dtype, implementation=recipe.implementation, config=recipe.config
    )
    # The prologue's input is kept for its backward (a plain layer keeps only 8-bit data);
    # `w` (the master weight, alive anyway) only lends its sharding to the weight gradient.
    x_kept = None if prologue is Prologue.NONE else x
    return (y, x) if norm.keep_input else y, (x_kept, param, xq, sx, wq, sw, key, w)


def _with_sharding_of(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` resharded to `like`'s sharding type under an explicit mesh (a no-op otherwise)."""
    want = jax.typeof(like).sharding.spec
    return x if jax.typeof(x).sharding.spec == want else jax.sharding.reshard(x, want)


def _fp8_matmul_bwd(recipe, gather, w_dtype, prologue, norm, residuals, cotangents):
    x, param, xq, sx, wq, sw, key, w = residuals
    dy, dx_in = cotangents if norm.keep_input else (cotangents, None)
    dyq, sdy = quantize_mxfp8(dy, block=recipe.act_block, rounding=recipe.grad_rounding, key=key, implementation=recipe.implementation)
    signs = _input_signs(xq.shape[1], recipe)
    dp = mxfp8_matmul(dyq, sdy, wq, sw, out_dtype=dy.dtype, implementation=recipe.implementation, config=recipe.config)
    x16 = dequantize_mxfp8(xq, sx, block=recipe.act_block, dtype=jnp.bfloat16)
    token_axis = (((0,), (0,)), ((), ()))  # dw = x16^T dy without transposing either operand
    dw = jax.lax.dot_general(x16, dy.astype(jnp.bfloat16), token_axis, preferred_element_type=jnp.float32)
    if signs is not None:  # the GEMMs saw p(x) R and R^T w: dp = (.) R^T, dw = R (.)
        dp = reference.rotate(dp, signs, block=recipe.block, inverse=True, bf16_operands=True).astype(dy.dtype)
        dw = reference.rotate(dw, signs, block=recipe.block, axis=0, inverse=True)
    dw = dw.astype(w_dtype)
    if gather is not None:  # inside shard_map: back to this device's shard of the kernel
        dw = shard_gradient(dw, axis_name=gather.axes, dim=gather.dim)
    dw = _with_sharding_of(dw, w)
    if prologue is Prologue.NONE:
        return _with_sharding_of(dp, xq), None, dw, None
    if prologue is Prologue.RMSNORM and norm.kernel:
        dx, dparam = rms_norm_backward(x, param, dp, dx_in, eps=norm.eps, implementation=norm.implementation)
        return _with_sharding_of(dx, xq), dparam, dw, None
    # autodiff of the prologue's float32 form; a passed-through input's cotangent added as autodiff would add it
    p = (lambda x, s: reference.rmsnorm(x, s, norm.eps)) if prologue is Prologue.RMSNORM else reference.gelu
    _, prologue_vjp = jax.vjp(p, x, param)
    dx, dparam = prologue_vjp(dp.astype(jnp.float32))
    dx = dx.astype(x.dtype)
    if dx_in is not None:
        dx = dx + dx_in
    if prologue is Prologue.GELU and param is not None:
        dparam = _bias_gradient(dx, param)
    return _with_sharding_of(dx, xq), dparam, dw, None


def _bias_gradient(dx: jax.Array, bias: jax.Array) -> jax.Array:
    """`sum(dx, axis=0)` of the rounded `dx [rows, n]`, float32 accumulation, in `bias`'s dtype.

    The GELU prologue's VJP sums its float32 `dx`, which XLA writes as a second, float32 copy
    beside the rounded one the layer passes on (`benchmarks/mxfp8.md`). Summing the rounded copy
    is not enough: XLA's excess-precision simplification folds the rounding and the widening back
    into that float32 value. Behind an optimization barrier the sum reads the rounded copy. Under
    `shard_map` the sum over this device's rows is summed across the devices the rows vary over
    (the transpose of casting `bias` to vary over them).
    """
    partial = jnp.sum(jax.lax.optimization_barrier(dx).astype(jnp.float32), axis=0)
    return manual_axes.gradient_of(partial, bias)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)
