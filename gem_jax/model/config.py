"""Model hyper-parameters: one frozen dataclass, taken by the model alone."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gem_jax.quant.dense import Fp8Recipe
from pallas_kernels import Implementation


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
      attention_implementation: "xla", "pallas" or None (pallas on Hopper GPUs).
      compute_dtype: activations' dtype ("float32" on CPU, "bfloat16" on GPU).
      fp8: run the towers' dense layers through FP8 matmuls (`gem_jax.quant.Fp8Linear`);
        the feature projections and the task heads stay in higher precision.
      fp8_block: 32 for MXFP8 (32x32 blocks) or 128 (1x128 / 128x128 promotion).
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
    compute_dtype: str = "float32"
    fp8: bool = False
    fp8_block: int = 32

    def __post_init__(self):
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not a multiple of num_heads {self.num_heads}")
        if (self.embed_dim // self.num_heads) % 2:
            raise ValueError(f"head_dim {self.embed_dim // self.num_heads} must be even for RoPE")

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
        return Fp8Recipe(block=self.fp8_block) if self.fp8 else None
