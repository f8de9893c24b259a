"""Residual bytes (as JAX names them, and as XLA materializes them) and matmul FLOPs, against hand counts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from gem_jax.train.residuals import dot_flops, residual_bytes

ROWS, WIDTH, HIDDEN = 4, 8, 32
F32 = 4


def block(params, x):
    """RMSNorm -> bf16 round trip -> Linear -> GELU (tanh) -> Linear, residual: an MLP half of a layer."""
    up, down = params
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    h = normed.astype(jnp.bfloat16).astype(jnp.float32) @ up
    return x + jax.nn.gelu(h) @ down


PARAMS = (jnp.ones((WIDTH, HIDDEN)), jnp.ones((HIDDEN, WIDTH)))
X = jnp.ones((ROWS, WIDTH))


def test_without_fusion_every_residual_jax_names_is_counted():
    # x, the two [R, 1] RMS statistics, the normalized input of the first matmul, the
    # pre-activation and three GELU derivative intermediates [R, H], the GELU output [R, H].
    expected = F32 * (ROWS * WIDTH + 2 * ROWS + ROWS * WIDTH + 5 * ROWS * HIDDEN)
    assert residual_bytes(block, PARAMS, X, fusion=False) == expected


def test_without_fusion_the_count_is_what_jax_prints(capsys):
    print_saved_residuals(block, PARAMS, X)
    printed = 0
    for line in capsys.readouterr().out.splitlines():
        if "from the argument params" not in line and "from a literal" not in line:
            dtype, shape = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
            printed += np.dtype({"f32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)).itemsize * int(np.prod([int(d) for d in shape.split(",") if d]))
    assert residual_bytes(block, PARAMS, X, fusion=False) == printed


def test_with_fusion_only_materialized_values_are_counted():
    # x, the mean square (a reduction, [R]), the matmul operands (normalized input,
    # GELU output) and the first matmul's output, from which XLA's fusions recompute the
    # GELU intermediates: the parameters are not counted.
    expected = F32 * (ROWS * WIDTH + ROWS + ROWS * WIDTH + 2 * ROWS * HIDDEN)
    assert residual_bytes(block, PARAMS, X) == expected


def test_checkpointed_function_keeps_only_its_input():
    assert residual_bytes(jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable), PARAMS, X) == F32 * ROWS * WIDTH


def test_closed_over_values_are_not_counted():
    table = jnp.ones((ROWS, WIDTH))
    assert residual_bytes(lambda params, x: block(params, x * table), PARAMS, X) == residual_bytes(block, PARAMS, X)


def test_dot_flops_count_gemms_in_nested_programs_and_skip_batched_products():
    jaxpr = jax.make_jaxpr(lambda p, x: jax.jit(block)(p, x))(PARAMS, X).jaxpr
    assert dot_flops(jaxpr) == 2 * ROWS * WIDTH * HIDDEN * 2
    batched = jax.make_jaxpr(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k))(np.ones((2, 3, 4)), np.ones((2, 5, 4))).jaxpr
    assert dot_flops(batched) == 0
