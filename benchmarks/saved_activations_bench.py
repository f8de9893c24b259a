"""FP8 saved activations on one GPU: memory, time and error of a transformer MLP with and without them.

For the sequence tower's MLP at GEM width (`[T, d] -> [T, 4d] -> GELU -> [T, d]`, bf16,
`gem_jax.nn.layers.MLP`) with `fp8_saved_activations` off and on, in one process:

- `temp_mib`: XLA's compiled temp memory of `jax.grad` of `L` stacked residual MLP blocks
  (what the backward keeps alive; `memory_analysis()` of the jitted gradient);
- `fwd_bwd_ms`: median wall time of that gradient (CUPTI device time too when available);
- `quantize_ms` / `elementwise_ms`: the 1x128 XLA quantization of one `[T, 4d]` bf16 tensor
  against a plain elementwise pass over it (`x * 2`): the cost the saved activations add, and
  whether a fused quantization kernel would pay (ideal traffic: 3 bytes per element against
  the elementwise pass's 4);
- `grad_rel_err`: relative Frobenius error of each gradient with them on against off.

    PYTHONPATH=. python3 benchmarks/saved_activations_bench.py --out benchmarks/results/saved_activations_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import _timing
from gem_jax.nn.layers import MLP, rms_norm
from gem_jax.quant.saved_activations import BLOCK
from pallas_kernels.mxfp8 import quantize_mxfp8


class Blocks(nnx.Module):
    """`L` pre-norm residual MLP blocks, as in the sequence tower."""

    def __init__(self, d: int, layers: int, fp8_saved: bool):
        rngs = nnx.Rngs(0)
        self.norms = nnx.List([rms_norm(d, rngs=rngs, dtype=jnp.bfloat16) for _ in range(layers)])
        self.mlps = nnx.List([MLP(d, 4 * d, rngs=rngs, dtype=jnp.bfloat16, fp8_saved_activations=fp8_saved) for _ in range(layers)])

    def __call__(self, x):
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return x


def grad_fn(d: int, layers: int, fp8_saved: bool):
    with nnx.use_eager_sharding(False):  # logical axis names, no mesh
        graphdef, params = nnx.split(Blocks(d, layers, fp8_saved))

    def loss(params, x, dy):
        return jnp.vdot(nnx.merge(graphdef, params)(x).astype(jnp.float32), dy.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def measure(tokens: int, d: int, layers: int, iters: int) -> dict:
    kx, kd = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (tokens, d), jnp.bfloat16)
    dy = jax.random.normal(kd, (tokens, d), jnp.bfloat16)
    out, grads = {"tokens": tokens, "d": d, "hidden": 4 * d, "layers": layers}, {}
    for name, on in (("bf16_residuals", False), ("fp8_saved_activations", True)):
        f, params = grad_fn(d, layers, on)
        compiled = f.lower(params, x, dy).compile()
        out[name] = {
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
            "fwd_bwd_ms": 1e3 * _timing.wall_seconds(f, params, x, dy, iters=iters),
            "fwd_bwd_device_ms": _timing.device_ms(f, (params, x, dy), iters),
        }
        grads[name] = f(params, x, dy)
        print(name, out[name], flush=True)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree.leaves_with_path(grads["bf16_residuals"])]
    out["grad_rel_err"] = {
        p: rel_err(a, b) for p, a, b in zip(paths, jax.tree.leaves(grads["fp8_saved_activations"]), jax.tree.leaves(grads["bf16_residuals"]))
    }
    h = jax.random.normal(kx, (tokens, 4 * d), jnp.bfloat16)
    out["quantize_ms"] = 1e3 * _timing.wall_seconds(jax.jit(lambda h: quantize_mxfp8(h, block=BLOCK)), h, iters=iters)
    out["elementwise_ms"] = 1e3 * _timing.wall_seconds(jax.jit(lambda h: h * 2), h, iters=iters)
    out["temp_saved_fraction"] = 1 - out["fp8_saved_activations"]["temp_mib"] / out["bf16_residuals"]["temp_mib"]
    out["time_ratio_on_over_off"] = out["fp8_saved_activations"]["fwd_bwd_ms"] / out["bf16_residuals"]["fwd_bwd_ms"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536, 180224], help="T (gem_h200 steps hold ~173k history rows)")
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    record = {
        "benchmark": "saved_activations",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_kind": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "block": list(BLOCK),
        "runs": [measure(t, args.d, args.layers, args.iters) for t in args.tokens],
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for r in record["runs"]:
        print(json.dumps({k: v for k, v in r.items() if k != "grad_rel_err"}), flush=True)
        print("worst gradient error:", max(r["grad_rel_err"].values()), flush=True)


if __name__ == "__main__":
    main()
