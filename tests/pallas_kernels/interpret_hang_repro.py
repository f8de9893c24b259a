"""Reproduces a hang of the Mosaic GPU interpreter (jax 0.11.2) on a small CPU thread pool.

Run from the repository root, several times (a run hangs or finishes in about 20 s)::

    for i in 1 2 3 4; do timeout 240 env PJRT_NPROC=2 PYTHONPATH=. python tests/pallas_kernels/interpret_hang_repro.py; echo rc=$?; done

With PJRT_NPROC=2 (the default on a 2-core machine) about 3 runs of 4 hang (rc=124) with every
simulated warpgroup parked in `gpu_callbacks._barrier_wait` or waiting for its program to start;
with PJRT_NPROC=4 or more none did (benchmarks/gdpa.md, "Interpret-mode hang"). The interpreter
runs each warpgroup of a CTA as its own XLA:CPU program; a program may continue on an intra-op
pool thread, where a barrier wait then parks that thread, so a pool smaller than the warpgroups
of a CTA plus one can leave the warpgroup that would release the others without a thread.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gdpa import ops


def main():
    jax.config.update("jax_platforms", "cpu")
    for lengths in ([64, 65], [1, 64]):
        total = sum(lengths)
        offsets = jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, d_out = (jax.random.normal(key, (total + 5, 2, 64), jnp.bfloat16).at[total:].set(jnp.nan) for key in keys)

        def forward_and_grads(q, k, v, d_out):
            f = lambda q, k, v: ops.gdpa(q, k, v, offsets, offsets, max_seq_len_q=65, max_seq_len_kv=65,
                                         activation="silu", causal=True, implementation="pallas")
            out, vjp = jax.vjp(f, q, k, v)
            return out, *vjp(d_out)

        start = time.monotonic()
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            jax.block_until_ready(jax.jit(forward_and_grads)(q, k, v, d_out))
        print(f"lengths {lengths}: finished in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
