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

from gem_jax.data.batch import FeatureSpec, Task
from gem_jax.model.config import ModelConfig
from gem_jax.model.gem import NUM_BASE_TOKENS

TRAIN_FLOPS_PER_FORWARD = 3.0

# Dense bf16 peak FLOP/s per device kind (datasheet, without sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


@dataclasses.dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs of one example with history length L: `per_example + per_token*L + per_token_pair*L^2`."""

    per_example: float
    per_token: float
    per_token_pair: float

    def forward(self, lengths) -> float:
        """Forward FLOPs of a batch whose histories have `lengths` ([B], real examples only)."""
        lengths = np.asarray(lengths, np.float64)
        return float((self.per_example + self.per_token * lengths + self.per_token_pair * lengths**2).sum())

    def train(self, lengths) -> float:
        """Forward + backward FLOPs of a training step on `lengths`."""
        return TRAIN_FLOPS_PER_FORWARD * self.forward(lengths)


def flop_model(config: ModelConfig, spec: FeatureSpec) -> FlopModel:
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

    per_pair = config.num_seq_layers * attn / 2  # causal: lower triangle

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
    return FlopModel(per_example, per_token, per_pair)


def peak_flops(device: jax.Device | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of `device` (default: the first), or None where unknown (CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for name, peak in PEAK_BF16_FLOPS.items() if name in kind), None)
