"""Sequence tower: self-attention over jagged behaviour histories, then pooled attention.

Self-attention blocks use QK-norm (Dehghani et al., 2023; Henry et al., 2020) and RoPE
over event positions, through `pallas_kernels.jagged_flash_attention` (GEM's JFA; full
or sliding window), `pallas_kernels.block_local_attention` (RoPE fused) or causal SiLU
`pallas_kernels.gdpa` (HSTU), as `ModelConfig.sequence_attention` chooses.
Pooled attention is GEM's GDPA with broadcast learned queries: a few queries attend
over the whole history with a GELU instead of a softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from gem_jax.jagged import Jagged
from gem_jax.model import remat
from gem_jax.model.config import Fp8Region, ModelConfig, SequenceAttention, attention_implementations
from gem_jax.nn.layers import MLP, RopeTable, dense, norm_dense, norm_dense_parts, rms_norm, rope_table, tie_key_to_query


class SelfAttentionBlock(nnx.Module):
    """Pre-norm causal self-attention + MLP over jagged tokens `[T, d]`.

    `SequenceTower` calls the two halves, `attend` and `feed_forward`, as two
    rematerialization regions (`gem_jax.model.remat`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, hd = config.embed_dim, config.head_dim
        self.config = config
        fp8 = config.fp8_for(Fp8Region.SEQ_ATTENTION)
        self.norm_attn = rms_norm(d, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.qkv = dense(d, 3 * d, ("embed", "heads"), rngs=rngs, use_bias=False, fp8=fp8, dtype=config.dtype)
        if config.tied_qk_init:
            tie_key_to_query(self.qkv, self.qkv, width=d, key_column=d)  # columns [q | k | v]
        # float32 outputs: RoPE follows in float32, and rounds once to the compute dtype.
        self.q_norm = rms_norm(hd, rngs=rngs, dtype=jnp.float32, implementation=config.norm_implementation)
        self.k_norm = rms_norm(hd, rngs=rngs, dtype=jnp.float32, implementation=config.norm_implementation)
        self.out = dense(d, d, ("heads", "embed"), rngs=rngs, fp8=fp8, dtype=config.dtype)
        self.norm_mlp = rms_norm(d, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.mlp = MLP(
            d, config.mlp_ratio * d, rngs=rngs, fp8=config.fp8_for(Fp8Region.SEQ_MLP), dtype=config.dtype,
            fp8_saved_activations=config.fp8_saved_activations, gelu_backward=config.mlp_implementation,
        )

    def __call__(self, x: jax.Array, history: Jagged, rope: RopeTable) -> jax.Array:
        """x `[T_cap, d]` -> `[T_cap, d]`; attention stays inside each sequence; `rope` of the history's positions."""
        return self.feed_forward(self.attend(x, history, rope))

    def attend(self, x: jax.Array, history: Jagged, rope: RopeTable) -> jax.Array:
        """The attention half: `x + out(attention(qkv(norm(x))))`, `[T_cap, d]` -> `[T_cap, d]`."""
        cfg = self.config
        t = x.shape[0]
        # x comes back from the norm: the residual add below takes it, and its gradient joins the norm's backward pass
        qkv, x = norm_dense(self.norm_attn, self.qkv, x, fp8_saved_input=cfg.fp8_saved_activations, residual=True)
        qkv = qkv.reshape(t, 3, cfg.num_heads, cfg.head_dim)
        kind = cfg.sequence_attention
        chosen = attention_implementations(cfg)
        if kind is SequenceAttention.BLOCK_LOCAL:  # RoPE inside the kernel, at each row's position in its sequence
            q, k, v = self.q_norm(qkv[:, 0]), self.k_norm(qkv[:, 1]), qkv[:, 2]
            attn = pallas_kernels.block_local_attention(
                q.astype(cfg.dtype), k.astype(cfg.dtype), v, history.offsets, block_size=cfg.attention_block_size,
                rope_base=cfg.rope_base, max_seq_len=history.max_seq_len, implementation=chosen.block_local,
            )
        else:
            if self.q_norm.epsilon != self.k_norm.epsilon:  # the op takes one eps for both norms
                raise ValueError(f"QK-norm: q_norm and k_norm must share epsilon, got {self.q_norm.epsilon} and {self.k_norm.epsilon}")
            q, k, v = pallas_kernels.qk_norm_rope(
                qkv, self.q_norm.scale[...], self.k_norm.scale[...], rope.cos, rope.sin, eps=self.q_norm.epsilon,
                dtype=cfg.dtype, implementation=chosen.qk_norm_rope,
            )
            if kind is SequenceAttention.CAUSAL_SILU:
                attn = pallas_kernels.gdpa(
                    q, k, v, history.offsets, history.offsets, max_seq_len_q=history.max_seq_len,
                    max_seq_len_kv=history.max_seq_len, activation="silu", causal=True, scale=cfg.head_dim**-0.5,
                    output_scale=1.0 / max(history.max_seq_len, 1), implementation=chosen.gelu,
                )
            else:
                window = (cfg.attention_window, 0) if kind is SequenceAttention.SLIDING_WINDOW else None
                attn = pallas_kernels.jagged_flash_attention(
                    q, k, v, history.offsets, max_seq_len=history.max_seq_len, causal=True, window=window,
                    implementation=chosen.softmax,
                )
        return x + self.out(remat.name_attention_output(attn).reshape(t, attn.shape[1] * attn.shape[2]))  # sizes named: T may be 0

    def feed_forward(self, x: jax.Array) -> jax.Array:
        """The MLP half: `x + mlp(norm(x))`, `[T_cap, d]` -> `[T_cap, d]`."""
        return self.mlp.residual(x, self.norm_mlp)


class PooledAttention(nnx.Module):
    """Lq learned queries attend over each history with GELU attention (GDPA, broadcast Q).

    Returns `[B, Lq, d]`: zero before the output projection's bias for an
    empty history.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d = config.embed_dim
        self.config = config
        self.queries = nnx.Param(
            nnx.with_partitioning(nnx.initializers.normal(1.0), (None, "heads", None))(
                rngs.params(), (config.num_pooled_queries, config.num_heads, config.head_dim)
            )
        )
        self.norm = rms_norm(d, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        fp8 = config.fp8_for(Fp8Region.POOLED)
        self.kv = dense(d, 2 * d, ("embed", "heads"), rngs=rngs, use_bias=False, fp8=fp8, dtype=config.dtype)
        self.k_norm = rms_norm(config.head_dim, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.out = dense(d, d, ("heads", "embed"), rngs=rngs, dtype=config.dtype)

    def __call__(self, x: jax.Array, history: Jagged) -> jax.Array:
        cfg = self.config
        t = x.shape[0]
        keys, values = (
            part.reshape(t, cfg.num_heads, cfg.head_dim)
            for part in norm_dense_parts(self.norm, self.kv, x, 2, fp8_saved_input=cfg.fp8_saved_activations)
        )
        q = self.queries[...].astype(x.dtype)
        pooled = pallas_kernels.gdpa(
            q,
            self.k_norm(keys),
            values,
            None,
            history.offsets,
            max_seq_len_q=cfg.num_pooled_queries,
            max_seq_len_kv=history.max_seq_len,
            activation="gelu",
            broadcast_q=True,
            implementation=attention_implementations(cfg).gelu,
        )
        pooled = remat.name_attention_output(pooled)
        # GDPA sums over keys without normalising; divide by sqrt(length) to keep scale bounded.
        lengths = jnp.maximum(history.lengths(), 1).astype(x.dtype)
        pooled = pooled.reshape(history.batch_size, cfg.num_pooled_queries, -1) / jnp.sqrt(lengths)[:, None, None]
        return self.out(pooled)


class SequenceTower(nnx.Module):
    """Event embeddings `[T_cap, d]` -> (contextual tokens `[T_cap, d]`, pooled `[B, Lq, d]`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.blocks = nnx.List([SelfAttentionBlock(config, rngs=rngs) for _ in range(config.num_seq_layers)])
        self.final_norm = rms_norm(config.embed_dim, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.pool = PooledAttention(config, rngs=rngs)

    def __call__(self, x: jax.Array, history: Jagged) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        rope = rope_table(history.positions(), cfg.head_dim, cfg.rope_base)
        for i, block in enumerate(self.blocks):
            x = remat.region(remat.seq_attention(i), cfg.remat, block, lambda block, x: block.attend(x, history, rope), x)
            x = remat.region(remat.seq_mlp(i), cfg.remat, block, SelfAttentionBlock.feed_forward, x)
        x = self.final_norm(x)
        return x, remat.region(remat.POOLED_ATTENTION, cfg.remat, self.pool, lambda pool, x: pool(x, history), x)
