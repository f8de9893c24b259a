"""InterFormer-style interaction between the towers through GDPA cross attention.

InterFormer (Zeng et al., "InterFormer: Towards Effective Heterogeneous Interaction
Learning for Click-Through Rate Prediction", 2024) exchanges information both ways
between the sequence and the non-sequence features. Both directions are GEM's GDPA
cross shapes: history tokens attending to the example's few feature tokens (long Q,
short KV) and feature tokens attending to the history (short Q, long KV).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from gem_jax.jagged import segment_ids
from gem_jax.model import remat
from gem_jax.model.config import Fp8Region, ModelConfig, attention_implementations
from gem_jax.nn.layers import dense, norm_dense, norm_dense_parts, rms_norm, tie_key_to_query


class CrossAttention(nnx.Module):
    """Jagged queries attend to jagged context with GELU attention (GDPA), residual added.

    The sum over keys is divided by sqrt(context length) to keep its scale bounded;
    an empty context adds only the output bias. GDPA's output is linear in the values, so
    the division is applied to whichever of the values and the attention output has fewer
    rows, each row by its own sequence's factor: the feature tokens' attention to the history
    scales its `[B * F]` output rows rather than the history's values (at `configs/gem_h200.py`
    14,336 rows against 166,656, a pass and its gradient's each), the history's attention to
    the feature tokens the values. The two orders round differently in bf16, nothing more.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d = config.embed_dim
        self.config = config
        fp8 = config.fp8_for(Fp8Region.INTERACTION)
        self.q_in = rms_norm(d, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.kv_in = rms_norm(d, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.q = dense(d, d, ("embed", "heads"), rngs=rngs, use_bias=False, fp8=fp8, dtype=config.dtype)
        self.kv = dense(d, 2 * d, ("embed", "heads"), rngs=rngs, use_bias=False, fp8=fp8, dtype=config.dtype)
        self.q_norm = rms_norm(config.head_dim, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.k_norm = rms_norm(config.head_dim, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.out = dense(d, d, ("heads", "embed"), rngs=rngs, fp8=fp8, dtype=config.dtype)
        if config.tied_qk_init:
            tie_key_to_query(self.q, self.kv, width=d, key_column=0)  # kv's first d columns are the keys

    def __call__(self, x, x_offsets, max_len_x: int, context, context_offsets, max_len_context: int) -> jax.Array:
        """x `[Tq, d]` with offsets `[B+1]`; context `[Tkv, d]` with offsets `[B+1]` -> `[Tq, d]`."""
        cfg = self.config
        h, hd = cfg.num_heads, cfg.head_dim
        q = self.q_norm(norm_dense(self.q_in, self.q, x).reshape(x.shape[0], h, hd))
        keys, values = (part.reshape(context.shape[0], h, hd) for part in norm_dense_parts(self.kv_in, self.kv, context, 2))
        context_len = jnp.maximum(context_offsets[1:] - context_offsets[:-1], 1).astype(jnp.float32)
        seq_scale = jnp.append(jax.lax.rsqrt(context_len), 0.0).astype(values.dtype)  # 0 for slack rows
        scale_values = context.shape[0] <= x.shape[0]
        if scale_values:
            values = values * seq_scale[segment_ids(context_offsets, context.shape[0])][:, None, None]
        attn = pallas_kernels.gdpa(
            q,
            self.k_norm(keys),
            values,
            x_offsets,
            context_offsets,
            max_seq_len_q=max_len_x,
            max_seq_len_kv=max_len_context,
            activation="gelu",
            implementation=attention_implementations(cfg).gelu,
        )
        if not scale_values:
            attn = attn * seq_scale[segment_ids(x_offsets, x.shape[0])][:, None, None]
        return x + self.out(remat.name_attention_output(attn).reshape(x.shape[0], attn.shape[1] * attn.shape[2]))  # sizes named: T may be 0
