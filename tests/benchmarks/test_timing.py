"""benchmarks/_timing.py forward_backward: the layer's output beside its gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def timing(load_benchmark):
    return load_benchmark("_timing")


def _recomputing_layer(q, k, v):
    """A layer whose backward needs no residual of its forward (as block-local attention's kernels):
    its output's sin(v) term is computed in the forward alone."""

    @jax.custom_vjp
    def layer(q, k, v):
        return jnp.tanh(q * k) + jnp.sin(v)

    def fwd(q, k, v):
        return layer(q, k, v), (q, k, v)  # the output is not a residual

    def bwd(res, g):
        q, k, v = res
        d = g * (1 - jnp.tanh(q * k) ** 2)
        return d * k, d * q, g * jnp.cos(v)

    layer.defvjp(fwd, bwd)
    return layer(q, k, v)


def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_forward_backward_returns_the_output_and_the_gradients_so_the_forward_is_kept(timing):
    q, k, v, dout = (jax.random.normal(jax.random.key(i), (5, 3)) for i in range(4))
    out, dq, dk, dv = jax.jit(timing.forward_backward(_recomputing_layer))(q, k, v, dout)
    np.testing.assert_allclose(out, jnp.tanh(q * k) + jnp.sin(v), rtol=1e-6)
    want = jax.grad(lambda q, k, v: jnp.sum((jnp.tanh(q * k) + jnp.sin(v)) * dout), argnums=(0, 1, 2))(q, k, v)
    for got, expected in zip((dq, dk, dv), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The forward-only work is in the compiled step; in a step that returns the gradients alone
    # (the benchmarks' earlier form) XLA drops it as dead code.
    gradients_alone = lambda q, k, v, dout: jax.vjp(_recomputing_layer, q, k, v)[1](dout)
    assert " sine(" in _compiled(timing.forward_backward(_recomputing_layer), q, k, v, dout)
    assert " sine(" not in _compiled(gradients_alone, q, k, v, dout)
