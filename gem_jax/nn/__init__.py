"""Building blocks the model calls, sharded or not: dense layers, embedding tables and their sharded lookup, expert parallelism."""

from gem_jax.nn.embeddings import Generation, OutOfRange, TableSharding
from gem_jax.nn.layers import MLP, EmbeddingTable, apply_rope, dense, rms_norm

__all__ = ["MLP", "EmbeddingTable", "Generation", "OutOfRange", "TableSharding", "apply_rope", "dense", "rms_norm"]
