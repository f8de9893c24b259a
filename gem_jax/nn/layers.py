"""Building blocks with logical-axis annotations: dense layers, embedding tables, MLPs, RoPE.

Every parameter carries logical axis names (`embed`, `mlp`, `heads`, `table_rows`,
`table_dim`, ...); `gem_jax.parallel.rules` maps them to mesh axes per config.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from gem_jax import shard_context
from gem_jax.nn import embeddings, gelu_backward
from gem_jax.pytree import path_str
from gem_jax.quant.dense import Fp8Linear
from gem_jax.quant.saved_activations import dense_fp8_input, gelu_dense_fp8_input
from pallas_kernels.mxfp8 import Fp8Recipe
from pallas_kernels.mixed_precision import dot_general_float32
from pallas_kernels.qk_norm_rope import reference as qk_norm_rope_reference

EMBEDDING_PARAM = "embedding"  # name of every embedding-table parameter (the sparse optimizer's partition key)


def dense(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    rngs: nnx.Rngs,
    use_bias: bool = True,
    fp8: Fp8Recipe | None = None,
    dtype: jnp.dtype | None = None,
    float32_output: bool = False,
) -> nnx.Linear | Fp8Linear:
    """A dense layer whose kernel `[in, out]` carries the logical axis names `axes`.

    `nnx.Linear`, or with an `fp8` recipe the drop-in `Fp8Linear` (same parameters).
    Parameters are float32; `dtype` is the compute dtype: input, kernel and bias are
    cast to it before the matmul, so no float32 operand reaches a bfloat16 model's
    GEMMs (None: the promoted dtype of input and parameters). `float32_output`
    returns the matmul's float32 accumulator (plus the bias) instead of rounding it to
    `dtype`, with the backward GEMMs still in `dtype`
    (`pallas_kernels.mixed_precision`): for logits. Not with `fp8`.

    Raises:
      ValueError: `float32_output` together with an `fp8` recipe.
    """
    if fp8 is None:
        layer = functools.partial(nnx.Linear, dot_general=dot_general_float32) if float32_output else nnx.Linear
    elif float32_output:
        raise ValueError(f"dense {in_features}->{out_features}: float32_output is not supported by the FP8 layer")
    else:
        layer = functools.partial(Fp8Linear, recipe=fp8)
    return layer(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)),
        rngs=rngs,
    )


def tie_key_to_query(query: nnx.Linear | Fp8Linear, key: nnx.Linear | Fp8Linear, *, width: int, query_column: int = 0,
                     key_column: int) -> None:
    """Copies the query projection's kernel columns `[query_column, +width)` over the key projection's `[key_column, +width)`.

    With equal query and key projections at initialisation, a token's score against a key
    whose input shares its direction starts high (each head's `W_q W_k^T` is positive
    semi-definite) instead of at random: mimetic initialisation (Trockman & Kolter,
    "Mimetic Initialization of Self-Attention Layers", ICML 2023, arXiv:2305.09828). Call it
    once, right after the layers are built (`query` and `key` may be one fused layer);
    training then moves the two apart freely. Draws no random numbers.

    Args:
      query, key: dense layers with kernels `[in, out_q]` and `[in, out_k]` (the same `in`).
      width: columns to copy (d: every head's `H * D` query features), >= 1.
      query_column, key_column: the first query and the first key column.

    Raises:
      ValueError: `width` below 1, the kernels' input widths differ, a column range falls
        outside its kernel, or `query` and `key` are one layer and the two ranges overlap.
    """
    q, k = query.kernel[...], key.kernel[...]
    if width < 1:
        raise ValueError(f"tie_key_to_query: width must be >= 1, got {width}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"tie_key_to_query: the query kernel {q.shape} and the key kernel {k.shape} take different input widths")
    if min(query_column, key_column) < 0 or query_column + width > q.shape[1] or key_column + width > k.shape[1]:
        raise ValueError(
            f"tie_key_to_query: columns [{query_column}, +{width}) of the query kernel {q.shape} do not fit "
            f"columns [{key_column}, +{width}) of the key kernel {k.shape}"
        )
    if query is key and abs(query_column - key_column) < width:
        raise ValueError(
            f"tie_key_to_query: query columns [{query_column}, +{width}) and key columns [{key_column}, +{width}) "
            f"overlap in one kernel {q.shape}"
        )
    key.kernel[...] = k.at[:, key_column:key_column + width].set(q[:, query_column:query_column + width])


class EmbeddingTable(nnx.Module):
    """An embedding table for ids `[0, num_rows)` (row 0 is padding).

    The parameter has `padded_table_rows(num_rows)` rows (a mesh-independent padding
    so that rows divide over the owners; padding rows are never read). Lookups go
    through `gem_jax.nn.embeddings.lookup`: a plain gather on one device; inside a
    sharded step, with the placement the step's context holds for the table's `path`
    (`gem_jax.shard_context.table_placement`), the sharded all-to-all exchange.
    Out-of-range ids are never clamped: they get a zero row (or are hashed, per the
    table's `OutOfRange` policy) and are counted.

    Attributes:
      num_rows: vocabulary size.
      exchange_dtype: the dtype rows cross the network in when the table is sharded
        (the model's compute dtype); None keeps the parameter's (float32).
      path: the table's module path in its model ("embed/item"), set once when the
        model is built (`name_layers`), or None (a local lookup).
    """

    def __init__(self, num_rows: int, dim: int, *, rngs: nnx.Rngs, exchange_dtype: jnp.dtype | str | None = None):
        self.num_rows = num_rows
        self.exchange_dtype = None if exchange_dtype is None else jnp.dtype(exchange_dtype)
        self.path: str | None = None
        init = nnx.with_partitioning(nnx.initializers.normal(stddev=dim**-0.5), ("table_rows", "table_dim"))
        setattr(self, EMBEDDING_PARAM, nnx.Param(init(rngs.params(), (embeddings.padded_table_rows(num_rows), dim))))

    def __call__(self, ids: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """int `[...]` -> `[..., dim]`: float32 (the parameter's dtype), or `exchange_dtype` when the rows
        came through a sharded exchange; zero rows where bool `mask` `[...]` is False."""
        placement = shard_context.table_placement(self.path)
        return embeddings.lookup(
            getattr(self, EMBEDDING_PARAM)[...], ids, self.num_rows, placement, mask=mask, exchange_dtype=self.exchange_dtype
        )


def name_layers(model: nnx.Module) -> None:
    """Sets `path` on every `EmbeddingTable` and `Fp8Linear` of `model` to its module path ("embed/item").

    Called once by a model's constructor, on the finished model: the path is a static
    attribute of the layer (kept by `nnx.split` / `nnx.merge`), by which a sharded step's
    context gives it its placement or FP8 gather (`gem_jax.shard_context`).
    """
    for path, module in nnx.iter_modules(model):
        if isinstance(module, (EmbeddingTable, Fp8Linear)):
            module.path = path_str(path)


class RMSNorm(nnx.RMSNorm):
    """flax's `nnx.RMSNorm` (the same parameter, `scale`) computed by `pallas_kernels.rms_norm` under
    `implementation`: "xla" is flax's computation bit for bit (float32 statistics; flax's own are float64
    under jax's x64 mode); "pallas" or None run its one-pass kernels on a Hopper GPU for the widths they take.

    `[..., dim]` in, `[..., dim]` out in `dtype` (None: the promoted dtype of input and scale).

    Raises:
      ValueError: a flax option this computation does not follow (other reduction or feature axes, an
        `axis_name`, no scale, another `promote_dtype`).
    """

    def __init__(self, dim: int, *, implementation=pallas_kernels.Implementation.XLA, **kwargs):
        # What `pallas_kernels.rms_norm` computes: flax's defaults for these (the last axis, one device's
        # statistics, a scale); the parameter's own options (dtype, param_dtype, epsilon, initialisers) pass through.
        computed = {"reduction_axes": -1, "feature_axes": -1, "axis_name": None, "axis_index_groups": None, "use_scale": True}
        other = {name: kwargs[name] for name, default in computed.items() if name in kwargs and kwargs[name] != default}
        if "promote_dtype" in kwargs:
            other["promote_dtype"] = kwargs["promote_dtype"]
        if other:
            raise ValueError(f"RMSNorm computes flax's default {sorted(other)}; got {other}: use flax's nnx.RMSNorm for them")
        super().__init__(dim, **kwargs)
        self.implementation = implementation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._normalize(x, return_input=False)

    def keeping_input(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`(self(x), x)`, for a residual branch that adds to the returned `x`: on the kernel path its gradient is
        added to the norm's input gradient inside the backward kernel (`pallas_kernels.rms_norm(return_input=True)`)."""
        return self._normalize(x, return_input=True)

    def _normalize(self, x: jax.Array, *, return_input: bool):
        return pallas_kernels.rms_norm(
            x, self.scale[...], eps=self.epsilon, dtype=self.dtype, return_input=return_input, implementation=self.implementation
        )


def rms_norm(dim: int, *, rngs: nnx.Rngs, dtype: jnp.dtype | None = None, implementation=pallas_kernels.Implementation.XLA) -> RMSNorm:
    """RMSNorm (Zhang & Sennrich, 2019) over the last axis of width `dim`, scale on logical axis `norm`.

    Statistics are computed in float32 (flax's `nnx.RMSNorm`); the output is in `dtype`
    (None: the promoted dtype of input and scale). `implementation`: `RMSNorm`'s.
    """
    scale_init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
    return RMSNorm(dim, implementation=implementation, epsilon=1e-6, dtype=dtype, scale_init=scale_init, rngs=rngs)


def norm_dense_parts(
    norm: nnx.RMSNorm, layer: nnx.Linear | Fp8Linear, x: jax.Array, parts: int, *, fp8_saved_input: bool = False
) -> list[jax.Array]:
    """`norm_dense(norm, layer, x)` as `parts` equal column blocks (a fused projection's keys and values):
    `[..., out / parts]` each.

    With an `nnx.Linear` each block is a GEMM of its own on its columns of the kernel (and of the
    bias), so it comes out contiguous: slices of the fused product are copied out by an XLA pass
    before a kernel that takes them (`pallas_kernels.gdpa`, `rms_norm`), and their gradients are
    stacked back by another, where here the blocks' input gradients are summed by the GEMMs
    (cuBLAS adds the second into the first's output) and their kernel gradients are small. At
    `configs/gem_h200.py` the two fused key-value projections (`CrossAttention`,
    `PooledAttention`) lose four `[166656, 2, 8, 128]` passes (`benchmarks/step.md`).

    The same values as `jnp.split(norm_dense(...), parts, axis=-1)`, which is what an `Fp8Linear`
    (one quantization of the normed rows for the whole width) and `fp8_saved_input` (one FP8 copy
    of them) return, up to the order of a narrower GEMM's sums; the kernel's and bias's gradients
    are the fused ones' columns. The input's gradient adds the blocks' GEMM products, each rounded
    to the compute dtype first: within a few units of its last place of the fused GEMM's one rounding.

    Args:
      norm: the RMSNorm before the layer.
      layer: the fused projection, kernel `[in, out]` (float parameters, computed in `layer.dtype`).
      x: `[..., in]`, any float dtype.
      parts: how many equal column blocks, dividing `out`.
      fp8_saved_input: as `norm_dense`'s.

    Returns:
      `parts` arrays `[..., out / parts]` in the layer's compute dtype, in column order.

    Raises:
      ValueError: `parts` < 1 or not dividing the layer's output width, or an `nnx.Linear` with a
        `preferred_element_type`.
    """
    width = layer.kernel.shape[-1]
    if parts < 1 or width % parts:
        raise ValueError(f"norm_dense_parts: {parts} parts do not divide the layer's {width} output columns")
    if isinstance(layer, Fp8Linear) or fp8_saved_input:
        return jnp.split(norm_dense(norm, layer, x, fp8_saved_input=fp8_saved_input), parts, axis=-1)
    if layer.preferred_element_type is not None:  # `nnx.Linear.__call__`'s other option, which `dense` never sets
        raise ValueError("norm_dense_parts: a layer with preferred_element_type is not split (its call passes it to dot_general)")
    normed, kernel, bias = _promoted(layer, norm(x))
    block = width // parts
    outs = []
    for k in range(parts):
        columns = slice(k * block, (k + 1) * block)
        y = _matmul(layer, normed, kernel[:, columns])
        outs.append(y if bias is None else y + bias[columns])
    return outs


def _promoted(layer: nnx.Linear, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`(x, kernel, bias)` in the layer's compute dtype, as `nnx.Linear.__call__` promotes them."""
    bias = layer.bias[...] if layer.bias is not None else None
    return layer.promote_dtype((x, layer.kernel[...], bias), dtype=layer.dtype)


def _matmul(layer: nnx.Linear, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`x @ kernel` over x's last axis, as `nnx.Linear.__call__` computes it (without the bias)."""
    return layer.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)


def norm_dense(
    norm: nnx.RMSNorm, layer: nnx.Linear | Fp8Linear, x: jax.Array, *, fp8_saved_input: bool = False, residual: bool = False
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`layer(norm(x))`; an `Fp8Linear` quantizes the normed rows in the norm's own pass (`Fp8Linear(norm=)`).

    `fp8_saved_input`: a bf16 layer's weight gradient reads an FP8 copy of `norm(x)`
    (`gem_jax.quant.saved_activations.dense_fp8_input`); an `Fp8Linear` keeps FP8 inputs anyway.
    `residual`: return `(layer(norm(x)), x)` for a pre-norm block that adds its branch to the returned `x`
    (`RMSNorm.keeping_input`, or an `Fp8Linear`'s `keep_input`: with the norm's kernels its gradient joins
    the norm's backward pass).
    """
    if isinstance(layer, Fp8Linear):
        out = layer(x, norm=norm, keep_input=residual)
        if residual:
            out, x = out
    else:
        if residual and isinstance(norm, RMSNorm):
            normed, x = norm.keeping_input(x)
        else:
            normed = norm(x)
        out = dense_fp8_input(layer, normed) if fp8_saved_input else layer(normed)
    return (out, x) if residual else out


def gelu(x: jax.Array) -> jax.Array:
    """`jax.nn.gelu` (the tanh approximation, Hendrycks & Gimpel 2016) whose backward recomputes the
    tanh from `x` instead of keeping it: any shape and float dtype in, the same shape and dtype out.

    Differentiated as written, the tanh is a residual: the forward writes it beside the output
    and the backward reads it beside `x` and the cotangent, one extra tensor of `x`'s size each
    way (at `configs/gem_h200.py` a `[166656, 4096]` bf16 tensor, 1.4 GB, per sequence layer).
    Under `jax.checkpoint` the only residual is `x`, which the backward reads anyway; the
    forward is then a plain GELU after its GEMM, which XLA's GPU compiler moves into the
    cuBLAS epilogue (`benchmarks/step.md`, "Reading the step without a GPU"). The same values
    and gradients as `jax.nn.gelu` bit for bit on the CPU; on the GPU the epilogue computes
    the GELU from the GEMM's float32 accumulator instead of its bf16-rounded output.
    """
    return jax.checkpoint(jax.nn.gelu)(x)


class MLP(nnx.Module):
    """`Linear -> GELU -> Linear` with logical axes (`embed` -> `mlp` -> `embed`).

    `dtype` is the compute dtype of both layers; `float32_output` applies to the
    second (see `dense`). With FP8 layers the GELU, and the first layer's bias, run in the
    second layer's input quantization pass (and a pre-norm passed to the call in the first's).
    `fp8_saved_activations` keeps only FP8 copies of the bf16 layers' inputs and of the
    hidden pre-activation for the backward (`gem_jax.quant.saved_activations`).
    `gelu_backward`: what runs the GELU's backward of a layer pair in the compute dtype (not FP8, not
    `fp8_saved_activations`): "xla", autodiff with the GELU recomputed (`gelu`); "pallas", the
    down-projection's input-gradient GEMM with the GELU's gradient and the up-projection bias's in
    its epilogue (`gem_jax.nn.gelu_backward`); None, "pallas" where its kernel takes the layer's
    inputs (bfloat16 on a Hopper GPU, rows a multiple of 128, widths of its tiles), else "xla".
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        out: int | None = None,
        *,
        rngs: nnx.Rngs,
        fp8: Fp8Recipe | None = None,
        dtype: jnp.dtype | None = None,
        float32_output: bool = False,
        fp8_saved_activations: bool = False,
        gelu_backward: pallas_kernels.Implementation | None = pallas_kernels.Implementation.XLA,
    ):
        self.fp8_saved_activations = fp8_saved_activations
        self.gelu_backward = gelu_backward
        self.up = dense(dim, hidden, ("embed", "mlp"), rngs=rngs, fp8=fp8, dtype=dtype)
        self.down = dense(hidden, out or dim, ("mlp", "embed"), rngs=rngs, fp8=fp8, dtype=dtype, float32_output=float32_output)

    def __call__(self, x: jax.Array, norm: nnx.RMSNorm | None = None) -> jax.Array:
        """`down(gelu(up(x)))`, or `down(gelu(up(norm(x))))` with a pre-norm."""
        saved = self.fp8_saved_activations
        if self._fp8_pair():
            return self._fp8_forward(x, norm)
        if self._fused_gelu_backward(x):
            return self._bias_gelu_down(norm(x) if norm is not None else x)
        if norm is not None:
            h = norm_dense(norm, self.up, x, fp8_saved_input=saved)
        else:
            h = dense_fp8_input(self.up, x) if saved else self.up(x)
        return self._down(h)

    def residual(self, x: jax.Array, norm: nnx.RMSNorm) -> jax.Array:
        """`x + self(x, norm=norm)`, the pre-norm residual block (`norm_dense(residual=True)`, or with FP8 layers
        `Fp8Linear(keep_input=True)`: with the norm's kernels the residual branch's gradient joins the norm's
        backward pass)."""
        if self._fp8_pair():
            h, x = self.up(x, norm=norm, add_bias=False, keep_input=True)
            return x + self._fp8_down(h)
        if self._fused_gelu_backward(x):
            normed, x = norm.keeping_input(x) if isinstance(norm, RMSNorm) else (norm(x), x)
            return x + self._bias_gelu_down(normed)
        h, x = norm_dense(norm, self.up, x, fp8_saved_input=self.fp8_saved_activations, residual=True)
        return x + self._down(h)

    def _fused_gelu_backward(self, x: jax.Array) -> bool:
        """Whether this call runs `gem_jax.nn.gelu_backward` (see `gelu_backward` in the class docstring)."""
        if self.gelu_backward is pallas_kernels.Implementation.XLA or self.fp8_saved_activations:
            return False
        plain = all(type(layer) is nnx.Linear and layer.bias is not None for layer in (self.up, self.down))
        if not plain or self.down.dot_general is not jax.lax.dot_general or self.down.preferred_element_type is not None:
            return False  # a float32-output layer (`dense(float32_output=True)`) or FP8 layers compute otherwise
        hidden, out = self.down.kernel.shape
        dtype = self.down.dtype or x.dtype
        rows = math.prod(x.shape[:-1])
        return gelu_backward.takes(self.gelu_backward, rows, hidden, out, dtype)

    def _bias_gelu_down(self, x: jax.Array) -> jax.Array:
        """`down(gelu(up(x)))` with the GELU's backward in the down-projection's GEMM (`gem_jax.nn.gelu_backward`)."""
        up, down = self.up, self.down
        x, up_kernel, up_bias = _promoted(up, x)
        h = _matmul(up, x, up_kernel)
        down_kernel, down_bias = down.promote_dtype((down.kernel[...], down.bias[...]), dtype=h.dtype)
        return gelu_backward.bias_gelu_dense(h, up_bias, down_kernel, down_bias, implementation=self.gelu_backward)

    def _fp8_pair(self) -> bool:
        return isinstance(self.up, Fp8Linear) and isinstance(self.down, Fp8Linear)

    def _fp8_forward(self, x: jax.Array, norm: nnx.RMSNorm | None) -> jax.Array:
        """Both layers FP8: the norm in the up layer's quantization pass, the GELU and up bias in the down layer's."""
        return self._fp8_down(self.up(x, norm=norm, add_bias=False))

    def _fp8_down(self, h: jax.Array) -> jax.Array:
        """`down(gelu(h + up.bias))` in the down layer's quantization pass, from the up layer's output without its bias."""
        up_bias = None if self.up.bias is None else self.up.bias[...]
        return self.down(h, gelu=True, input_bias=up_bias)

    def _down(self, h: jax.Array) -> jax.Array:
        """`down(gelu(h))` from the up layer's pre-activation `h`."""
        if isinstance(self.down, Fp8Linear):
            return self.down(h, gelu=True)
        return gelu_dense_fp8_input(self.down, h) if self.fp8_saved_activations else self.down(gelu(h))


class RopeTable(NamedTuple):
    """Rotation angles of every row, shared by all heads and layers: float32 `[T, 1, D/2]` each."""

    cos: jax.Array
    sin: jax.Array


def rope_table(positions: jax.Array, dim: int, base: float) -> RopeTable:
    """Cosines and sines of the RoPE angles (Su et al., "RoFormer", 2021) of `positions`.

    Computed once per forward pass and shared by the queries and keys of every layer.

    Args:
      positions: int `[T]` position of each row inside its own sequence.
      dim: head dimension D (even).
      base: wavelength base.
    """
    half = dim // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None, None] * freqs  # [T, 1, D/2]
    return RopeTable(jnp.cos(angles), jnp.sin(angles))


def apply_rope(x: jax.Array, table: RopeTable, dtype: jnp.dtype | None = None) -> jax.Array:
    """Rotary position embedding, rotate-half form: `[T, H, D]` -> `[T, H, D]` in `dtype` (default x.dtype).

    Computed in float32: give it the float32 output of the QK-norm and the compute
    dtype as `dtype`, and norm and rotation are one elementwise pass with one rounding.
    The sequence tower runs both through `pallas_kernels.qk_norm_rope` (its reference
    computes the rotation with this function's formula, `qk_norm_rope.reference.rope`).
    """
    return qk_norm_rope_reference.rope(x, table.cos, table.sin, dtype)
