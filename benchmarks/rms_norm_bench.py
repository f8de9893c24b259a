"""RMSNorm (`pallas_kernels.rms_norm`) on one Hopper GPU: the Pallas kernels against the XLA path (flax's norm).

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/rms_norm_bench.py --out benchmarks/results/rms_norm_h200.json

First checks `implementation="pallas"` against `implementation="xla"` (flax's `nnx.RMSNorm` bit for bit) on
the GPU, at 70 rows (a masked last tile of the kernels' 4 rows) and at `--rows` - 13 (the default 166,528,
the token capacity of a `configs/gem_h200.py` step, leaves a masked last tile 13 fewer), width `--width`
(default 1024, the GEM width), each with and without the input passed through (`return_input`: the
residual branch's cotangent added in the backward kernel, as the model's pre-norm blocks run it), with
the default tile (`kernel.default_tile(d)`: 4 rows, 4 warps at d = 1024); then each `--tiles` variant
at 70 rows. Inputs: bf16 `x [N, d]` (normal, each row scaled by exp(2 N(0,1)), so
magnitudes span orders), a float32 scale `[d]` (1 + 0.2 N(0,1)), bf16 output, random bf16 cotangents of
`y` and of the passed-through `x`. Output and VJP (dx, dscale) must lie within the bounds of the
interpret-mode tests (tests/support/rms_norm_bounds.py), computed in float64 on the host for a random
subsample of `--bound-rows` rows (default 16,384; all rows when there are no more); dscale (which sums
every row) against a bound whose sum of |terms| is the subsample's scaled to all rows (an estimate: the
terms do not depend on a row's magnitude, the norm removes it). A NaN put in three rows must make
exactly those rows of y and dx NaN (and dscale), leaving every other value bit for bit that of the clean
run. A failed check exits 1 with no timings.

Then times forward alone, forward+backward, and forward+backward with the input passed through
("fwd_bwd_residual": for XLA the two cotangents of x summed by autodiff, as in the model), jitted, at
`--rows`: the Pallas path (the default tile as "pallas", each `--tiles` variant as
"pallas_<rows>x<warps>") against XLA: device time from CUPTI and wall time (`_row_kernels.time_paths`);
`xla_over_pallas` is XLA's time over the kernels'. GB/s divide `bytes_moved` (the kernels' operands and
results, the least either path moves) by the time.

Without a GPU the script says so, checks the 70-row case in the Pallas interpreter, writes no timings and
exits 0; `--interpret` runs everything in the interpreter (a CPU check of this script: use a small
`--rows`; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from rms_norm_bounds import bound_fractions  # noqa: E402

from benchmarks import _row_kernels  # noqa: E402
from pallas_kernels import rms_norm  # noqa: E402
from pallas_kernels.rms_norm import kernel  # noqa: E402

IMPLS = ("pallas", "xla")
TAIL_ROWS = 70  # 17 whole 4-row tiles and a masked one
TAIL_OFF = 13  # the large check's rows: --rows - 13 (a masked last tile)
BOUND_ROWS = 16_384  # rows whose bounds the host computes (float64)
EPS = 1e-6


def make_inputs(n: int, d: int, seed: int):
    """`(x, scale, dy, dx_in)`: bf16 `x [N, d]`, float32 `scale [d]`, bf16 cotangents `dy`, `dx_in` `[N, d]`."""
    k = jax.random.split(jax.random.key(seed), 4)
    x = (jax.random.normal(k[0], (n, d)) * jnp.exp(2.0 * jax.random.normal(k[1], (n, 1)))).astype(jnp.bfloat16)
    scale = 1.0 + 0.2 * jax.random.normal(k[2], (d,))
    dy, dx_in = jax.random.normal(k[3], (2, n, d)).astype(jnp.bfloat16)
    return x, scale, dy, dx_in


def op(impl: str, tile=None, residual: bool = False):
    return lambda x, scale: rms_norm(x, scale, eps=EPS, dtype=jnp.bfloat16, return_input=residual, implementation=impl, tile=tile)


def fwd_bwd(f, residual: bool = False):
    """`y, (dx, dscale)` of `f` for the cotangent `dy` of y (and `dx_in` of the passed-through x)."""

    def run(x, scale, dy, dx_in=None):
        out, vjp = jax.vjp(f, x, scale)
        return (out[0] if residual else out), vjp((dy, dx_in) if residual else dy)

    return run


def check(n: int, d: int, seed: int, tile, residual: bool = False, bound_rows: int = BOUND_ROWS) -> dict:
    """The Pallas path (`tile`) against the reference at `[N, d]`: each value's max |error| and its largest fraction
    of the bound (on `bound_rows` random rows, module docstring), and whether a NaN stays in its rows; `ok` when all
    fractions are at most 1 and it does."""
    x, scale, dy, dx_in = make_inputs(n, d, seed)
    cts = (dy, dx_in) if residual else (dy,)
    runs = {impl: jax.jit(fwd_bwd(op(impl, tile, residual), residual)) for impl in IMPLS}
    got, want = (runs[impl](x, scale, *cts) for impl in IMPLS)
    m = min(n, bound_rows)
    sample = jnp.asarray(np.sort(np.random.default_rng(seed).choice(n, m, replace=False)))  # on the device, then copied
    take = lambda a: a[sample]  # noqa: E731
    cut = lambda r: (take(r[0]), (take(r[1][0]), r[1][1]))  # noqa: E731
    fractions = bound_fractions(cut(got), cut(want), (take(x), scale), (take(dy), take(dx_in) if residual else None), EPS, rows_total=n)
    rows = np.unique([3 % n, 40 % n, n - 1])
    dirty = runs["pallas"](x.at[rows, d // 2].set(jnp.nan), scale, *cts)
    bad = jnp.zeros((n, d), bool).at[rows].set(True)
    nan_confined = all(_row_kernels.confined(c, z, b) for c, z, b in zip(jax.tree.leaves(got), jax.tree.leaves(dirty), (bad, bad, True)))
    errors = {name: {"max_abs_err": err, "bound_fraction": frac} for name, (err, frac) in fractions.items()}
    ok = nan_confined and all(frac <= 1.0 for _, frac in fractions.values())  # a NaN fraction fails
    rounded = json.dumps({name: round(f, 4) for name, (_, f) in fractions.items()})
    print(f"check {'OK ' if ok else 'BAD'} N={n} tile={tile} residual={residual}: bound fractions on {m} rows {rounded}; NaN confined: {nan_confined}", flush=True)
    return {"rows": n, "tile": list(tile), "residual": residual, "bound_rows": m, "ok": ok, "nan_confined": nan_confined, "errors": errors}


def bytes_moved(n: int, d: int, itemsize: int = 2, programs: int = kernel.BACKWARD_PROGRAMS, tile_rows: int = kernel.TILE[0]) -> dict[str, int]:
    """Bytes of the kernels' operands and results, counted once each. Forward: reads x and the scale (float32),
    writes y. Backward: reads x, dy and the scale; writes dx and each program's float32 scale partials `[d]`
    (at most `programs`). `fwd_bwd` is both; `fwd_bwd_residual` adds the read of the passed-through input's
    cotangent."""
    e, scale = n * d * itemsize, d * 4
    fwd = e + scale + e
    bwd = 2 * e + scale + e + min(programs, -(-n // tile_rows)) * d * 4
    return {"fwd": fwd, "fwd_bwd": fwd + bwd, "fwd_bwd_residual": fwd + bwd + e}


def timings(n: int, d: int, iters: int, tiles=()) -> dict:
    """Per mode and implementation (the Pallas path with the default tile and each of `tiles`, XLA): device and
    wall milliseconds per call, GB/s of `bytes_moved`; XLA over Pallas (the default tile)."""
    x, scale, dy, dx_in = make_inputs(n, d, seed=1)
    default = kernel.default_tile(d)
    paths = {_row_kernels.tile_label(tile, default): ("pallas", tuple(tile)) for tile in (default, *tiles)} | {"xla": ("xla", default)}
    modes = {"fwd": ((x, scale), False), "fwd_bwd": ((x, scale, dy), False), "fwd_bwd_residual": ((x, scale, dy, dx_in), True)}
    out = {}
    for mode, (args, residual) in modes.items():
        def fn(impl, tile, mode=mode, residual=residual):
            return jax.jit(op(impl, tile) if mode == "fwd" else fwd_bwd(op(impl, tile, residual), residual))

        out[mode] = _row_kernels.time_paths(
            mode, {label: (fn(impl, tile), args, bytes_moved(n, d, tile_rows=tile[0])[mode]) for label, (impl, tile) in paths.items()}, iters
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=_row_kernels.positive_int, default=166_528, help="N, rows of x (default: a gem_h200 step's token capacity)")
    p.add_argument("--width", type=int, default=1024, help="d")
    p.add_argument("--iters", type=_row_kernels.positive_int, default=20, help="timed calls per measurement")
    p.add_argument("--seed", type=int, default=0, help="of the checks' random inputs")
    p.add_argument("--tiles", type=_row_kernels.tiles_type("rms_norm"), default="2x4,8x4,8x8,16x8", help="kernel tiles (rows x warps) checked at 70 rows and timed besides the default")
    p.add_argument("--bound-rows", type=_row_kernels.positive_int, default=BOUND_ROWS, help="rows whose error bounds are computed (a random subsample)")
    p.add_argument("--interpret", action="store_true", help="everything in the Pallas interpreter (CPU check of this script)")
    p.add_argument("--out", help="JSON file of the results")
    args = p.parse_args(argv)
    n, d = args.rows, args.width
    if d not in kernel.KERNEL_WIDTHS:  # the op would run its reference on both paths: nothing to check or time
        p.error(f"--width {d}: the kernels take a power of two from 16 to 4096 ({kernel.KERNEL_WIDTHS})")
    default = kernel.default_tile(d)
    tiles = args.tiles
    gpu, full = _row_kernels.machine(args.interpret, f"{TAIL_ROWS}-row")
    record = _row_kernels.record_header("rms_norm", args.interpret or not gpu) | {
        "config": {"rows": n, "width": d, "dtype": "bfloat16", "scale": "float32", "eps": EPS, "iters": args.iters, "seed": args.seed,
                   "tiles": [list(default)] + [list(tile) for tile in tiles], "backward_programs": kernel.BACKWARD_PROGRAMS,
                   "bound_rows": args.bound_rows},
        "shapes": {"x, y, dx": [n, d], "scale": [d]},
    }
    cases = [(TAIL_ROWS, default, False), (TAIL_ROWS, default, True)]
    if full:
        cases += [(max(n - TAIL_OFF, 1), default, False), (max(n - TAIL_OFF, 1), default, True)]
        cases += [(TAIL_ROWS, tile, True) for tile in tiles]
    return _row_kernels.run(
        record, full, lambda: [check(m, d, args.seed, tile, residual, args.bound_rows) for m, tile, residual in cases],
        lambda: bytes_moved(n, d), bytes_moved.__doc__, lambda: timings(n, d, args.iters, tiles), args.out,
    )

if __name__ == "__main__":
    sys.exit(main())
