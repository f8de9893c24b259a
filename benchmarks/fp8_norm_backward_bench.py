"""The FP8 layer's RMSNorm prologue backward on one Hopper GPU: the norm's backward kernel against XLA's passes.

An FP8 layer with the RMSNorm prologue (`fp8_matmul(prologue="rmsnorm")`, the sequence tower's qkv and
MLP-in layers and the pooled attention's kv) computes the norm in its input's quantization pass, and
a pre-norm block passes its input through the layer (`keep_input=True`). With the default
`norm_implementation="xla"` the backward is autodiff of the prologue's float32 form, which XLA runs as
several passes, the residual's cotangent added to the rounded dx (what the model runs under
`model.norm_implementation=xla`); with "pallas" it is `pallas_kernels.rms_norm_backward`, the norm's
one-pass backward kernel, the cotangent added inside it (what the model's FP8 layers run by default on
a Hopper GPU). Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/fp8_norm_backward_bench.py --out benchmarks/results/fp8_norm_backward_h100.json

Checks first, at 70 rows and at `--rows` - 13 (a masked last row tile), width `--width`: the backward
alone, "pallas" against "xla", within the bounds of tests/support/rms_norm_bounds.py on a random
subsample of `--bound-rows` rows, and a NaN in three rows of x confined to those rows of dx; then the
layer (`--out-features` outputs, 128-wide FP8 blocks) forward and backward, the two ways: dx within
four bf16 unit roundoffs of its row's largest |dx| + |h| (autodiff rounds the gradients of the norm's
two float32 widenings of x to bf16 before summing them, and dx before adding the residual's cotangent
h; the kernel sums in float32 and rounds once), the gain's gradient within float32 summation order.
y and the weight gradient do not depend on the norm's backward: their differences between the two
programs are reported (elements differing, the largest difference over the largest value), not checked,
since each program computes the forward's 1/rms in its own XLA reduction (`rmsnorm_quantize_mxfp8`), whose
summation order may differ, and a quantized byte with it (on an H100, one run's y and weight gradient
differed between the programs, by an amount not recorded; other runs matched bit for bit). A failed
check exits 1 with no timings. Then times, jitted, at `--rows`: the backward alone and the layer's
forward+backward, each way (`_row_kernels.time_paths`: CUPTI device time and wall time; `xla_over_pallas`).
Inputs: bf16 x (normal rows scaled by exp(2 N(0,1))), a float32 gain near 1, a float32 kernel of
sd in^-1/2, bf16 cotangents.

Without a GPU the script says so, checks the 70-row case in the Pallas interpreter and exits 0;
`--interpret` runs everything in the interpreter (a CPU check of this script: small `--rows`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from rms_norm_bounds import bound_fractions  # noqa: E402

from benchmarks import _row_kernels  # noqa: E402
from pallas_kernels.mxfp8 import Fp8Recipe, fp8_matmul  # noqa: E402
from pallas_kernels.rms_norm import kernel, rms_norm_backward  # noqa: E402

IMPLS = ("pallas", "xla")
TAIL_ROWS = 70
TAIL_OFF = 13
BOUND_ROWS = 16_384
EPS = 1e-6
RECIPE = Fp8Recipe(block=128)


def make_inputs(n: int, d: int, out: int, seed: int):
    """`(x, scale, w, dy, g, h)`: bf16 `x [N, d]`, float32 gain `[d]` and kernel `[d, out]`, bf16 cotangents: `dy` of the
    norm's output `[N, d]`, `g` of the layer's output `[N, out]`, `h` of the residual's `x` `[N, d]`."""
    k = jax.random.split(jax.random.key(seed), 6)
    x = (jax.random.normal(k[0], (n, d)) * jnp.exp(2.0 * jax.random.normal(k[1], (n, 1)))).astype(jnp.bfloat16)
    scale = 1.0 + 0.2 * jax.random.normal(k[2], (d,))
    w = jax.random.normal(k[3], (d, out)) / np.sqrt(d)
    dy, h = jax.random.normal(k[4], (2, n, d)).astype(jnp.bfloat16)
    g = jax.random.normal(k[5], (n, out)).astype(jnp.bfloat16)
    return x, scale, w, dy, g, h


def backward_alone(impl: str):
    return lambda x, scale, dy, h: rms_norm_backward(x, scale, dy, h, eps=EPS, implementation=impl)


def layer(impl: str):
    """The pre-norm layer `(y, x) = (fp8(rmsnorm(x)) @ w, x)`, x passed through it, and its VJP for cotangents `(g, h)`,
    with the norm's backward of `impl`."""

    def forward(x, scale, w):
        return fp8_matmul(x, w, None, RECIPE, w.dtype, prologue="rmsnorm", norm_scale=scale, eps=EPS, norm_implementation=impl, keep_input=True)

    def run(x, scale, w, g, h):
        (y, _), vjp = jax.vjp(forward, x, scale, w)
        return y, vjp((g, h))

    return run


def check(n: int, d: int, out: int, seed: int, bound_rows: int) -> dict:
    """Both ways at `[N, d]` (module docstring); `ok` when every check holds."""
    x, scale, w, dy, g, h = make_inputs(n, d, out, seed)
    got, want = (jax.jit(backward_alone(impl))(x, scale, dy, h) for impl in IMPLS)
    m = min(n, bound_rows)
    sample = jnp.asarray(np.sort(np.random.default_rng(seed).choice(n, m, replace=False)))
    y = jnp.zeros((m, d), jnp.float32)  # no forward here: y's fraction is 0 by construction
    cut = lambda r: (y, (r[0][sample], r[1]))  # noqa: E731
    fractions = bound_fractions(cut(got), cut(want), (x[sample], scale), (dy[sample], h[sample]), EPS, rows_total=n)
    del fractions["y"]
    rows = np.unique([3 % n, 40 % n, n - 1])
    dirty = jax.jit(backward_alone("pallas"))(x.at[rows, d // 2].set(jnp.nan), scale, dy, h)
    bad = jnp.zeros((n, d), bool).at[rows].set(True)
    nan_confined = _row_kernels.confined(got[0], dirty[0], bad) and bool(jnp.isnan(dirty[1]).all())
    (y_k, (dx_k, ds_k, dw_k)), (y_x, (dx_x, ds_x, dw_x)) = (jax.jit(layer(impl))(x, scale, w, g, h) for impl in IMPLS)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    row_scale = jnp.max(jnp.abs(f32(dx_x)) + jnp.abs(f32(h)), axis=-1, keepdims=True)
    dx_rel = float(jnp.max(jnp.abs(f32(dx_k) - f32(dx_x)) / row_scale))
    ds_rel = float(jnp.max(jnp.abs(ds_k - ds_x)) / jnp.max(jnp.abs(ds_x)))
    layer_checks = {
        "dx_max_rel_diff": dx_rel,  # of the row's largest |dx| + |h|: at most 4 bf16 unit roundoffs (2**-8)
        "dscale_rel_diff": ds_rel,
        # Reported, not checked: neither depends on the norm's backward (module docstring).
        "y_elements_differing": int(jnp.sum(y_k != y_x)),
        "y_max_diff_of_max": float(jnp.max(jnp.abs(f32(y_k) - f32(y_x))) / jnp.max(jnp.abs(f32(y_x)))),
        "dw_elements_differing": int(jnp.sum(dw_k != dw_x)),
        "dw_max_diff_of_max": float(jnp.max(jnp.abs(dw_k - dw_x)) / jnp.max(jnp.abs(dw_x))),
    }
    ok = nan_confined and all(f <= 1.0 for _, f in fractions.values()) and dx_rel <= 4 * 2.0**-8 and ds_rel <= 1e-3
    print(f"check {'OK ' if ok else 'BAD'} N={n}: backward bound fractions {({k: round(f, 4) for k, (_, f) in fractions.items()})}; "
          f"NaN confined {nan_confined}; layer {layer_checks}", flush=True)
    errors = {name: {"max_abs_err": err, "bound_fraction": frac} for name, (err, frac) in fractions.items()}
    return {"rows": n, "ok": ok, "nan_confined": nan_confined, "errors": errors, "layer": layer_checks}


def bytes_moved(n: int, d: int) -> dict[str, int | None]:
    """The backward alone: x, dy and the residual's cotangent read, dx written (bf16), the gain read, the
    programs' float32 partials written. The layer: what its kernels read and write is not counted (None)."""
    e = n * d * 2
    return {"backward": 4 * e + d * 4 + min(kernel.BACKWARD_PROGRAMS, -(-n // kernel.TILE[0])) * d * 4, "layer": None}


def timings(n: int, d: int, out: int, iters: int) -> dict:
    x, scale, w, dy, g, h = make_inputs(n, d, out, seed=1)
    moved = bytes_moved(n, d)
    return {
        "backward": _row_kernels.time_paths("backward", {i: (jax.jit(backward_alone(i)), (x, scale, dy, h), moved["backward"]) for i in IMPLS}, iters),
        "layer_fwd_bwd": _row_kernels.time_paths("layer", {i: (jax.jit(layer(i)), (x, scale, w, g, h), moved["layer"]) for i in IMPLS}, iters),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=_row_kernels.positive_int, default=166_528, help="N (default: a gem_h200 step's token capacity)")
    p.add_argument("--width", type=int, default=1024, help="d, the norm's width")
    p.add_argument("--out-features", type=int, default=3072, help="the layer's outputs (default: the sequence tower's qkv)")
    p.add_argument("--iters", type=_row_kernels.positive_int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bound-rows", type=_row_kernels.positive_int, default=BOUND_ROWS)
    p.add_argument("--interpret", action="store_true", help="everything in the Pallas interpreter (CPU check of this script)")
    p.add_argument("--out", help="JSON file of the results")
    args = p.parse_args(argv)
    n, d, out = args.rows, args.width, args.out_features
    gpu, full = _row_kernels.machine(args.interpret, f"{TAIL_ROWS}-row")
    record = _row_kernels.record_header("fp8_norm_backward", args.interpret or not gpu) | {
        "config": {"rows": n, "width": d, "out_features": out, "fp8_block": RECIPE.block, "iters": args.iters, "seed": args.seed, "bound_rows": args.bound_rows},
    }
    sizes = [TAIL_ROWS] + ([max(n - TAIL_OFF, 1)] if full else [])
    return _row_kernels.run(
        record, full, lambda: [check(m, d, out, args.seed, args.bound_rows) for m in sizes],
        lambda: bytes_moved(n, d), bytes_moved.__doc__, lambda: timings(n, d, out, args.iters), args.out,
    )


if __name__ == "__main__":
    sys.exit(main())
