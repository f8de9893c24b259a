"""Optimizers: AdamW for dense parameters, Adagrad for embedding tables.

Embedding rows are touched sparsely, so they get Adagrad (Duchi et al., 2011), the usual
choice for recommendation embeddings (DLRM, TorchRec); dense weights get AdamW
(Loshchilov & Hutter, 2019) with linear warm-up and cosine decay.

The tables' Adagrad keeps by default one accumulator per table row (`OptimConfig.
embedding_accumulator="row"`, `rowwise_adagrad`): the row's running sum of the mean
squared gradient over its `d` entries, as FBGEMM's `EXACT_ROWWISE_ADAGRAD` (TorchRec's
default table optimizer) does. Every entry of a row is then scaled alike; the state is
one float32 per row instead of one per element (`optax.adagrad`, `"element"`): at
`configs/gem_h200.py` 8 MB instead of 8.2 GB in device memory and in every checkpoint.

AdamW's two moments may be stored in bfloat16 (`OptimConfig.moments_dtype`), halving
them in device memory and in every checkpoint (`configs/gem_h200.py`: 9.6 of the 36.9 GB
a checkpoint with float32 moments writes). The update itself is computed in float32 either way; only
what is kept between steps is rounded:

- the first moment `mu` (an average of signed gradients, decay `b1 = 0.9`: each step
  moves it by ~10%, far above bfloat16's 2^-8 relative spacing) is rounded to nearest,
  as optax's `mu_dtype` does (MaxText and AnyPrecisionAdamW of torchdistx do the same);
- the second moment `nu` decays by `1 - b2 = 0.1%` a step, below half of bfloat16's
  relative spacing (2^-9 = 0.2%): rounded to nearest it would never decay (and grow
  only on gradients twice its size), turning Adam into a running maximum. It is
  stochastically rounded instead (`stochastic_round_bf16`), which keeps the stored
  value unbiased, so the decay happens on average (Gupta et al., 2015, "Deep Learning
  with Limited Numerical Precision"; Zamirai et al., 2020, "Revisiting BFloat16
  Training", which shows the same rounding-away of small updates for bf16 weights).

The dense weights themselves may be kept in bfloat16 (`OptimConfig.weights_dtype`), with no
float32 copy: every weight matrix the step uses in bfloat16 is stored in it, and each update is
computed in float32 from the widened weight and stochastically rounded back
(`round_into_bf16_weights`, the same unbiased rounding). Rounded to nearest, an update
below half a weight's spacing (weight decay's `lr * wd * w` always is) would be lost; rounded
stochastically it lands on average (Zamirai et al., 2020, above: bfloat16 weights with
stochastic rounding train as float32 ones do). The optimizer pass then reads and writes 2
bytes a weight instead of 4, and writes no compute copy: with bfloat16 moments 14 bytes a
weight instead of 20, and 4 bytes a weight less in device memory and in every checkpoint.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gem_jax.checks import check_bool, check_float, check_int
from gem_jax.nn.layers import EMBEDDING_PARAM
from gem_jax.pytree import path_keys


MOMENTS_DTYPES = ("float32", "bfloat16")
WEIGHTS_DTYPES = ("float32", "bfloat16")
EMBEDDING_ACCUMULATORS = ("row", "element")
# optax.adagrad's defaults, kept by both accumulators.
ADAGRAD_INITIAL_ACCUMULATOR = 0.1
ADAGRAD_EPS = 1e-7


class ParamGroup(enum.StrEnum):
    DENSE = "dense"
    EMBEDDING = "embedding"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings.

    Attributes:
      learning_rate: peak AdamW learning rate of dense parameters.
      warmup_steps: linear warm-up steps to the peak.
      decay_steps: cosine decay length after warm-up (to 10% of the peak).
      weight_decay: AdamW decoupled weight decay (dense only).
      embedding_learning_rate: Adagrad learning rate of embedding tables.
      grad_clip_norm: global gradient-norm clip of the dense group (0 disables).
      sparse_embedding_updates: update unsharded tables row by row, only the rows a
        step looks up (`gem_jax.train.sparse_tables`): the same Adagrad update
        without a dense table gradient and a dense optimizer pass over every row.
        False differentiates and updates the whole table (the reference path).
        Sharded tables always take the dense gradient of their shard.
      moments_dtype: storage dtype of the dense group's AdamW moments, "float32" or
        "bfloat16" (module docstring: the first rounded to nearest, the second
        stochastically). Embedding tables' Adagrad accumulators stay float32.
        Changing it changes results, so a restarted run must keep its value
        (`gem_jax.train.run_record`).
      embedding_accumulator: the tables' Adagrad state, "row" (one float32 per table
        row, `rowwise_adagrad`) or "element" (one per table element, `optax.adagrad`).
        Changes results and the state's shapes, so a restarted run must keep it.
      embedding_initial_accumulator: each accumulator's starting value, >= 0: optax's 0.1
        (the default), or FBGEMM's and PyTorch's 0. A row's mean squared gradient under a
        batch-mean loss is tiny, so from 0.1 the first updates are about
        `embedding_learning_rate / sqrt(0.1)` times the gradient (plain SGD), and from 0
        about `embedding_learning_rate` in each coordinate, whatever the gradient's scale
        (`benchmarks/quality.md`).
      keep_compute_params: keep the dense weights' copy in the model's compute dtype in the
        train state (`gem_jax.train.state.TrainState.compute_params`), written by this
        optimizer's pass as it updates them, instead of cast from the float32 weights by every
        step's forward. The same values, up to the float32 rounding of the update; at
        `configs/gem_h200.py` 8.8 GB fewer fusion bytes and 38 fewer kernels a step and
        2.4 GB more peak memory in XLA's H200 compile (`benchmarks/step.md`). No effect on a
        float32 model, and none on checkpoints (the copy is rebuilt on restore). No effect
        either with `weights_dtype="bfloat16"` (the weights are the compute dtype's already).
      weights_dtype: storage dtype of the dense weights the step uses in the model's compute
        dtype, "float32" (master weights; the step casts them or keeps their copy) or
        "bfloat16" (the weights themselves, updated in float32 and stochastically rounded
        back: module docstring). "bfloat16" needs `ModelConfig.compute_dtype="bfloat16"`
        (`TrainConfig` refuses another). Only weight matrices (two or more dimensions besides
        a stacked `expert` one) are kept in it: norm gains and biases (the DHEN experts' too,
        `[experts, out]`) keep their float32 weights and compute copy (a gain near 1 moves by
        less than its bfloat16 spacing each step, so its rounding noise would outweigh its
        updates; their bytes are negligible), and embedding tables stay float32. Changes
        results, the state's dtypes and the checkpoints', so a restarted run must keep its value.
    """

    learning_rate: float = 2e-3
    warmup_steps: int = 50
    decay_steps: int = 1000
    weight_decay: float = 1e-4
    embedding_learning_rate: float = 0.05
    grad_clip_norm: float = 1.0
    sparse_embedding_updates: bool = True
    moments_dtype: str = "float32"
    embedding_accumulator: str = "row"
    embedding_initial_accumulator: float = ADAGRAD_INITIAL_ACCUMULATOR
    keep_compute_params: bool = True
    weights_dtype: str = "float32"

    def __post_init__(self):
        check_float(self, "learning_rate", positive=True)
        check_int(self, "warmup_steps", minimum=0)
        check_int(self, "decay_steps", minimum=1)
        check_float(self, "weight_decay", minimum=0.0)
        check_float(self, "embedding_learning_rate", positive=True)
        check_float(self, "grad_clip_norm", minimum=0.0)
        check_bool(self, "sparse_embedding_updates")
        check_bool(self, "keep_compute_params")
        check_float(self, "embedding_initial_accumulator", minimum=0.0)
        if self.moments_dtype not in MOMENTS_DTYPES:
            raise ValueError(f"OptimConfig.moments_dtype must be one of {MOMENTS_DTYPES}, got {self.moments_dtype!r}")
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"OptimConfig.weights_dtype must be one of {WEIGHTS_DTYPES}, got {self.weights_dtype!r}")
        if self.embedding_accumulator not in EMBEDDING_ACCUMULATORS:
            raise ValueError(
                f"OptimConfig.embedding_accumulator must be one of {EMBEDDING_ACCUMULATORS}, got {self.embedding_accumulator!r}"
            )


def check_weights_dtype(weights_dtype: str, compute_dtype: str) -> None:
    """Refuses `OptimConfig.weights_dtype` other than "float32" or the step's `compute_dtype` (weights kept in a
    narrower dtype than the step computes in).

    Raises:
      ValueError: naming both fields, their values and the two settings that agree.
    """
    if weights_dtype not in ("float32", compute_dtype):
        raise ValueError(
            f"OptimConfig.weights_dtype={weights_dtype!r} needs the step to compute in it, but ModelConfig.compute_dtype is "
            f"{compute_dtype!r}: set model.compute_dtype={weights_dtype} or optim.weights_dtype=float32"
        )


def learning_rate_schedule(config: OptimConfig) -> optax.Schedule:
    """The dense learning rate by step: linear warm-up from 0 to the peak, cosine decay to 10% of it.

    Step `k` (0-based count of updates before it) is the rate the `k+1`-th update uses.
    """
    return optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, config.warmup_steps + config.decay_steps, config.learning_rate * 0.1
    )


def param_group(path: tuple) -> ParamGroup:
    """EMBEDDING for embedding-table parameters (named `EMBEDDING_PARAM`), else DENSE."""
    return ParamGroup.EMBEDDING if EMBEDDING_PARAM in path_keys(path) else ParamGroup.DENSE


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """A `multi_transform` routing each parameter to its group's optimizer."""
    if config.moments_dtype == "float32":
        dense = [optax.adamw(learning_rate_schedule(config), weight_decay=config.weight_decay)]
    else:
        # optax.adamw's own chain, with the moments kept in bfloat16: the same state tree.
        dense = [
            optax.chain(
                bf16_moments(optax.scale_by_adam(mu_dtype=jnp.bfloat16)),
                optax.add_decayed_weights(config.weight_decay),
                optax.scale_by_learning_rate(learning_rate_schedule(config)),
            )
        ]
    if config.grad_clip_norm:
        dense.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
    if config.weights_dtype == "bfloat16":
        dense.append(round_into_bf16_weights())
    if config.embedding_accumulator == "row":
        embedding = rowwise_adagrad(config.embedding_learning_rate, config.embedding_initial_accumulator)
    else:
        embedding = optax.adagrad(config.embedding_learning_rate, config.embedding_initial_accumulator, ADAGRAD_EPS)
    return optax.multi_transform(
        {ParamGroup.DENSE: optax.chain(*dense), ParamGroup.EMBEDDING: embedding},
        lambda params: jax.tree_util.tree_map_with_path(lambda path, _: param_group(path), params),
    )


class ScaleByRowRssState(NamedTuple):
    """`scale_by_row_rss`'s state: per parameter `[*shape[:-1]]` float32, each row's accumulator."""

    sum_of_squares: optax.Updates


def scale_by_row_rss(
    initial_accumulator_value: float = ADAGRAD_INITIAL_ACCUMULATOR, eps: float = ADAGRAD_EPS
) -> optax.GradientTransformation:
    """Row-wise Adagrad scaling: each row's gradient divided by the root of its accumulated mean square.

    For a parameter of shape `[*rows, d]` (an embedding table `[rows, d]`), with `g_r` the
    gradient of row `r`:

        acc_r <- acc_r + mean_j(g_r[j]^2)          (float32, shape `[*rows]`)
        update_r = g_r / sqrt(acc_r + eps)         (0 where acc_r is 0)

    FBGEMM's `EXACT_ROWWISE_ADAGRAD` (TorchRec's default for tables), a row-wise form of
    Adagrad (Duchi et al., 2011). The conventions are `optax.scale_by_rss`'s, so the row
    and element accumulators differ only in what they sum: the accumulator starts at
    `initial_accumulator_value` (optax: 0.1; FBGEMM and PyTorch: 0) and `eps` (optax: 1e-7)
    is added inside the square root (FBGEMM adds its 1e-8 outside). A row with a zero
    gradient keeps its accumulator and gets a zero update, and no row's update depends on
    another row: what `gem_jax.train.sparse_tables` needs to update looked-up rows alone.

    Args:
      initial_accumulator_value: each row's starting accumulator, >= 0.
      eps: added to the accumulator under the square root, >= 0.

    Returns:
      An optax transformation; its state is `ScaleByRowRssState`, float32 `[*shape[:-1]]`
      per parameter; updates keep the gradients' dtype.

    Raises:
      ValueError (at init): a scalar parameter (it has no rows).
    """

    def init(params):
        def accumulator(path, p):
            if not p.shape:
                raise ValueError(f"row-wise Adagrad: parameter {jax.tree_util.keystr(path)} is a scalar, it has no rows")
            return jnp.full(p.shape[:-1], initial_accumulator_value, jnp.float32)

        return ScaleByRowRssState(jax.tree_util.tree_map_with_path(accumulator, params))

    def update(updates, state, params=None):
        del params
        sum_of_squares = jax.tree.map(
            lambda g, t: t + jnp.mean(jnp.square(g.astype(jnp.float32)), axis=-1), updates, state.sum_of_squares
        )
        scaled = jax.tree.map(
            lambda g, t: (g * jnp.where(t > 0, jax.lax.rsqrt(t + eps), 0.0)[..., None]).astype(g.dtype), updates, sum_of_squares
        )
        return scaled, ScaleByRowRssState(sum_of_squares)

    return optax.GradientTransformation(init, update)


def rowwise_adagrad(
    learning_rate: optax.ScalarOrSchedule, initial_accumulator_value: float = ADAGRAD_INITIAL_ACCUMULATOR
) -> optax.GradientTransformation:
    """Row-wise Adagrad (`scale_by_row_rss`, optax's eps) then the learning rate.

    The chain of `optax.adagrad` with the row-wise scaling in place of `scale_by_rss`:
    `row_r <- row_r - learning_rate * g_r / sqrt(acc_r + eps)`, `acc_r` starting at
    `initial_accumulator_value` (optax's 0.1 by default).
    """
    return optax.chain(scale_by_row_rss(initial_accumulator_value), optax.scale_by_learning_rate(learning_rate))


def stochastic_round_bf16(x: jax.Array, salt: jax.Array) -> jax.Array:
    """`x` (float32, any shape) rounded to bfloat16 up or down at random, unbiased: `E[result] = x`.

    bfloat16 is float32's upper 16 bits; adding a uniform 16-bit integer to the lower
    16 bits and truncating rounds up with probability (dropped bits) / 2^16. The
    random bits are a hash of each element's flat index and `salt` (uint32 scalar:
    the step and the leaf), so they need no PRNG key, fuse into the update and are
    the same on any sharding. Non-finite values pass through unchanged.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    index = jax.lax.broadcasted_iota(jnp.uint32, x.shape, 0) if x.ndim else jnp.zeros((), jnp.uint32)
    for axis in range(1, x.ndim):
        index = index * np.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    noise = _hash32(index ^ (salt * np.uint32(0x9E3779B9))) >> np.uint32(16)
    rounded = jax.lax.bitcast_convert_type((bits + noise) & np.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def _hash32(x: jax.Array) -> jax.Array:
    """A 32-bit integer mix (the "lowbias32" constants of Wellons' hash-prospector): uint32 -> uint32."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _step_salt(count: jax.Array) -> jax.Array:
    """uint32 scalar: the salt of a transformation's random bits at int `count` (its updates so far); a leaf adds
    its index in `jax.tree.leaves` order (`stochastic_round_bf16`'s `salt`)."""
    return count.astype(jnp.uint32) * np.uint32(0x01000193)


# Set in `round_into_bf16_weights`' salts, apart from `bf16_moments`' (which salt with the same step count).
_WEIGHTS_SALT = np.uint32(0x5BD1E995)


class RoundIntoWeightsState(NamedTuple):
    """`round_into_bf16_weights`' state: int32 scalar, the updates it has rounded (salts its random bits)."""

    count: jax.Array


def round_into_bf16_weights() -> optax.GradientTransformation:
    """The last transformation of a chain whose bfloat16 weights take its updates: unbiased bfloat16 weights.

    For each bfloat16 weight `w` (other leaves pass unchanged) the float32 update `u` becomes
    `stochastic_round_bf16(w + u) - w` (float32), so `optax.apply_updates` (which adds in float32
    and casts back to the weight's dtype) lands `w` on `w + u` rounded up or down at random,
    `E[new w] = w + u`, instead of on the nearest bfloat16, which loses every update below half
    the weight's spacing (Zamirai et al., 2020, "Revisiting BFloat16 Training"). The difference
    of two bfloat16 values is a float32 whose sum with `w` rounds to the rounded value exactly.
    Random bits: `stochastic_round_bf16`'s hash, salted with this transformation's count and the
    leaf's index. Non-finite sums pass through (a NaN update stays NaN).

    Returns:
      An optax transformation needing `params`; updates come out float32 for bfloat16 weights.

    Raises:
      ValueError (at update): called without `params`.
    """

    def init(params):
        del params
        return RoundIntoWeightsState(jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("round_into_bf16_weights needs the weights: call update(updates, state, params)")
        salt = _step_salt(state.count) ^ _WEIGHTS_SALT
        leaves, treedef = jax.tree.flatten(updates)
        weights = treedef.flatten_up_to(params)
        rounded = []
        for k, (u, w) in enumerate(zip(leaves, weights, strict=True)):
            if w.dtype != jnp.bfloat16:
                rounded.append(u)
                continue
            wide = w.astype(jnp.float32)
            rounded.append(stochastic_round_bf16(wide + u.astype(jnp.float32), salt + np.uint32(k)).astype(jnp.float32) - wide)
        return jax.tree.unflatten(treedef, rounded), RoundIntoWeightsState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def bf16_moments(adam: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optax.scale_by_adam(mu_dtype=bfloat16)` whose second moment `nu` is also kept in bfloat16.

    The state is created with `nu` in bfloat16; both moments are widened to float32
    before optax's update, which rounds the new `mu` to bfloat16 (nearest) and leaves
    the new `nu` in float32 for this wrapper's stochastic rounding (`stochastic_round_bf16`,
    salted with the step count and the leaf's index). The state's structure is optax's
    `ScaleByAdamState`, so checkpoints and shardings see the usual tree.
    """

    def init(params):
        state = adam.init(params)
        return state._replace(nu=jax.tree.map(lambda v: v.astype(jnp.bfloat16), state.nu))

    def update(updates, state, params=None):
        widen = lambda tree: jax.tree.map(lambda v: v.astype(jnp.float32), tree)  # noqa: E731
        wide = state._replace(mu=widen(state.mu), nu=widen(state.nu))
        updates, new = adam.update(updates, wide, params)
        salt = _step_salt(new.count)
        leaves, treedef = jax.tree.flatten(new.nu)
        nu = [stochastic_round_bf16(v, salt + np.uint32(k)) for k, v in enumerate(leaves)]
        return updates, new._replace(nu=jax.tree.unflatten(treedef, nu))

    return optax.GradientTransformation(init, update)
