"""The per-sample workload model and the balance metrics a training step logs.

A sample's training cost depends on its behaviour-history length L through the
dense layers (linear in L) and through self-attention (quadratic in L). Load
balancing (`gem_jax.data.bbs`) and the per-step metrics use the same model:

    workload(L) = per_example + per_token * L + per_token_pair * L**2     [FLOPs]

with `per_token` (called a) the FLOPs of the dense layers for one token and
`per_token_pair` (called b) the attention FLOPs per unit of L**2 (the cost of
one (query, key) pair for full attention, half of it for causal attention),
both for forward plus backward. Attention-aware workloads of this form are what public
sequence balancers use (verl `calculate_workload`, NVIDIA recsys-examples'
HSTU balancer); GEM's base batch shuffling sorts samples by such a workload
(GEM engineering description, Meta 2025).

The three terms are those of `gem_jax.train.flops.FlopModel`, which counts the
forward pass only: `Workload.from_flop_model` takes 3x each term, the training
workload of that model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Training FLOPs of a matmul are 3x its forward FLOPs: the backward pass computes
# the gradients with respect to both operands, one forward-sized matmul each.
FWD_BWD_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class Workload:
    """FLOPs (forward + backward) of one sample as a function of its length L.

        workload(L) = per_example + per_token * L + per_token_pair * L**2

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

    @classmethod
    def from_flop_model(cls, flop_model) -> Workload:
        """The training workload of a model from its forward FLOP counter.

        Args:
          flop_model: forward FLOPs per example with attributes `per_example`,
            `per_token` and `per_token_pair` (`gem_jax.train.flops.FlopModel`,
            which counts the GEM model's matmuls, causal attention over the
            lower triangle).

        Returns:
          `FWD_BWD_FACTOR` (3) times each term: forward plus backward.

        Raises:
          ValueError: a term is negative or not finite.
        """
        return cls(
            per_token=FWD_BWD_FACTOR * flop_model.per_token,
            per_token_pair=FWD_BWD_FACTOR * flop_model.per_token_pair,
            per_example=FWD_BWD_FACTOR * flop_model.per_example,
        )

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


def shard_loads(workloads, num_shards: int) -> np.ndarray:
    """Total workload of each device's chunk of a global batch.

    Data parallelism gives device d the contiguous examples
    `d * B / D ... (d + 1) * B / D - 1` of a batch of B (`gem_jax.parallel.batch`).

    Args:
      workloads: float array-like `[B]`, each example's workload (0 for the
        padding examples that do no real work).
      num_shards: D, a positive int dividing B.

    Returns:
      float64 `[D]`, the sum of each chunk.

    Raises:
      ValueError: `workloads` is not 1-D, or D is not positive or does not divide B.
    """
    w = np.asarray(workloads, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"shard_loads: workloads must be 1-D, got shape {w.shape}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1 or w.size % num_shards:
        raise ValueError(f"shard_loads: num_shards must be a positive int dividing the batch of {w.size}, got {num_shards!r}")
    return w.reshape(num_shards, -1).sum(axis=1)


def load_imbalance(rank_loads) -> float:
    """The slowest rank's excess over the mean: max(load) / mean(load) - 1.

    With synchronous data parallelism every rank waits for the slowest one, so
    this is the fraction of the step lost to imbalance relative to a perfectly
    balanced step (GEM engineering description's BBS metric; 0 is perfect).

    Args:
      rank_loads: float array-like `[R]`, R >= 1, each >= 0 (e.g. from
        `shard_loads`).

    Returns:
      The imbalance, >= 0; 0.0 when every rank has zero load.

    Raises:
      ValueError: if `rank_loads` is empty, not 1-D, or has a negative or
        non-finite entry.
    """
    loads = np.asarray(rank_loads, dtype=np.float64)
    if loads.ndim != 1 or loads.size == 0:
        raise ValueError(f"load_imbalance: rank_loads must be a non-empty 1-D array, got shape {loads.shape}")
    if not np.all(np.isfinite(loads)) or np.any(loads < 0):
        raise ValueError(f"load_imbalance: rank_loads must be finite and >= 0, got {loads}")
    mean = loads.mean()
    if mean == 0:
        return 0.0
    return float(loads.max() / mean - 1.0)


def padding_waste(lengths, capacity: int) -> float:
    """Fraction of a batch's token slots that hold no real token.

    1 - sum(lengths) / capacity, where capacity is `B * max_len` for a padded
    dense batch, or the static token capacity `T_cap` of a jagged batch.

    Args:
      lengths: int array-like `[B]`, the real samples' history lengths.
      capacity: token slots of the batch, > 0.

    Returns:
      The waste in [0, 1].

    Raises:
      ValueError: if capacity is not positive, a length is negative, or the
        lengths exceed the capacity.
    """
    if capacity <= 0:
        raise ValueError(f"padding_waste: capacity must be > 0, got {capacity}")
    tokens = np.asarray(lengths, dtype=np.int64)
    if np.any(tokens < 0):
        raise ValueError(f"padding_waste: lengths must be >= 0, got {tokens[tokens < 0][:4]}")
    total = int(tokens.sum())
    if total > capacity:
        raise ValueError(f"padding_waste: {total} real tokens exceed the capacity of {capacity}")
    return 1.0 - total / capacity
