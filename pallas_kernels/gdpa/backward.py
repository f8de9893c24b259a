"""GDPA backward passes as tile-engine instances.

With x = (Q K^T) * scale, P = act(x) masked to real (query, key) pairs and
dS = (dO V^T) * act'(x) masked the same way (equivalent jnp, float32), and the
forward's output scale c (every gradient is linear in dO, so c is applied once,
to the accumulators)::

    dV = c * P^T dO      dK = c * scale * dS^T Q      dQ = c * scale * dS K

Two passes, each accumulating its outputs in registers without atomics:

    dQ pass    rows = Q, dO (query tiles)   columns = K, V     acc = dQ
    dK/dV pass rows = K, V (key tiles)      columns = Q, dO    acc = dK, dV

The dK/dV pass computes the transposed scores K Q^T directly, so P^T and dS^T
come out of the score wgmma in the layout a register left operand needs. No
softmax means no row statistics (lse, delta) to save or recompute.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gdpa import activations, engine
from pallas_kernels.gdpa.reference import Activation


def dq_spec(activation: Activation, scale: float, dtype, output_scale: float = 1.0) -> engine.EngineSpec:
    """dQ: per query tile, sum over key tiles j of `output_scale * scale * dS_j @ K_j`."""

    def step(ctx: engine.StepContext) -> None:
        q, do = ctx.rows
        k, v = ctx.cols
        (dq,) = ctx.accs
        s, dp = ctx.scores([(q, k), (do, v)])
        _, ds = activations.value_and_vjp(activation, s * scale, dp)
        ds = jnp.where(ctx.valid(), ds, 0.0)
        plgpu.wgmma(dq, ctx.lhs(0, ds.astype(dtype)), k)

    return engine.EngineSpec(
        name="gdpa_bwd_dq",
        n_rows=2,
        n_cols=2,
        n_accs=1,
        n_lhs=1,
        step=step,
        finalize=lambda accs: [accs[0] * (output_scale * scale)],
    )


def dkv_spec(activation: Activation, scale: float, dtype, output_scale: float = 1.0) -> engine.EngineSpec:
    """dK, dV: per key tile, sums over query tiles i of `output_scale * scale * dS_i^T @ Q_i` and
    `output_scale * P_i^T @ dO_i`."""

    def step(ctx: engine.StepContext) -> None:
        k, v = ctx.rows
        q, do = ctx.cols
        dk, dv = ctx.accs
        s_t, dp_t = ctx.scores([(k, q), (v, do)])
        p_t, ds_t = activations.value_and_vjp(activation, s_t * scale, dp_t)
        valid = ctx.valid()
        p_t = jnp.where(valid, p_t, 0.0)
        ds_t = jnp.where(valid, ds_t, 0.0)
        plgpu.wgmma(dv, ctx.lhs(0, p_t.astype(dtype)), do)
        plgpu.wgmma(dk, ctx.lhs(1, ds_t.astype(dtype)), q)

    return engine.EngineSpec(
        name="gdpa_bwd_dkv",
        n_rows=2,
        n_cols=2,
        n_accs=2,
        n_lhs=2,
        step=step,
        finalize=lambda accs: [accs[0] * (output_scale * scale), engine.scaled(accs[1], output_scale)],
    )
