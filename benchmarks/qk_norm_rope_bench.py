"""QK-norm + RoPE (`pallas_kernels.qk_norm_rope`) on one Hopper GPU: the Pallas kernels against the XLA path.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/qk_norm_rope_bench.py --out benchmarks/results/qk_norm_rope_h200.json

First checks `implementation="pallas"` against `implementation="xla"` (the jnp reference) on the GPU,
at 70 tokens (a masked last tile of the kernels' 16 rows) and at `--tokens` - 13 (the default 166,528,
the token capacity of a `configs/gem_h200.py` step, is 10,408 whole tiles: 13 fewer leave a masked last
one), H=8, D=128, with the default tile (16 rows, 4 warps); then each `--tiles` variant at 70 tokens
(masked last tiles of 32 and 16 rows). Inputs: bf16 `qkv [T, 3*H*D]` (normal, each token
scaled by exp(2 N(0,1)), so magnitudes span orders), float32 scales `[D]` (1 + 0.2 N(0,1)), the RoPE
table (`gem_jax.nn.layers.rope_table`, base 10,000) of positions `arange(T) % 1024`, random bf16
cotangents of q, k, v. Forward (q, k, v) and VJP (dqkv, d q_scale, d k_scale) must lie within the
bounds of the interpret-mode tests (tests/support/qk_norm_rope_bounds.py). The float64 bounds are
computed on the host for a random subsample of `--bound-tokens` tokens (default 16,384; all heads; all
tokens when there are no more): their values and qkv gradients are checked, and the scale gradients (which
sum every token) against a bound whose sum of |terms| is the subsample's scaled to all tokens (an estimate:
the terms do not depend on a token's magnitude, the RMSNorm removes it). A NaN put in a query head of
three tokens must make exactly that head of q and of dqkv NaN (and d q_scale, which sums every token),
leaving every other value bit for bit that of the clean run. A failed check exits 1 with no timings.

Then times forward alone and forward+backward (`jax.vjp`, outputs and cotangents of qkv and both
scales), jitted, at `--tokens`, Pallas (the default tile as "pallas", each `--tiles` variant as
"pallas_<rows>x<warps>") against XLA: device time from CUPTI (median over `--iters` calls of the
summed kernel time of one call) and wall time (median over 5 reps of the mean of `--iters`
back-to-back calls, after a warm-up call); `xla_over_pallas` is XLA's time over the kernels'. GB/s
divide `bytes_moved` (the kernels' operands and results, the least either path moves) by the time.

Without a GPU the script says so, checks the 70-token case in the Pallas interpreter, writes no
timings and exits 0; `--interpret` runs everything in the interpreter (a CPU check of this script:
use a small `--tokens`; its times mean nothing). `git_commit` in the JSON is $GEM_GIT_COMMIT when set
(a copy of the tree run elsewhere, whose `.git` may be another commit's), else git's HEAD here.
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
from qk_norm_rope_bounds import bound_fractions  # noqa: E402

from benchmarks import _row_kernels  # noqa: E402
from gem_jax.nn.layers import rope_table  # noqa: E402
from pallas_kernels import qk_norm_rope  # noqa: E402
from pallas_kernels.qk_norm_rope import kernel  # noqa: E402

IMPLS = ("pallas", "xla")
TAIL_TOKENS = 70  # four whole 16-row tiles and a masked one
TAIL_OFF = 13  # the large check's tokens: --tokens - 13 (a masked last tile)
BOUND_TOKENS = 16_384  # tokens whose bounds the host computes (float64)
ROPE_BASE, MAX_POSITION = 10_000.0, 1024


def make_inputs(t: int, h: int, d: int, seed: int):
    """`(qkv, q_scale, k_scale, cos, sin, cotangents)`: bf16 `qkv [T, 3*H*D]`, float32 scales `[D]`, float32
    `cos`/`sin` `[T, 1, D/2]` and bf16 cotangents `(dq, dk, dv)` `[T, H, D]` (module docstring)."""
    k = jax.random.split(jax.random.key(seed), 4)
    spread = jnp.exp(2.0 * jax.random.normal(k[1], (t, 1)))
    qkv = (jax.random.normal(k[0], (t, 3 * h * d)) * spread).astype(jnp.bfloat16)
    q_scale, k_scale = 1.0 + 0.2 * jax.random.normal(k[2], (2, d))
    table = rope_table(jnp.arange(t) % MAX_POSITION, d, ROPE_BASE)
    cotangents = tuple(jax.random.normal(k[3], (3, t, h, d)).astype(jnp.bfloat16))
    return qkv, q_scale, k_scale, table.cos, table.sin, cotangents


def op(impl: str, heads: int, tile=kernel.TILE):
    return lambda qkv, q_scale, k_scale, cos, sin: qk_norm_rope(qkv, q_scale, k_scale, cos, sin, heads=heads, implementation=impl, tile=tile)


def fwd_bwd(f):
    """`(q, k, v), (dqkv, d q_scale, d k_scale)` of `f` for the cotangents `cts` of `(q, k, v)`."""

    def run(qkv, q_scale, k_scale, cos, sin, cts):
        outs, vjp = jax.vjp(lambda *a: f(*a, cos, sin), qkv, q_scale, k_scale)
        return outs, vjp(cts)

    return run


def check(t: int, h: int, d: int, seed: int, tile=kernel.TILE, bound_tokens: int = BOUND_TOKENS) -> dict:
    """The Pallas path (`tile`) against the reference at `[T, 3*H*D]`: each value's max |error| and its largest
    fraction of the bound (on `bound_tokens` random tokens, module docstring), and whether a NaN stays in its
    token's head; `ok` when all fractions are at most 1 and it does."""
    qkv, q_scale, k_scale, cos, sin, cts = make_inputs(t, h, d, seed)
    runs = {impl: jax.jit(fwd_bwd(op(impl, h, tile))) for impl in IMPLS}
    got, want = (runs[impl](qkv, q_scale, k_scale, cos, sin, cts) for impl in IMPLS)
    n = min(t, bound_tokens)
    sample = jnp.asarray(np.sort(np.random.default_rng(seed).choice(t, n, replace=False)))  # on the device, then copied
    take = lambda a: a[sample]  # noqa: E731
    shaped = lambda r: (tuple(map(take, r[0])), (take(r[1][0]).reshape(n, 3, h, d), *r[1][1:]))  # noqa: E731
    inputs = (take(qkv).reshape(n, 3, h, d), q_scale, k_scale, take(cos), take(sin))
    fractions = bound_fractions(shaped(got), shaped(want), inputs, tuple(map(take, cts)), tokens_total=t)
    rows = np.unique([3 % t, 40 % t, t - 1])  # the first, second and last tile at 70 tokens
    col = (h - 1) * d  # the last query head
    dirty = runs["pallas"](qkv.at[rows, col].set(jnp.nan), q_scale, k_scale, cos, sin, cts)
    bad_q = jnp.zeros((t, h, d), bool).at[rows, h - 1].set(True)
    bad_dqkv = jnp.zeros((t, 3 * h * d), bool).at[rows, col : col + d].set(True)
    bads = (bad_q, False, False, bad_dqkv, True, False)  # q, k, v, dqkv, d q_scale (sums every token), d k_scale
    nan_confined = all(_row_kernels.confined(c, x, b) for c, x, b in zip(jax.tree.leaves(got), jax.tree.leaves(dirty), bads))
    errors = {name: {"max_abs_err": err, "bound_fraction": frac} for name, (err, frac) in fractions.items()}
    ok = nan_confined and all(frac <= 1.0 for _, frac in fractions.values())  # a NaN fraction fails
    rounded = json.dumps({name: round(f, 4) for name, (_, f) in fractions.items()})
    print(f"check {'OK ' if ok else 'BAD'} T={t} tile={tile}: bound fractions on {n} tokens {rounded}; NaN confined: {nan_confined}", flush=True)
    return {"tokens": t, "tile": list(tile), "bound_tokens": n, "ok": ok, "nan_confined": nan_confined, "errors": errors}


def bytes_moved(t: int, h: int, d: int, itemsize: int = 2, rows: int = kernel.TILE[0]) -> dict[str, int]:
    """Bytes of the kernels' operands and results, counted once each. Forward: reads q, k, v of qkv, cos and sin
    (float32 `[T, D/2]` each) and the scales (float32 `[2, D]`); writes q, k, v. Backward: reads q and k of qkv,
    dq, dk, dv, cos, sin and the scales; writes dqkv and each `rows`-token tile's float32 scale partials `[2*D]`.
    `fwd_bwd` is both."""
    e, table, scales = t * h * d * itemsize, 2 * t * (d // 2) * 4, 2 * d * 4
    fwd = 3 * e + table + scales + 3 * e
    bwd = 2 * e + 3 * e + table + scales + 3 * e + -(-t // rows) * 2 * d * 4
    return {"fwd": fwd, "fwd_bwd": fwd + bwd}


def timings(t: int, h: int, d: int, iters: int, tiles=()) -> dict:
    """Per mode and implementation (the Pallas path with the default tile and each of `tiles`, XLA): device and
    wall milliseconds per call, GB/s of `bytes_moved`; XLA over Pallas (the default tile)."""
    qkv, q_scale, k_scale, cos, sin, cts = make_inputs(t, h, d, seed=1)
    paths = {_row_kernels.tile_label(tile, kernel.TILE): ("pallas", tuple(tile)) for tile in (kernel.TILE, *tiles)} | {"xla": ("xla", kernel.TILE)}
    out = {}
    for mode in ("fwd", "fwd_bwd"):
        args = (qkv, q_scale, k_scale, cos, sin) + ((cts,) if mode == "fwd_bwd" else ())
        out[mode] = _row_kernels.time_paths(mode, {
            label: (jax.jit(op(impl, h, tile) if mode == "fwd" else fwd_bwd(op(impl, h, tile))), args, bytes_moved(t, h, d, rows=tile[0])[mode])
            for label, (impl, tile) in paths.items()
        }, iters)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=_row_kernels.positive_int, default=166_528, help="T, tokens of qkv (default: a gem_h200 step's capacity)")
    p.add_argument("--heads", type=int, default=8, help="H")
    p.add_argument("--head-dim", type=int, default=128, help="D")
    p.add_argument("--iters", type=_row_kernels.positive_int, default=20, help="timed calls per measurement")
    p.add_argument("--seed", type=int, default=0, help="of the checks' random inputs")
    p.add_argument("--tiles", type=_row_kernels.tiles_type("qk_norm_rope"), default="32x4,16x8", help="kernel tiles (rows x warps) checked at 70 tokens and timed besides the default 16x4")
    p.add_argument("--bound-tokens", type=_row_kernels.positive_int, default=BOUND_TOKENS, help="tokens whose error bounds are computed (a random subsample)")
    p.add_argument("--interpret", action="store_true", help="everything in the Pallas interpreter (CPU check of this script)")
    p.add_argument("--out", help="JSON file of the results")
    args = p.parse_args(argv)
    t, h, d = args.tokens, args.heads, args.head_dim
    tiles = args.tiles
    gpu, full = _row_kernels.machine(args.interpret, f"{TAIL_TOKENS}-token")
    record = _row_kernels.record_header("qk_norm_rope", args.interpret or not gpu) | {
        "config": {"tokens": t, "heads": h, "head_dim": d, "dtype": "bfloat16", "eps": 1e-6, "rope_base": ROPE_BASE,
                   "positions": f"arange(T) % {MAX_POSITION}", "iters": args.iters, "seed": args.seed,
                   "tiles": [list(kernel.TILE)] + [list(tile) for tile in tiles], "bound_tokens": args.bound_tokens},
        "shapes": {"qkv": [t, 3 * h * d], "q_scale, k_scale": [d], "cos, sin": [t, 1, d // 2], "q, k, v": [t, h, d]},
    }
    cases = [(TAIL_TOKENS, kernel.TILE)] + ([(max(t - TAIL_OFF, 1), kernel.TILE)] + [(TAIL_TOKENS, tile) for tile in tiles] if full else [])
    return _row_kernels.run(
        record, full, lambda: [check(n, h, d, args.seed, tile, args.bound_tokens) for n, tile in cases],
        lambda: bytes_moved(t, h, d), bytes_moved.__doc__, lambda: timings(t, h, d, args.iters, tiles), args.out,
    )

if __name__ == "__main__":
    sys.exit(main())
