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

from gem_jax.batch import FeatureSpec, Task
from gem_jax.model.config import ModelConfig
from gem_jax.model.gem import NUM_BASE_TOKENS

TRAIN_FLOPS_PER_FORWARD = 3.0

# Dense bf16 peak FLOP/s per device kind (datasheet, without sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


@dataclasses.dataclass(frozen=True)
class Workload:
    """FLOPs of one sample as a function of its history length L.

        workload(L) = per_example + per_token * L + per_token_pair * L**2

    One model serves MFU accounting (`total` of the real lengths of a step) and
    load balancing (`gem_jax.data.bbs` weighs samples by it). `flop_model` gives the
    forward FLOPs of `GEMModel`; `train_workload` the training FLOPs (3x).

    Attributes:
      per_token: a, FLOPs per history token of the dense (token-wise) layers,
        >= 0.
      per_token_pair: b, FLOPs per L**2 of attention, >= 0 (for causal
        attention half the per-pair cost, since a causal sequence has
        L (L + 1) / 2 pairs; the + L/2 diagonal term is folded into a).
      per_example: FLOPs that do not depend on L (cross-feature tower, heads),
        >= 0. Every per-device batch holds the same number of samples, so this
        term does not change a balanced assignment; it does lower the relative
        imbalance, which is measured against the total.
    """

    per_token: float
    per_token_pair: float
    per_example: float = 0.0

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
        return self.per_example + self.per_token * length + self.per_token_pair * length * length

    def total(self, lengths) -> float:
        """Sum of `self(lengths)`: the FLOPs of a batch whose real histories have `lengths`."""
        return float(self(lengths).sum())

    def scaled(self, factor: float) -> Workload:
        """Every term times `factor` (e.g. `TRAIN_FLOPS_PER_FORWARD` for forward + backward)."""
        return Workload(self.per_token * factor, self.per_token_pair * factor, self.per_example * factor)


def flop_model(config: ModelConfig, spec: FeatureSpec) -> Workload:
    """The per-example / per-token / per-token-pair forward FLOPs of `GEMModel`."""
    d, h, hd = config.embed_dim, config.num_heads, config.head_dim
    m, lq = config.mlp_ratio * d, config.num_pooled_queries
    f0, f = NUM_BASE_TOKENS, NUM_BASE_TOKENS + lq
    width = f * d
    attn = 4 * h * hd  # QK^T and PV per (query, key) pair

    per_token = 0.0
    per_token += 2 * d * d + 2 * d * d + attn * f0  # history_context: q, out, attention to F0 tokens
    per_token += config.num_seq_layers * (2 * d * 3 * d + 2 * d * d + 2 * 2 * d * m)  # self-attn blocks
    per_token += 2 * d * 2 * d + attn * lq  # pooled attention: k/v projection, Lq queries
    per_token += 2 * d * 2 * d + attn * f  # feature_to_history: k/v projection, F queries

    # Causal self-attention over L tokens has L (L + 1) / 2 (query, key) pairs: L**2 / 2 of
    # them in the per-pair term, the L / 2 of the diagonal's half in the per-token term.
    per_pair = config.num_seq_layers * attn / 2
    per_token += config.num_seq_layers * attn / 2

    per_example = 0.0
    per_example += f0 * 2 * d * 2 * d  # history_context k/v of feature tokens
    per_example += 2 * spec.num_genres * d  # genre projection
    per_example += lq * 2 * d * d  # pooled output projection
    per_example += f * 2 * d * d * 2  # feature_to_history q and out
    per_example += f * 2 * d * 3 * d + attn * f * f + f * 2 * d * d  # token attention
    pairs = f * (f - 1) // 2
    dhen = 2 * (width * m + m * width) + 2 * 2 * width * width + 2 * f * f * d + 2 * pairs * width + 2 * 3 * width * width
    per_example += config.num_dhen_layers * dhen
    per_example += len(Task) * 2 * (width * config.head_hidden + config.head_hidden)
    return Workload(per_token=per_token, per_token_pair=per_pair, per_example=per_example)


def train_workload(config: ModelConfig, spec: FeatureSpec) -> Workload:
    """Training FLOPs (forward + backward) of `GEMModel` per example: 3x `flop_model`."""
    return flop_model(config, spec).scaled(TRAIN_FLOPS_PER_FORWARD)


def peak_flops(device: jax.Device | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of `device` (default: the first), or None where unknown (CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for name, peak in PEAK_BF16_FLOPS.items() if name in kind), None)
