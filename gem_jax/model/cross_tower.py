"""Cross-feature tower: generalized attention over feature tokens, then DHEN layers.

DHEN (Zhang et al., "DHEN: A Deep and Hierarchical Ensemble Network for Large-Scale
Click-Through Rate Prediction", 2022): each layer runs an ensemble of heterogeneous
experts on the same input and combines their outputs. Ours has three expert kinds:
a group of MLP experts (summed), a DCN-v2 cross network (Wang et al., 2021) and a
DLRM-style dot-product compression (Naumov et al., 2019). The MLP experts are stacked
so that expert parallelism (`gem_jax.nn.experts`) can spread them over the GPUs
of a node. Token attention is GEM's GDPA with per-example token sets (short, equal Q
and KV).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype

import pallas_kernels
from gem_jax.model import remat
from gem_jax.model.config import Fp8Region, ModelConfig, attention_implementations
from gem_jax.nn.layers import dense, gelu, norm_dense, rms_norm, tie_key_to_query
from gem_jax.nn.experts import expert_parallel

MLP_EXPERTS = 4  # MLP experts per DHEN layer; expert parallelism needs experts_per_node to divide it


def uniform_offsets(batch: int, tokens: int) -> jax.Array:
    """int32 `[B+1]` offsets of B sequences of `tokens` rows each."""
    return jnp.arange(batch + 1, dtype=jnp.int32) * tokens


class TokenAttention(nnx.Module):
    """GELU attention among each example's F feature tokens `[B, F, d]` (GDPA, self shape)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d = config.embed_dim
        self.config = config
        fp8 = config.fp8_for(Fp8Region.CROSS)
        self.norm = rms_norm(d, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.qkv = dense(d, 3 * d, ("embed", "heads"), rngs=rngs, use_bias=False, fp8=fp8, dtype=config.dtype)
        if config.tied_qk_init:
            tie_key_to_query(self.qkv, self.qkv, width=d, key_column=d)  # columns [q | k | v]
        self.q_norm = rms_norm(config.head_dim, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.k_norm = rms_norm(config.head_dim, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.out = dense(d, d, ("heads", "embed"), rngs=rngs, fp8=fp8, dtype=config.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        b, f, d = tokens.shape
        qkv = norm_dense(self.norm, self.qkv, tokens).reshape(b * f, 3, cfg.num_heads, cfg.head_dim)
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
            implementation=attention_implementations(cfg).gelu,
        )
        return tokens + self.out(remat.name_attention_output(attn).reshape(b, f, d) / math.sqrt(f))


class CrossExpert(nnx.Module):
    """DCN-v2 cross layers: `x_{l+1} = x0 * (W x_l + b) + x_l` on flattened tokens."""

    def __init__(self, width: int, num_layers: int = 2, *, rngs: nnx.Rngs, dtype: jnp.dtype | None = None):
        self.layers = nnx.List([dense(width, width, ("embed", "mlp"), rngs=rngs, dtype=dtype) for _ in range(num_layers)])

    def __call__(self, x0: jax.Array) -> jax.Array:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class DotCompressionExpert(nnx.Module):
    """Pairwise token dot products (upper triangle, F(F-1)/2 values) projected back to F*d."""

    def __init__(self, num_tokens: int, dim: int, *, rngs: nnx.Rngs, dtype: jnp.dtype | None = None):
        self.num_tokens = num_tokens
        pairs = num_tokens * (num_tokens - 1) // 2
        self.proj = dense(pairs, num_tokens * dim, (None, "embed"), rngs=rngs, dtype=dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        gram = jnp.einsum("bfd,bgd->bfg", tokens, tokens) / math.sqrt(tokens.shape[-1])
        rows, cols = np.triu_indices(self.num_tokens, k=1)
        return self.proj(gram[:, rows, cols])


class MLPExperts(nnx.Module):
    """`num_experts` MLP experts `width -> hidden / num_experts -> width`, outputs summed.

    The sum of the experts is the same function class and cost as one MLP of width
    `hidden`; keeping the experts as a stacked `[num_experts, ...]` parameter (logical
    axis `expert`) lets the rules place them on the expert slots of a node.

    Raises:
      ValueError: `hidden` is not a multiple of `num_experts`.
    """

    def __init__(self, num_experts: int, width: int, hidden: int, *, rngs: nnx.Rngs, dtype: jnp.dtype | None = None):
        if hidden % num_experts:
            raise ValueError(f"MLP expert width {hidden} is not a multiple of {num_experts} experts")
        h = hidden // num_experts
        self.num_experts = num_experts
        self.dtype = dtype
        kernel = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        zeros = nnx.initializers.zeros_init()
        self.up_kernel = nnx.Param(nnx.with_partitioning(kernel, ("expert", "embed", "mlp"))(rngs.params(), (num_experts, width, h)))
        self.up_bias = nnx.Param(nnx.with_partitioning(zeros, ("expert", "mlp"))(rngs.params(), (num_experts, h)))
        self.down_kernel = nnx.Param(nnx.with_partitioning(kernel, ("expert", "mlp", "embed"))(rngs.params(), (num_experts, h, width)))
        self.down_bias = nnx.Param(nnx.with_partitioning(zeros, ("expert", "embed"))(rngs.params(), (num_experts, width)))

    def _local_sum(self, x: jax.Array) -> jax.Array:
        """Sum of this device's experts on `x [rows, width]`."""
        x, up, up_bias, down, down_bias = promote_dtype(
            (x, self.up_kernel[...], self.up_bias[...], self.down_kernel[...], self.down_bias[...]), dtype=self.dtype
        )
        hidden = gelu(jnp.einsum("bw,kwh->kbh", x, up) + up_bias[:, None, :])
        return jnp.einsum("kbh,khw->bw", hidden, down) + down_bias.sum(0)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`[b, width] -> [b, width]`: the sum over every expert (across the expert axis when sharded)."""
        return expert_parallel(self._local_sum, x, local_experts=self.up_kernel.shape[0], num_experts=self.num_experts)


class DHENLayer(nnx.Module):
    """One DHEN layer on `[B, F, d]` tokens: experts in parallel, concatenated, mixed, residual."""

    def __init__(self, num_tokens: int, config: ModelConfig, *, rngs: nnx.Rngs, num_mlp_experts: int = MLP_EXPERTS):
        width = num_tokens * config.embed_dim
        self.num_tokens = num_tokens
        self.norm = rms_norm(width, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.mlp_expert = MLPExperts(num_mlp_experts, width, config.mlp_ratio * config.embed_dim, rngs=rngs, dtype=config.dtype)
        self.cross_expert = CrossExpert(width, rngs=rngs, dtype=config.dtype)
        self.dot_expert = DotCompressionExpert(num_tokens, config.embed_dim, rngs=rngs, dtype=config.dtype)
        self.mix = dense(3 * width, width, ("mlp", "embed"), rngs=rngs, fp8=config.fp8_for(Fp8Region.CROSS), dtype=config.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        b, f, d = tokens.shape
        x = self.norm(tokens.reshape(b, f * d))
        experts = [self.mlp_expert(x), self.cross_expert(x), self.dot_expert(x.reshape(b, f, d))]
        return tokens + self.mix(jnp.concatenate(experts, axis=-1)).reshape(b, f, d)


class CrossFeatureTower(nnx.Module):
    """Feature tokens `[B, F, d]` -> `[B, F, d]`: token attention then DHEN layers."""

    def __init__(self, num_tokens: int, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.token_attention = TokenAttention(config, rngs=rngs)
        self.dhen = nnx.List([DHENLayer(num_tokens, config, rngs=rngs) for _ in range(config.num_dhen_layers)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        tokens = remat.region(remat.TOKEN_ATTENTION, self.config.remat, self.token_attention, TokenAttention.__call__, tokens)
        for j, layer in enumerate(self.dhen):
            tokens = remat.region(remat.dhen(j), self.config.remat, layer, DHENLayer.__call__, tokens)
        return tokens
