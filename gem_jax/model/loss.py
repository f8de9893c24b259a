"""The model's training loss: per-task binary cross-entropy with logits, weighted by example.

Padding examples carry weight 0 and add nothing. The total over tasks is what the train
step minimises; the sharded step sums the weighted totals and weights over all devices
before dividing (`gem_jax.parallel.spmd`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def bce_per_example(logits, labels):
    """Numerically stable BCE with logits, elementwise (nats); numpy or jax arrays."""
    xp = jnp if isinstance(logits, jax.Array) else np
    return xp.maximum(logits, 0) - logits * labels + xp.log1p(xp.exp(-xp.abs(logits)))


def weighted_bce(logits: jax.Array, labels: jax.Array, weights: jax.Array) -> jax.Array:
    """Per-task mean BCE over real examples.

    Args:
      logits, labels: float32 `[B, K]`; labels in {0, 1}.
      weights: float32 `[B]`, 0 for padding examples.

    Returns:
      float32 `[K]` (nats per example).
    """
    return (weights[:, None] * bce_per_example(logits, labels)).sum(0) / jnp.maximum(weights.sum(), 1.0)
