"""benchmarks/_timing.py forward_backward: the layer's output beside its gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def timing(load_benchmark):
    return load_benchmark("_timing")


def _recomputing_layer(q, k, v):
    """A layer whose backward needs no residual of its forward (as block-local attention's kernels)."""

    @jax.custom_vjp
    def layer(q, k, v):
        return jnp.tanh(q * k) + v

    def fwd(q, k, v):
        return layer(q, k, v), (q, k)  # the output is not a residual

    def bwd(res, g):
        q, k = res
        d = g * (1 - jnp.tanh(q * k) ** 2)
        return d * k, d * q, g

    layer.defvjp(fwd, bwd)
    return layer(q, k, v)


def test_forward_backward_returns_the_output_and_the_gradients_so_the_forward_is_kept(timing):
    q, k, v, dout = (jax.random.normal(jax.random.key(i), (5, 3)) for i in range(4))
    out, dq, dk, dv = jax.jit(timing.forward_backward(_recomputing_layer))(q, k, v, dout)
    np.testing.assert_allclose(out, jnp.tanh(q * k) + v, rtol=1e-6)
    want = jax.grad(lambda q, k, v: jnp.sum((jnp.tanh(q * k) + v) * dout), argnums=(0, 1, 2))(q, k, v)
    for got, expected in zip((dq, dk, dv), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # Had the step returned the gradients alone, XLA would drop this layer's forward: the step's
    # jaxpr keeps the forward's output among the results.
    jaxpr = jax.make_jaxpr(timing.forward_backward(_recomputing_layer))(q, k, v, dout)
    assert len(jaxpr.out_avals) == 4
