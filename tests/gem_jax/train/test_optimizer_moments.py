"""bfloat16 AdamW moments: stochastic rounding of the second moment, the update against float32 moments, the state's dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.train.optimizer import OptimConfig, make_optimizer, stochastic_round_bf16


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = jnp.full((200_000,), 1.0 + 2.0**-10, jnp.float32)  # a quarter of the way from 1 to the next bfloat16
    rounded = np.asarray(stochastic_round_bf16(x, jnp.uint32(7)), np.float32)
    assert set(np.unique(rounded)) == {1.0, 1.0 + 2.0**-7}
    assert abs(rounded.mean() - float(x[0])) < 2e-5
    assert abs((rounded > 1).mean() - 0.125) < 0.005  # 2^-10 of a 2^-7 spacing
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, 3.0], jnp.float32)
    out = np.asarray(stochastic_round_bf16(special, jnp.uint32(1)), np.float32)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and out[3] == 0 and out[4] == 3


def test_a_slow_decay_survives_stochastic_rounding_but_not_rounding_to_nearest():
    """Adam's second moment decays by 1 - b2 = 0.1% a step, below half of bfloat16's relative spacing."""
    nearest = stochastic = jnp.ones((50_000,), jnp.bfloat16)
    for t in range(500):
        nearest = (nearest.astype(jnp.float32) * 0.999).astype(jnp.bfloat16)
        stochastic = stochastic_round_bf16(stochastic.astype(jnp.float32) * 0.999, jnp.uint32(t))
    assert float(nearest[0]) == 1.0  # never decays
    assert float(stochastic.astype(jnp.float32).mean()) == pytest.approx(0.999**500, rel=2e-3)


def test_bf16_moments_follow_float32_moments_and_keep_the_state_tree():
    params = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)}, "embed": {"item": {"embedding": jnp.ones((4, 8))}}}
    trees = {}
    for dtype in ("float32", "bfloat16"):
        opt = make_optimizer(OptimConfig(moments_dtype=dtype, warmup_steps=0, learning_rate=1e-2, embedding_learning_rate=0.1))
        state, p = opt.init(params), params
        update = jax.jit(opt.update)
        for step in range(30):
            grads = jax.tree.map(lambda x: jnp.sin(x * (step + 1)) + 0.1 * x, p)  # noisy, parameter-dependent
            updates, state = update(grads, state, p)
            p = jax.tree.map(lambda a, b: a + b, p, updates)
        trees[dtype] = (p, state)
    (p32, s32), (p16, s16) = trees["float32"], trees["bfloat16"]
    assert jax.tree.structure(s32) == jax.tree.structure(s16)
    dtypes = {str(a.dtype) + ">" + str(b.dtype) for a, b in zip(jax.tree.leaves(s32), jax.tree.leaves(s16)) if a.ndim}
    assert dtypes == {"float32>bfloat16", "float32>float32"}  # AdamW moments halve; Adagrad accumulators stay
    moved = np.abs(np.asarray(p32["dense"]["kernel"]) - np.asarray(params["dense"]["kernel"])).mean()
    gap = np.abs(np.asarray(p32["dense"]["kernel"]) - np.asarray(p16["dense"]["kernel"])).mean()
    assert moved > 0.05 and gap < 0.02 * moved, (moved, gap)
    np.testing.assert_array_equal(p32["embed"]["item"]["embedding"], p16["embed"]["item"]["embedding"])


def test_moments_dtype_is_validated():
    with pytest.raises(ValueError, match=r"OptimConfig.moments_dtype must be one of \('float32', 'bfloat16'\), got 'float16'"):
        OptimConfig(moments_dtype="float16")
