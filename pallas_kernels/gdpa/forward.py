"""GDPA forward pass as a tile-engine instance: rows = Q, columns = K and V, accumulator = O.

Per 64-row query tile and key tile j (equivalent jnp, float32)::

    s = q @ k_j.T * scale                        # [64, block_cols]
    p = where(col < kv_len, act(s), 0)
    o += p.astype(dtype) @ v_j                   # [64, D]
    out = o * output_scale                       # once, before the cast and store

No softmax, so no running max and no rescaling: O is a plain sum over key tiles.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gdpa import activations, engine
from pallas_kernels.gdpa.reference import Activation


def spec(activation: Activation, scale: float, dtype, output_scale: float = 1.0) -> engine.EngineSpec:
    """The forward pass for `activation`, score `scale` and `output_scale`, operands of `dtype`."""

    def step(ctx: engine.StepContext) -> None:
        (q,) = ctx.rows
        k, v = ctx.cols
        (o,) = ctx.accs
        (s,) = ctx.scores([(q, k)])
        p = jnp.where(ctx.valid(), activations.value(activation, s * scale), 0.0)
        plgpu.wgmma(o, ctx.lhs(0, p.astype(dtype)), v)

    def finalize(accs):
        return [engine.scaled(accs[0], output_scale)]

    return engine.EngineSpec(name="gdpa_fwd", n_rows=1, n_cols=2, n_accs=1, n_lhs=1, step=step, finalize=finalize)
