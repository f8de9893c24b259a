"""Model hyper-parameters: one frozen dataclass, taken by the model alone."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gem_jax.checks import MEMBERS, check_float, check_int, check_member
from gem_jax.model.remat import RematConfig, region_names
from pallas_kernels.mxfp8 import Fp8Recipe
from pallas_kernels import Implementation, ImplementationUnavailableError, describe_choice
from pallas_kernels.gelu_grad_matmul import ops as gelu_grad_ops


class SequenceAttention(enum.Enum):
    """What the sequence tower's self-attention blocks attend to (GEM's long-history forms).

    FULL: causal softmax over the whole history (JFA).
    SLIDING_WINDOW: causal softmax over the `attention_window` previous events and itself (JFA window).
    BLOCK_LOCAL: softmax inside blocks of `attention_block_size` events aligned to each
      history's start, RoPE fused into the kernel.
    CAUSAL_SILU: HSTU's pointwise causal attention, SiLU(QK^T / sqrt(D)) V / max_seq_len (GDPA).
    """

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    BLOCK_LOCAL = "block_local"
    CAUSAL_SILU = "causal_silu"


class Fp8Region(enum.Enum):
    """A group of dense layers that `ModelConfig.fp8` can run in FP8 (`gem_jax.quant.Fp8Linear`).

    The per-token layers over the packed history (`T_cap` rows) are where FP8 GEMMs can pay;
    the task heads, the feature projections and the pooled attention's output projection
    are never FP8 (GEM keeps the last layers in bf16).

    SEQ_ATTENTION: the sequence tower's self-attention projections (qkv `d -> 3d`, out `d -> d`).
    SEQ_MLP: the sequence tower's MLPs (`d -> mlp_ratio d -> d`).
    POOLED: the pooled attention's key/value projection (`d -> 2d`).
    INTERACTION: both cross attentions between history and feature tokens (q, kv, out).
    CROSS: the cross-feature tower's token attention (qkv, out) and DHEN mixing layers
      (`B x F` rows: the last layers before the heads).
    """

    SEQ_ATTENTION = "seq_attention"
    SEQ_MLP = "seq_mlp"
    POOLED = "pooled"
    INTERACTION = "interaction"
    CROSS = "cross"


SEQUENCE_TOWER_FP8 = (Fp8Region.SEQ_ATTENTION, Fp8Region.SEQ_MLP, Fp8Region.POOLED)
KERNEL_IMPLEMENTATIONS = (Implementation.XLA, Implementation.PALLAS)  # what the RMSNorms and the MLPs' GELU backward take: no cuDNN
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")  # the model's activation dtypes (float64: references under x64)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions of the GEM-style model.

    Attributes:
      embed_dim: width d of every token (history events and feature tokens).
      num_heads: attention heads H; `head_dim = embed_dim // num_heads`.
      num_seq_layers: self-attention blocks of the sequence tower.
      mlp_ratio: hidden width of the transformer MLPs, as a multiple of d.
      num_pooled_queries: learned queries Lq of the pooled (GDPA) attention.
      num_dhen_layers: DHEN layers in the cross-feature tower.
      head_hidden: hidden width of each task head's MLP.
      rope_base: RoPE wavelength base (Su et al., 2021).
      attention_implementation: "xla", "pallas", "cudnn" or None (pallas on Hopper GPUs);
        see `attention_implementations` for what each attention op runs.
      norm_implementation: what the model's RMSNorms run (`gem_jax.nn.layers.RMSNorm`, through
        `pallas_kernels.rms_norm`): "xla" (flax's `nnx.RMSNorm` bit for bit), "pallas" or None
        (default: its one-pass kernels on a Hopper GPU, for the widths they take, "xla"
        elsewhere; the sequence tower's pre-norms then also add the residual branch's gradient
        inside the backward kernel). An FP8
        layer (`fp8`) takes its pre-norm into its quantization pass instead, under any setting, and
        runs the norm's backward under this one (`Fp8Linear`). The
        QK-norms before the sequence tower's softmax and causal SiLU attention run in
        `pallas_kernels.qk_norm_rope`, under `attention_implementation`.
      mlp_implementation: what runs the backward of the sequence tower's MLPs' GELU (their layers in the
        compute dtype; FP8 layers and `fp8_saved_activations` compute theirs otherwise): "xla" (default:
        autodiff with the GELU recomputed), "pallas" (`gem_jax.nn.gelu_backward`: the down-projection's
        input-gradient GEMM with the GELU's gradient and the up-projection bias's in its epilogue,
        `pallas_kernels.gelu_grad_matmul`) or None ("pallas" where its kernel takes the layers' inputs:
        bfloat16 on a Hopper GPU; else "xla").
      sequence_attention: the self-attention form of the sequence tower (`SequenceAttention`).
      attention_window: events before each event that SLIDING_WINDOW attends to (>= 0).
      attention_block_size: events per BLOCK_LOCAL block (>= 1; the kernels take 64).
      compute_dtype: activations' dtype, one of `COMPUTE_DTYPES`; "float32" unless set (the GPU
        configs, `configs/gem_h200.py` and `configs/gem_sharded.py` among them, set "bfloat16").
      fp8: run the dense layers of `fp8_regions` through FP8 matmuls (`gem_jax.quant.Fp8Linear`);
        the feature projections and the task heads stay in the compute dtype.
      fp8_block: 32 for MXFP8 (32x32 blocks) or 128 (1x128 / 128x128 promotion).
      fp8_hadamard: rotate each FP8 layer's input features by a fixed random Hadamard in
        blocks of `fp8_block` before quantizing (`Fp8Recipe.hadamard`: the input, the weight's
        rows and the gradients; QuaRot, arXiv:2404.00456). With
        `fp8_block=128` the rotation runs inside the one-pass quantize kernel on the GPU.
        With `fp8` and `fp8_hadamard` on, `embed_dim` must be a multiple of `fp8_block` (ValueError).
      fp8_saved_activations: keep the sequence tower's largest saved activations for the
        backward as FP8 E4M3 with 1x128 block scales (`gem_jax.quant.saved_activations`):
        each MLP's pre-GELU `h [T, mlp_ratio * d]` (GELU recomputed in the backward) and the
        inputs of the QKV, MLP-up and pooled-KV projections (their `dx` stays exact). The
        forward is unchanged; gradients carry E4M3's rounding (~2.7% relative). The
        attention kernels' own residuals (q, k, v, out) stay in `compute_dtype`. FP8 layers
        (`fp8`) keep FP8 inputs anyway and are left as they are; the option acts on the
        layers that run in `compute_dtype`. False keeps today's residuals, bit for bit.
      fp8_regions: the `Fp8Region`s whose layers run in FP8 when `fp8` is on (default: the
        sequence tower's per-token layers); ignored when `fp8` is off.
      remat: which regions recompute their activations in the backward
        (`gem_jax.model.remat`); default none.
      tied_qk_init: start every attention's key projection equal to its query projection
        (mimetic initialisation, `gem_jax.nn.layers.tie_key_to_query`), so a token first
        attends to the keys that look like it; False: independent random projections. The
        pooled attention's queries are learned parameters, not a projection: its keys stay
        independent.

    Raises:
      ValueError: a field out of range, or a `remat` pattern that matches no region
        of this model (named).
      TypeError: a size that is not an int, or a `rope_base` that is not a number (named).
    """

    embed_dim: int = 64
    num_heads: int = 2
    num_seq_layers: int = 2
    mlp_ratio: int = 2
    num_pooled_queries: int = 4
    num_dhen_layers: int = 1
    head_hidden: int = 64
    rope_base: float = 10_000.0
    attention_implementation: Implementation | None = None
    norm_implementation: Implementation | None = dataclasses.field(default=None, metadata={MEMBERS: KERNEL_IMPLEMENTATIONS})
    mlp_implementation: Implementation | None = dataclasses.field(default=Implementation.XLA, metadata={MEMBERS: KERNEL_IMPLEMENTATIONS})
    sequence_attention: SequenceAttention = SequenceAttention.FULL
    attention_window: int = 256
    attention_block_size: int = 64
    compute_dtype: str = "float32"
    fp8: bool = False
    fp8_block: int = 32
    fp8_hadamard: bool = False
    fp8_saved_activations: bool = False
    fp8_regions: tuple[Fp8Region, ...] = SEQUENCE_TOWER_FP8
    remat: RematConfig = RematConfig()
    tied_qk_init: bool = False

    def __post_init__(self):
        object.__setattr__(self, "sequence_attention", SequenceAttention(self.sequence_attention))
        check_member(self, "norm_implementation", "RMSNorm has no cuDNN implementation")
        check_member(self, "mlp_implementation", "the GELU backward has no cuDNN implementation")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"ModelConfig.compute_dtype must be one of {', '.join(map(repr, COMPUTE_DTYPES))}, got {self.compute_dtype!r}")
        for flag in ("fp8_hadamard", "tied_qk_init"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        try:
            regions = tuple(Fp8Region(r) for r in self.fp8_regions)
        except (TypeError, ValueError):
            raise ValueError(
                f"fp8_regions must be a tuple of {[r.name for r in Fp8Region]}; got {self.fp8_regions!r}"
            ) from None
        if len(set(regions)) != len(regions):
            raise ValueError(f"fp8_regions names a region twice: {[r.name for r in regions]}")
        object.__setattr__(self, "fp8_regions", regions)
        # Sizes before anything divides by them; 0 layers is an ablation that trains (no self-attention blocks,
        # no DHEN layers). fp8_block is the recipe's to check (32 or 128), when fp8 is on.
        for name, minimum in (
            ("embed_dim", 1), ("num_heads", 1), ("num_seq_layers", 0), ("mlp_ratio", 1), ("num_pooled_queries", 1),
            ("num_dhen_layers", 0), ("head_hidden", 1), ("attention_window", 0), ("attention_block_size", 1),
            ("fp8_block", None),
        ):
            check_int(self, name, minimum=minimum)
        check_float(self, "rope_base", positive=True)
        if self.fp8 and self.fp8_recipe.hadamard and self.embed_dim % self.fp8_block:  # the recipe checks fp8_block
            # Every FP8 layer's input width is a multiple of embed_dim (d, mlp_ratio d, 3 F d in DHEN mixing).
            raise ValueError(
                f"fp8_hadamard rotates each FP8 layer's input features in blocks of fp8_block={self.fp8_block}; "
                f"embed_dim {self.embed_dim} is not a multiple of it"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(f"ModelConfig.embed_dim {self.embed_dim} is not a multiple of num_heads {self.num_heads}")
        if (self.embed_dim // self.num_heads) % 2:
            raise ValueError(
                f"ModelConfig head_dim = embed_dim // num_heads = {self.embed_dim} // {self.num_heads} = "
                f"{self.embed_dim // self.num_heads} must be even for RoPE"
            )
        self.remat.check_regions(self.region_names)

    @property
    def region_names(self) -> tuple[str, ...]:
        """The model's rematerialization regions, in forward order (`gem_jax.model.remat`)."""
        return region_names(self.num_seq_layers, self.num_dhen_layers)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def dtype(self) -> jnp.dtype:
        """`compute_dtype` as a dtype: every activation and every matmul operand is in it."""
        return jnp.dtype(self.compute_dtype)

    @property
    def fp8_recipe(self) -> Fp8Recipe | None:
        """The towers' FP8 recipe, or None for plain dense layers."""
        return Fp8Recipe(block=self.fp8_block, hadamard=self.fp8_hadamard) if self.fp8 else None

    def fp8_for(self, region: Fp8Region) -> Fp8Recipe | None:
        """The FP8 recipe of the layers of `region`, or None where they run in the compute dtype."""
        return self.fp8_recipe if region in self.fp8_regions else None


class AttentionImplementations(NamedTuple):
    """The `implementation=` each attention op of the model gets.

    Attributes:
      softmax: for `pallas_kernels.jagged_flash_attention` (the sequence tower's causal
        self-attention).
      gelu: for every `pallas_kernels.gdpa` call (history/feature cross attention, pooled
        attention, the cross tower's token attention, causal SiLU self-attention).
      block_local: for `pallas_kernels.block_local_attention`.
      qk_norm_rope: for `pallas_kernels.qk_norm_rope` (the QK-norm and RoPE before the
        self-attention, except block-local's, which rotates inside its kernel).
    """

    softmax: Implementation | str | None
    gelu: Implementation | str | None
    block_local: Implementation | str | None
    qk_norm_rope: Implementation | str | None


def attention_implementations(config: ModelConfig) -> AttentionImplementations:
    """What each attention op runs under `config.attention_implementation`.

    `"cudnn"` is the padded peer, what a JAX user has without jagged kernels: cuDNN flash
    attention on the padded layout with sequence lengths
    (`jax.nn.dot_product_attention(..., implementation="cudnn")`, through
    `jagged_flash_attention(implementation="cudnn")`) for the softmax attention and, since
    cuDNN has no GELU or block-local attention, the jnp references (XLA) for the rest (the
    QK-norm and RoPE included). Any other value (None, "xla", "pallas") goes to every op unchanged.
    """
    implementation = config.attention_implementation
    if implementation == Implementation.CUDNN:
        xla = Implementation.XLA
        return AttentionImplementations(softmax=implementation, gelu=xla, block_local=xla, qk_norm_rope=xla)
    return AttentionImplementations(softmax=implementation, gelu=implementation, block_local=implementation, qk_norm_rope=implementation)


def _mlp_gelu_backward_line(config: ModelConfig) -> str:
    """The start-up line of `mlp_implementation`: what the sequence MLPs' GELU backward runs, for their widths
    and compute dtype (`gem_jax.nn.gelu_backward.takes`'s decision at a capacity of 128 rows).

    Raises:
      ImplementationUnavailableError, ValueError: "pallas" this machine cannot run, or for layers its kernel
        does not take, naming the setting and the layers.
    """
    label, setting = "MLP GELU backward (sequence tower)", f"model.mlp_implementation={getattr(config.mlp_implementation, 'value', None)}"
    if config.fp8_for(Fp8Region.SEQ_MLP) is not None or config.fp8_saved_activations:
        return f"{label}: the FP8 path (FP8 layers or FP8 saved activations compute it; {setting} unused)"
    d, hidden = config.embed_dim, config.mlp_ratio * config.embed_dim
    try:
        choice = describe_choice("gelu_grad_matmul", config.compute_dtype, implementation=config.mlp_implementation)
        if choice.implementation is Implementation.PALLAS and not gelu_grad_ops.runs_kernel(
            jax.ShapeDtypeStruct((128, d), config.compute_dtype),
            jax.ShapeDtypeStruct((hidden, d), config.compute_dtype),
            jax.ShapeDtypeStruct((128, hidden), config.compute_dtype),
            implementation=config.mlp_implementation,
        ):
            return f"{label}: xla (the kernel takes bfloat16 layers of widths its tiles divide; these are {config.compute_dtype}, {d} -> {hidden} -> {d})"
    except ImplementationUnavailableError as error:
        raise ImplementationUnavailableError(f"{setting}: {error}") from None
    except ValueError as error:
        raise ValueError(f"{setting}: {error} (the sequence MLPs: {config.compute_dtype}, {d} -> {hidden} -> {d})") from None
    return f"{label}: {choice.implementation.value} ({choice.reason})"


def describe_attention(config: ModelConfig) -> list[str]:
    """One line per attention op of the model, one for its RMSNorms and one for its MLPs' GELU backward: the
    implementation each runs on this machine and why.

    Uses `pallas_kernels.describe_choice`, the same decision the ops make for the
    model's compute dtype and head dim (the width for the norms; FP8 layers, when on, are named too).

    Raises:
      ImplementationUnavailableError: an implementation this machine cannot run
        (e.g. "pallas" without a Hopper GPU), as the op would raise it in the step.
    """
    chosen = attention_implementations(config)
    self_attention = {
        SequenceAttention.FULL: ("jagged_flash_attention", chosen.softmax),
        SequenceAttention.SLIDING_WINDOW: ("jagged_flash_attention", chosen.softmax),
        SequenceAttention.BLOCK_LOCAL: ("block_local_attention", chosen.block_local),
        SequenceAttention.CAUSAL_SILU: ("gdpa", chosen.gelu),
    }[config.sequence_attention]
    d, attention = config.head_dim, "attention_implementation"
    ops = [(f"self-attention ({config.sequence_attention.value})", *self_attention, d, attention), ("GELU attention (GDPA)", "gdpa", chosen.gelu, d, attention)]
    if config.sequence_attention is not SequenceAttention.BLOCK_LOCAL:
        ops.append(("QK-norm and RoPE", "qk_norm_rope", chosen.qk_norm_rope, d, attention))
    ops.append((f"RMSNorm (width {config.embed_dim})", "rms_norm", config.norm_implementation, config.embed_dim, "norm_implementation"))
    lines = []
    for label, op, implementation, width, setting in ops:
        try:
            choice = describe_choice(op, config.compute_dtype, width, implementation=implementation)
        except ImplementationUnavailableError as error:  # name the setting that asked for it
            raise ImplementationUnavailableError(f"model.{setting}={getattr(implementation, 'value', implementation)}: {error}") from None
        lines.append(f"{label}: {choice.implementation.value} ({choice.reason})")
    lines.append(_mlp_gelu_backward_line(config))
    if config.fp8:
        choice = describe_choice("mxfp8_matmul", "float8_e4m3fn")
        regions = ", ".join(r.value for r in config.fp8_regions) or "none"
        rotation = ", random Hadamard rotation" if config.fp8_hadamard else ""
        lines.append(
            f"FP8 dense layers ({config.fp8_block}-wide blocks{rotation}; {regions}): {choice.implementation.value} ({choice.reason})"
        )
    if config.fp8_saved_activations:
        lines.append(
            "FP8 saved activations (E4M3, 1x128 blocks): the sequence tower's MLP pre-GELU and the inputs of its "
            "bf16 QKV, MLP-up and pooled-KV projections"
        )
    return lines
