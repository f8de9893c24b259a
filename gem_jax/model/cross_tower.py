"""Cross-feature tower: generalized attention over feature tokens, then DHEN layers.

DHEN (Zhang et al., "DHEN: A Deep and Hierarchical Ensemble Network for Large-Scale
Click-Through Rate Prediction", 2022): each layer runs an ensemble of heterogeneous
experts on the same input and combines their outputs. Ours has three expert kinds:
an MLP, a DCN-v2 cross network (Wang et al., 2021) and a DLRM-style dot-product
compression (Naumov et al., 2019). Token attention is GEM's GDPA with per-example
token sets (short, equal Q and KV).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from gem_jax.model.config import ModelConfig
from gem_jax.model.layers import MLP, dense, rms_norm


def uniform_offsets(batch: int, tokens: int) -> jax.Array:
    """int32 `[B+1]` offsets of B sequences of `tokens` rows each."""
    return jnp.arange(batch + 1, dtype=jnp.int32) * tokens


class TokenAttention(nnx.Module):
    """GELU attention among each example's F feature tokens `[B, F, d]` (GDPA, self shape)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d = config.embed_dim
        self.config = config
        self.norm = rms_norm(d, rngs=rngs)
        self.qkv = dense(d, 3 * d, ("embed", "heads"), rngs=rngs, use_bias=False)
        self.q_norm = rms_norm(config.head_dim, rngs=rngs)
        self.k_norm = rms_norm(config.head_dim, rngs=rngs)
        self.out = dense(d, d, ("heads", "embed"), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        b, f, d = tokens.shape
        qkv = self.qkv(self.norm(tokens)).reshape(b * f, 3, cfg.num_heads, cfg.head_dim)
        offsets = uniform_offsets(b, f)
        attn = pallas_kernels.gdpa(
            self.q_norm(qkv[:, 0]),
            self.k_norm(qkv[:, 1]),
            qkv[:, 2],
            offsets,
            offsets,
            max_seq_len_q=f,
            max_seq_len_kv=f,
            activation="gelu",
            implementation=cfg.attention_implementation,
        )
        return tokens + self.out(attn.reshape(b, f, d) / np.sqrt(f))


class CrossExpert(nnx.Module):
    """DCN-v2 cross layers: `x_{l+1} = x0 * (W x_l + b) + x_l` on flattened tokens."""

    def __init__(self, width: int, num_layers: int = 2, *, rngs: nnx.Rngs):
        self.layers = nnx.List([dense(width, width, ("embed", "mlp"), rngs=rngs) for _ in range(num_layers)])

    def __call__(self, x0: jax.Array) -> jax.Array:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class DotCompressionExpert(nnx.Module):
    """Pairwise token dot products (upper triangle, F(F-1)/2 values) projected back to F*d."""

    def __init__(self, num_tokens: int, dim: int, *, rngs: nnx.Rngs):
        self.num_tokens = num_tokens
        pairs = num_tokens * (num_tokens - 1) // 2
        self.proj = dense(pairs, num_tokens * dim, (None, "embed"), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        gram = jnp.einsum("bfd,bgd->bfg", tokens, tokens) / np.sqrt(tokens.shape[-1])
        rows, cols = np.triu_indices(self.num_tokens, k=1)
        return self.proj(gram[:, rows, cols])


class DHENLayer(nnx.Module):
    """One DHEN layer on `[B, F, d]` tokens: experts in parallel, concatenated, mixed, residual."""

    def __init__(self, num_tokens: int, config: ModelConfig, *, rngs: nnx.Rngs):
        width = num_tokens * config.embed_dim
        self.num_tokens = num_tokens
        self.norm = rms_norm(width, rngs=rngs)
        self.mlp_expert = MLP(width, config.mlp_ratio * config.embed_dim, width, rngs=rngs)
        self.cross_expert = CrossExpert(width, rngs=rngs)
        self.dot_expert = DotCompressionExpert(num_tokens, config.embed_dim, rngs=rngs)
        self.mix = dense(3 * width, width, ("mlp", "embed"), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        b, f, d = tokens.shape
        x = self.norm(tokens.reshape(b, f * d))
        experts = [self.mlp_expert(x), self.cross_expert(x), self.dot_expert(x.reshape(b, f, d))]
        return tokens + self.mix(jnp.concatenate(experts, axis=-1)).reshape(b, f, d)


class CrossFeatureTower(nnx.Module):
    """Feature tokens `[B, F, d]` -> `[B, F, d]`: token attention then DHEN layers."""

    def __init__(self, num_tokens: int, config: ModelConfig, *, rngs: nnx.Rngs):
        self.token_attention = TokenAttention(config, rngs=rngs)
        self.dhen = nnx.List([DHENLayer(num_tokens, config, rngs=rngs) for _ in range(config.num_dhen_layers)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        tokens = self.token_attention(tokens)
        for layer in self.dhen:
            tokens = layer(tokens)
        return tokens
