"""The GELU-backward GEMM (`pallas_kernels.gelu_grad_matmul`) on one Hopper GPU: the fused Pallas kernel against
the model's autodiff path and the plain cuBLAS GEMM.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/gelu_grad_matmul_bench.py --out benchmarks/results/gelu_grad_matmul_h100.json

The op: `dh = (dy @ w.T * gelu_tanh_grad(h)).astype(bf16)`, `dbias = dh.astype(f32).sum(0)` with bf16 dy `[M, K]`,
w `[N, K]` (the MLP's down-projection kernel), h `[M, N]` (default M = 166,656 token rows, K = 1024, N = 4096).

First the checks, which must all pass before anything is timed (a failure exits 1, no timings):
`implementation="pallas"` (the default `kernel.TuningConfig`) against `implementation="xla"` (the jnp reference:
float32 g) at the target shape: dh within the bounds of the interpret-mode tests
(tests/support/gelu_grad_matmul_bounds.py: the float32 summation-order error of g times the GELU derivative, plus a
bf16 ulp where a rounding boundary falls in between), computed in float64 on the host for `--bound-rows` random rows;
dbias within 2 gamma_(M+8) of the float64 column sums of the kernel's own dh (all rows) and near the reference's. A
NaN put in three rows of dy must make exactly those rows of dh NaN and all of dbias; NaNs put in three cells of h
exactly those cells of dh and their dbias columns; every other value bit for bit the clean run's. Each other
`--configs` variant is checked the same way (without the NaN runs) at `--variant-rows` rows; one that fails
(or does not compile) is recorded under "variant_checks" and not timed.

Then times, jitted, device time from CUPTI and wall time (`_row_kernels.time_paths`): "pallas" (the default config)
and "pallas_<variant>" for each variant; "xla", the model's path under `model.mlp_implementation="xla"`: autodiff
of `gelu(h + bias) @ w` with the GELU recomputed, XLA's bf16 GEMM and its fused pass for dh and the bias's partial
sums, the peer the kernel replaces in the train step; "jnp", the op's documented composition (`g = jnp.dot(dy, w.T)`,
`dh = (g.astype(f32) * gelu_tanh_grad(h)).astype(bf16)`, `dbias = dh.astype(f32).sum(0)`), which XLA compiles to
slower passes (4.85 against 3.45-3.69 ms on an H100: the first record's "xla" was this one); and "gemm",
`jnp.dot(dy, w.T)` alone (the floor the epilogue should approach). Writes GPU, jax version, shapes, ms, TFLOP/s
(2 M N K / time) and the ratios xla / pallas and pallas / gemm to `--out`.

Without a GPU the script says so, checks the kernel in the Pallas interpreter at 384 x 384 x 192, writes no
timings and exits 0; `--interpret` runs the checks of the variants in the interpreter too (a CPU check of this script).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from gelu_grad_matmul_bounds import dbias_check, dh_check  # noqa: E402

from benchmarks import _row_kernels  # noqa: E402
from pallas_kernels.gelu_grad_matmul import TuningConfig, default_config, gelu_grad_matmul, gelu_tanh_grad  # noqa: E402
from gem_jax.nn.layers import gelu  # noqa: E402

SMALL = (384, 384, 192)  # M, N, K of the CPU check: 9 tiles on the interpreter's 4 SMs, 3 K steps
BOUND_ROWS = 4096
VARIANTS = {  # name: config, each checked and timed besides the default
    "tile_n256": TuningConfig(tile_n=256, max_concurrent_steps=3, separate_h_buffer=False),
    "cluster_n": TuningConfig(cluster="n"),
    "cluster_m": TuningConfig(cluster="m"),
    "shared_h_5_stages": TuningConfig(max_concurrent_steps=5, separate_h_buffer=False),
    "approx_math": TuningConfig(approx_math=True),
    # Opt-in (--configs): whether the pipeline keeps the last K step's SMEM slot until that wgmma has finished
    # when the next tile's prologue refills the slots is unverified (module docstring of kernel.py).
    "delay_release1": TuningConfig(delay_release=1),
}
DEFAULT_VARIANTS = ("tile_n256", "cluster_n", "cluster_m", "shared_h_5_stages", "approx_math")


def make_inputs(m: int, n: int, k: int, seed: int):
    """bf16 `dy [M, K]` (unit normal), `w [N, K]` (std 1/sqrt(K)), `h [M, N]` (std 2), on the device."""
    kd, kw, kh = jax.random.split(jax.random.key(seed), 3)
    dy = jax.random.normal(kd, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    h = (2.0 * jax.random.normal(kh, (m, n), jnp.float32)).astype(jnp.bfloat16)
    return dy, w, h


def op(implementation: str, config: TuningConfig | None = None):
    return jax.jit(lambda dy, w, h: gelu_grad_matmul(dy, w, h, implementation=implementation, config=config))


def model_path(dy, w, h):
    """The model's path under `mlp_implementation="xla"`: autodiff of `gelu(h + bias) @ w` (the GELU recomputed,
    `gem_jax.nn.layers.gelu`) for the gradients of h and of the bias (here zero): XLA's bf16 GEMM, then its
    fused pass for dh with the bias's partial sums, as in the train step."""
    bias = jnp.zeros((h.shape[1],), h.dtype)
    _, vjp = jax.vjp(lambda h, bias: jnp.dot(gelu(h + bias), w), h, bias)
    return vjp(dy)


def jnp_composition(dy, w, h):
    """The op's documented jnp equivalent (float32 derivative, the rounded dh's column sums), as XLA compiles it."""
    g = jnp.dot(dy, w.T)
    dh = (g.astype(jnp.float32) * gelu_tanh_grad(h)).astype(jnp.bfloat16)
    return dh, dh.astype(jnp.float32).sum(axis=0)


def gemm(dy, w, h):
    del h
    return jnp.dot(dy, w.T)


def check(name: str, config: TuningConfig, shape, seed: int, bound_rows: int, nan_runs: bool) -> dict:
    """The Pallas path with `config` against the reference at `shape` (module docstring); `ok` when every fraction
    is at most 1, the count of differing dh elements within its bound and (with `nan_runs`) NaNs stay confined."""
    m, n, k = shape
    dy, w, h = make_inputs(m, n, k, seed)
    pallas = op("pallas", config)
    (dh, dbias), (rdh, rdbias) = pallas(dy, w, h), op("xla")(dy, w, h)
    rows = np.sort(np.random.default_rng(seed).choice(m, min(m, bound_rows), replace=False))
    sample = jnp.asarray(rows)
    dh_r = dh_check(dh[sample], rdh[sample], dy[sample], w, h[sample], approx_math=config.approx_math)
    db_r = dbias_check(np.asarray(dbias), np.asarray(dh), np.asarray(rdbias), np.asarray(rdh))
    result = {"variant": name, "config": repr(config), "shape": {"M": m, "N": n, "K": k}, "bound_rows": len(rows), "dh": dh_r, "dbias": db_r}
    ok = dh_r["max_fraction"] <= 1.0 and dh_r["differing"] <= dh_r["allowed_differing"]
    ok = ok and db_r["self_fraction"] <= 1.0 and db_r["ref_fraction"] <= 1.0
    if nan_runs:
        bad_rows = np.unique([3 % m, 129 % m, m - 1])
        dirty = pallas(dy.at[bad_rows, k // 2].set(jnp.nan), w, h)
        bad = jnp.zeros((m, n), bool).at[bad_rows].set(True)
        dy_confined = _row_kernels.confined(dh, dirty[0], bad) and bool(jnp.all(jnp.isnan(dirty[1])))
        cells = (np.array([1, 64, m - 2]), np.array([3, 3, n - 1]))  # two in one column; m >= 128
        dirty = pallas(dy, w, h.at[cells].set(jnp.nan))
        bad = jnp.zeros((m, n), bool).at[cells].set(True)
        bad_cols = jnp.zeros((n,), bool).at[cells[1]].set(True)
        h_confined = _row_kernels.confined(dh, dirty[0], bad) and _row_kernels.confined(dbias, dirty[1], bad_cols)
        result["nan_confined"] = {"dy_rows": dy_confined, "h_cells": h_confined}
        ok = ok and dy_confined and h_confined
    result["ok"] = bool(ok)
    print(f"check {'OK ' if ok else 'BAD'} {name} {m}x{n}x{k}: dh {dh_r} dbias {db_r} nan {result.get('nan_confined')}", flush=True)
    return result


def bytes_moved(m: int, n: int, k: int) -> dict[str, int]:
    """Bytes the fused kernel must move at least: reads dy, w and h, writes dh (all bf16) and its float32 dbias
    partials [M / 64, N] (then summed by XLA: read once more). The XLA path moves g [M, N] in bf16 twice more
    (written by the GEMM, read by the second pass)."""
    fused = 2 * (m * k + n * k + m * n + m * n) + 2 * 4 * (m // 64) * n
    return {"pallas": fused, "xla": 2 * (m * k + n * k + m * n + m * n) + 2 * 2 * m * n + 4 * n, "gemm": 2 * (m * k + n * k + m * n)}


def timings(shape, iters: int, variants: dict[str, TuningConfig]) -> dict:
    m, n, k = shape
    dy, w, h = make_inputs(m, n, k, seed=1)
    moved = bytes_moved(m, n, k)
    paths = {"pallas": (op("pallas"), (dy, w, h), moved["pallas"])}
    paths |= {f"pallas_{name}": (op("pallas", config), (dy, w, h), moved["pallas"]) for name, config in variants.items()}
    paths |= {"xla": (jax.jit(model_path), (dy, w, h), moved["xla"]), "jnp": (jax.jit(jnp_composition), (dy, w, h), moved["xla"])}
    paths |= {"gemm": (jax.jit(gemm), (dy, w, h), moved["gemm"])}
    row = _row_kernels.time_paths("dgelu_bgrad", paths, iters)
    flops = 2 * m * n * k
    for label in paths:
        row[label]["tflop_per_s"] = {t: flops / (row[label][t] * 1e-3) / 1e12 for t in ("device_ms", "wall_ms") if row[label][t]}
    row["pallas_over_gemm"] = {t: row["pallas"][t] / row["gemm"][t] for t in ("device_ms", "wall_ms") if row["pallas"][t] and row["gemm"][t]}
    row["best_pallas"] = min((label for label in paths if label.startswith("pallas")), key=lambda lb: row[lb]["device_ms"] or row[lb]["wall_ms"])
    print(f"  pallas / gemm: {row['pallas_over_gemm']}; best Pallas path: {row['best_pallas']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=_row_kernels.positive_int, default=166_656, help="token rows (a multiple of 128)")
    p.add_argument("--k", type=_row_kernels.positive_int, default=1024, help="the MLP's width (dy's columns)")
    p.add_argument("--n", type=_row_kernels.positive_int, default=4096, help="the MLP's hidden size (h's columns)")
    p.add_argument("--iters", type=_row_kernels.positive_int, default=20, help="timed calls per measurement")
    p.add_argument("--seed", type=int, default=0, help="of the checks' random inputs")
    p.add_argument("--configs", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated variants besides the default, of {list(VARIANTS)} ('' for none)")
    p.add_argument("--variant-rows", type=_row_kernels.positive_int, default=16_384, help="M of the variants' checks")
    p.add_argument("--bound-rows", type=_row_kernels.positive_int, default=BOUND_ROWS, help="rows whose dh bounds are computed")
    p.add_argument("--interpret", action="store_true", help="every check in the Pallas interpreter (CPU check of this script)")
    p.add_argument("--out", help="JSON file of the results")
    args = p.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in names if c not in VARIANTS]:
        p.error(f"--configs: unknown {unknown}; expected some of {list(VARIANTS)}")
    if args.m % 128:
        p.error(f"--m {args.m}: a multiple of 128")
    variants = {name: VARIANTS[name] for name in names}
    gpu, full = _row_kernels.machine(args.interpret, "x".join(map(str, SMALL)))
    shape = (args.m, args.n, args.k) if gpu else SMALL
    record = _row_kernels.record_header("gelu_grad_matmul", args.interpret or not gpu) | {
        "config": {"iters": args.iters, "seed": args.seed, "default": repr(default_config()),
                   "variants": {name: repr(c) for name, c in variants.items()}, "bound_rows": args.bound_rows, "variant_rows": args.variant_rows},
        "shapes": {"dy": [shape[0], shape[2]], "w": [shape[1], shape[2]], "h, dh": [shape[0], shape[1]], "dbias": [shape[1]]},
        "flops": 2 * shape[0] * shape[1] * shape[2],
    }

    def checks():
        out = [check("default", default_config(), shape, args.seed, args.bound_rows, nan_runs=True)]
        if full and out[0]["ok"]:
            # A variant that fails its check (or to compile) is recorded and left out of the timings; only the
            # default's check decides the exit status.
            record["variant_checks"] = []
            rows = min(args.variant_rows // 512 * 512 or 512, shape[0]) if gpu else SMALL[0] // 128 * 128
            for name, config in list(variants.items()):
                m = rows if rows % config.m_multiple == 0 else rows // config.m_multiple * config.m_multiple
                n = shape[1] if shape[1] % config.n_multiple == 0 else config.n_multiple
                try:
                    result = check(name, config, (m, n, shape[2]), args.seed + 1, args.bound_rows, nan_runs=False)
                except Exception as e:  # a variant that does not compile or run here
                    traceback.print_exc()
                    result = {"variant": name, "config": repr(config), "ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
                    print(f"check BAD {name}: {result['error'][:300]}", flush=True)
                record["variant_checks"].append(result)
                if not result["ok"]:
                    del variants[name]
        return out

    return _row_kernels.run(record, full and gpu, checks, lambda: bytes_moved(*shape), bytes_moved.__doc__,
                            lambda: timings(shape, args.iters, variants), args.out)


if __name__ == "__main__":
    sys.exit(main())
