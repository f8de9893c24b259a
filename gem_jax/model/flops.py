"""FLOP accounting for the real (jagged) work of the model, and MFU.

Counts matmul FLOPs (2 per multiply-add) of the work the model actually needs: attention
over each sequence's true length (causal self-attention counts the lower triangle only),
no padding. Training counts 3x the forward (forward, input and weight gradients), the
usual convention (Kaplan et al., 2020; PaLM's MFU, Chowdhery et al., 2022).
MFU = achieved FLOP/s / peak FLOP/s; GEM reports E2E MFU = Local MFU x Scaling Ratio.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from gem_jax.batch import FeatureSpec, Pooling
from gem_jax.model import remat
from gem_jax.model.config import ModelConfig, SequenceAttention

TRAIN_FLOPS_PER_FORWARD = 3.0

# Dense bf16 peak FLOP/s per device kind (datasheet, without sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


@dataclasses.dataclass(frozen=True)
class AttentionPairs:
    """Exact number of (query, key) pairs a history of length L attends over, beyond a quadratic.

    kind "window": causal sliding window of `size` previous events (each query
    sees min(i, size) + 1 keys): `sum_i min(i + 1, size + 1)`.
    kind "block": softmax inside blocks of `size` events aligned to the start
    (the last one partial): `(L // size) * size**2 + (L % size)**2`.
    """

    kind: str
    size: int

    def __post_init__(self):
        if self.kind not in ("window", "block") or self.size < (1 if self.kind == "block" else 0):
            raise ValueError(f"AttentionPairs: kind must be 'window' (size >= 0) or 'block' (size >= 1); got {self}")

    def __call__(self, length: np.ndarray) -> np.ndarray:
        """Pairs per history, float64, for float64 lengths `length` (integers >= 0)."""
        if self.kind == "block":
            full, rest = np.floor_divide(length, self.size), np.mod(length, self.size)
            return full * self.size**2 + rest**2
        w = self.size + 1  # keys of a query with a full window, itself included
        head = np.minimum(length, w)
        return head * (head + 1) / 2 + (length - head) * w


@dataclasses.dataclass(frozen=True)
class Workload:
    """FLOPs of one sample as a function of its history length L.

        workload(L) = per_example + per_token * L + per_token_pair * P(L)

    with `P(L) = L**2`, or `pairs(L)` when `pairs` is set (windowed and
    block-local attention, whose pair counts are piecewise in L).

    One model serves MFU accounting (`total` of the real lengths of a step) and
    load balancing (`gem_jax.data.bbs` weighs samples by it). `flop_model` gives the
    forward FLOPs of `GEMModel`; `train_workload` the training FLOPs (3x).

    Attributes:
      per_token: a, FLOPs per history token of the dense (token-wise) layers,
        >= 0.
      per_token_pair: b, FLOPs per unit of P(L), >= 0 (for causal attention
        with `pairs` None, half the per-pair cost, since a causal sequence has
        L (L + 1) / 2 pairs; the + L/2 diagonal term is folded into a).
      pairs: exact (query, key) pair count per history (`AttentionPairs`), or
        None for the quadratic `L**2`.
      per_example: FLOPs that do not depend on L (cross-feature tower, heads),
        >= 0. Every per-device batch holds the same number of samples, so this
        term does not change a balanced assignment; it does lower the relative
        imbalance, which is measured against the total.
    """

    per_token: float
    per_token_pair: float
    per_example: float = 0.0
    pairs: AttentionPairs | None = None

    def __post_init__(self):
        for name in ("per_token", "per_token_pair", "per_example"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"Workload.{name} must be finite and >= 0, got {value!r}")

    def __call__(self, lengths) -> np.ndarray:
        """FLOPs of each sample.

        Args:
          lengths: int array-like of history lengths, any shape, >= 0.

        Returns:
          float64 array of the same shape, in FLOPs.

        Raises:
          ValueError: if a length is negative or not an integer.
        """
        raw = np.asarray(lengths)
        if raw.size and not (np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.bool_)):
            if not np.all(np.isfinite(raw)) or np.any(raw != np.round(raw)):
                raise ValueError(f"Workload: lengths must be integers, got dtype {raw.dtype}")
        length = raw.astype(np.float64)
        if np.any(length < 0):
            i = int(np.flatnonzero(length.ravel() < 0)[0])
            raise ValueError(f"Workload: length {length.ravel()[i]:g} at index {i} is negative")
        pairs = length * length if self.pairs is None else self.pairs(length)
        return self.per_example + self.per_token * length + self.per_token_pair * pairs

    def total(self, lengths) -> float:
        """Sum of `self(lengths)`: the FLOPs of a batch whose real histories have `lengths`."""
        return float(self(lengths).sum())

    def scaled(self, factor: float) -> Workload:
        """Every term times `factor` (e.g. `TRAIN_FLOPS_PER_FORWARD` for forward + backward)."""
        return Workload(self.per_token * factor, self.per_token_pair * factor, self.per_example * factor, self.pairs)


def attention_flops(config: ModelConfig, spec: FeatureSpec) -> dict[str, Workload]:
    """Forward FLOPs of each attention's QK^T and PV products, by rematerialization region.

    Keys are the `gem_jax.model.remat` region names that run an attention (the
    history/feature cross attentions, every sequence layer's self-attention, the pooled
    attention, the feature tokens' attention); the projections around them are not
    included. Summed into `flop_model`; the remat planner charges a region's attention
    when its policy recomputes the attention kernel.
    """
    h, hd, lq = config.num_heads, config.head_dim, config.num_pooled_queries
    f0 = spec.num_feature_tokens
    f = f0 + lq
    attn = 4 * h * hd  # QK^T and PV per (query, key) pair
    # Self-attention: the causal full forms have L (L + 1) / 2 (query, key) pairs: L**2 / 2 of
    # them in the per-pair term, the L / 2 of the diagonal's half in the per-token term; window
    # and block forms count their exact pairs (`AttentionPairs`, diagonal included).
    kind = config.sequence_attention
    seq_pairs = None
    if kind is SequenceAttention.SLIDING_WINDOW:
        seq_pairs = AttentionPairs("window", config.attention_window)
    elif kind is SequenceAttention.BLOCK_LOCAL:
        seq_pairs = AttentionPairs("block", config.attention_block_size)
    causal = seq_pairs is None
    self_attention = Workload(per_token=attn / 2 if causal else 0.0, per_token_pair=attn / (2 if causal else 1), pairs=seq_pairs)
    return {
        remat.HISTORY_CONTEXT: Workload(per_token=attn * f0, per_token_pair=0.0),  # each event attends to F0 tokens
        **{remat.seq_attention(i): self_attention for i in range(config.num_seq_layers)},
        remat.POOLED_ATTENTION: Workload(per_token=attn * lq, per_token_pair=0.0),  # Lq queries over every event
        remat.FEATURE_TO_HISTORY: Workload(per_token=attn * f, per_token_pair=0.0),  # F queries over every event
        remat.TOKEN_ATTENTION: Workload(per_token=0.0, per_token_pair=0.0, per_example=attn * f * f),
    }


def flop_model(config: ModelConfig, spec: FeatureSpec) -> Workload:
    """The per-example / per-token / per-token-pair forward FLOPs of `GEMModel`."""
    d = config.embed_dim
    m, lq = config.mlp_ratio * d, config.num_pooled_queries
    f0 = spec.num_feature_tokens
    f = f0 + lq
    width = f * d

    per_token = 0.0
    per_token += 2 * d * d + 2 * d * d  # history_context: q, out
    per_token += config.num_seq_layers * (2 * d * 3 * d + 2 * d * d + 2 * 2 * d * m)  # self-attn blocks
    per_token += 2 * d * 2 * d  # pooled attention: k/v projection
    per_token += 2 * d * 2 * d  # feature_to_history: k/v projection

    per_example = 0.0
    per_example += f0 * 2 * d * 2 * d  # history_context k/v of feature tokens
    multi_hot = [f for f in spec.user_features + spec.item_features if f.pooling is Pooling.MULTI_HOT]
    per_example += sum(2 * (f.vocab_size - 1) * d for f in multi_hot)  # multi-hot feature projections
    per_example += lq * 2 * d * d  # pooled output projection
    per_example += f * 2 * d * d * 2  # feature_to_history q and out
    per_example += f * 2 * d * 3 * d + f * 2 * d * d  # token attention: qkv and out
    pairs = f * (f - 1) // 2
    dhen = 2 * (width * m + m * width) + 2 * 2 * width * width + 2 * f * f * d + 2 * pairs * width + 2 * 3 * width * width
    per_example += config.num_dhen_layers * dhen
    per_example += spec.num_tasks * 2 * (width * config.head_hidden + config.head_hidden)

    attention = list(attention_flops(config, spec).values())
    seq_pairs = next((a.pairs for a in attention if a.pairs is not None), None)
    return Workload(
        per_token=per_token + sum(a.per_token for a in attention),
        per_token_pair=sum(a.per_token_pair for a in attention),
        per_example=per_example + sum(a.per_example for a in attention),
        pairs=seq_pairs,
    )


def train_workload(config: ModelConfig, spec: FeatureSpec) -> Workload:
    """Training FLOPs (forward + backward) of `GEMModel` per example: 3x `flop_model`."""
    return flop_model(config, spec).scaled(TRAIN_FLOPS_PER_FORWARD)


def peak_flops(device: jax.Device | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of `device` (default: the first), or None where unknown (CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for name, peak in PEAK_BF16_FLOPS.items() if name in kind), None)
