"""Jagged flash attention (JFA) on one Hopper GPU: our Mosaic GPU kernels against their peers.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/jfa_bench.py --out benchmarks/results/jfa_h200.json

First checks the kernels against the jnp reference on the GPU (forward and dQ/dK/dV; edge
lengths, NaN slack, scores near -12 and -20, D 64 and 128, causal and not), then times:

  jfa_pallas         ours: packed `[T, H, D]` + offsets, no padding
  cudnn_lengths      `jax.nn.dot_product_attention(implementation="cudnn")` on padded `[B, N, H, D]`
                     with `query_seq_lengths` / `key_value_seq_lengths`
  cudnn_padded       the same without lengths: attends to padding (wrong; bounds padded work)
  xla_padded_masked  `jax.nn.dot_product_attention(implementation="xla")` with the lengths mask
  jfa_xla            our "xla" path (`reference.py`: pad inside, float32 softmax), packed input

Peers get their padded inputs ready-made (the packing/unpacking is not timed for them).
Forward+backward is `jax.vjp` of the op applied to a fresh cotangent, grads w.r.t. q, k, v.

Timing: device time per call from CUPTI (sum of the kernels one call launches, median over
`--iters` calls) and wall time (median over 5 reps of the mean of `--iters` back-to-back
calls, one block at the end; includes launch gaps). Effective TFLOP/s counts real work only:
sum_b 4 L_b^2 H D for the forward (halved under causal masking), 3.5x that for forward+backward.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _timing
from pallas_kernels.jagged_flash_attention import vjp as jfa_kernel
from pallas_kernels.jagged_flash_attention import reference

HEADS, DIM = 4, 128
ML_LENGTHS = Path(__file__).with_name("jfa_ml_latest_small_lengths.npy")


def lognormal_lengths(batch: int, seed: int) -> np.ndarray:
    """BASELINES.md's long-tailed lengths: clip(lognormal(log 200, 0.9), 8, 1024)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(200), 0.9, batch), 8, 1024).astype(np.int32)


CASES = {
    # name: (lengths, max_seq_len)
    "long_tailed_b64": (lambda: lognormal_lengths(64, 0), 1024),
    "ml_latest_small": (lambda: np.load(ML_LENGTHS).astype(np.int32), 1024),
    "gem_like_b1024": (lambda: lognormal_lengths(1024, 1), 1024),
}


def real_flops(lengths: np.ndarray, causal: bool) -> float:
    f = float(np.sum(4.0 * lengths.astype(np.float64) ** 2 * HEADS * DIM))
    return f / 2 if causal else f


def offsets_of(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(lengths, capacity, dim, seed, poison=True):
    keys = jax.random.split(jax.random.key(seed), 4)
    end = int(np.sum(lengths))
    out = []
    for key in keys:
        x = jax.random.normal(key, (capacity, HEADS, dim), jnp.float32).astype(jnp.bfloat16)
        out.append(x.at[end:].set(jnp.nan) if poison else x)
    return out


def to_padded(x, lengths, n):
    offsets = offsets_of(lengths)
    pos = np.arange(n)
    rows = offsets[:-1, None] + pos[None, :]
    valid = pos[None, :] < lengths[:, None]
    padded = jnp.take(x, jnp.asarray(np.where(valid, rows, 0)), axis=0)
    return jnp.where(jnp.asarray(valid)[..., None, None], padded, jnp.zeros((), x.dtype))


# --- timing ---------------------------------------------------------------------------------


def wall_ms(f, args, iters):
    return _timing.wall_seconds(f, *args, iters=iters, reps=5) * 1e3


# --- implementations -------------------------------------------------------------------------


def make_impls(lengths, n, causal):
    lens = jnp.asarray(lengths)
    offsets = jnp.asarray(offsets_of(lengths))

    def jfa(impl):
        fn = jfa_kernel.jagged_flash_attention if impl == "pallas" else reference.jagged_flash_attention
        return lambda q, k, v: fn(q, k, v, offsets, max_seq_len=n, causal=causal)

    def dpa(implementation, with_lengths):
        def f(q, k, v):
            kw = dict(query_seq_lengths=lens, key_value_seq_lengths=lens) if with_lengths else {}
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation, **kw)

        return f

    return {
        "jfa_pallas": ("packed", jfa("pallas")),
        "cudnn_lengths": ("padded", dpa("cudnn", True)),
        "cudnn_padded": ("padded", dpa("cudnn", False)),
        "xla_padded_masked": ("padded", dpa("xla", True)),
        "jfa_xla": ("packed", jfa("xla")),
    }


# --- correctness on the GPU ---------------------------------------------------------------------


def check_case(lengths, capacity, dim, causal, logit=None, seed=0, num_ctas=None):
    lengths = np.asarray(lengths, np.int32)
    offsets = jnp.asarray(offsets_of(lengths))
    end = int(lengths.sum())
    if logit is None:
        q, k, v, g = packed_inputs(lengths, capacity, dim, seed)
    else:
        keys = jax.random.split(jax.random.key(seed), 5)
        u = jax.random.normal(keys[0], (dim,))
        u = u / jnp.linalg.norm(u)
        a = np.sqrt(-logit * np.sqrt(dim))
        shape = (capacity, HEADS, dim)
        q = a * u + jax.random.normal(keys[1], shape)
        k = -a * u + jax.random.normal(keys[2], shape)
        v, g = jax.random.normal(keys[3], shape), jax.random.normal(keys[4], shape)
        q, k, v, g = (x.astype(jnp.bfloat16).at[end:].set(jnp.nan) for x in (q, k, v, g))
    n = max(int(lengths.max()), 1)
    results = {}
    for impl in ("pallas", "xla"):
        if impl == "pallas":
            fn = functools.partial(jfa_kernel.jagged_flash_attention, num_ctas=num_ctas)
        else:
            fn = reference.jagged_flash_attention
        f = functools.partial(fn, offsets=offsets, max_seq_len=n, causal=causal)

        results[impl] = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(_timing.forward_backward(f))(q, k, v, g)]
    report = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["pallas"], results["xla"]):
        scale = float(np.max(np.abs(b[:end]))) if end else 0.0
        err = float(np.max(np.abs(a[:end] - b[:end]))) if end else 0.0
        report[name] = {
            "max_err": err,
            "scale": scale,
            "rel": err / max(scale, 1e-9),
            "nonfinite": int(np.sum(~np.isfinite(a))),
            "slack_max_abs": float(np.max(np.abs(a[end:]))) if capacity > end else 0.0,
        }
    ok = all(r["rel"] <= 2e-2 and r["nonfinite"] == 0 and r["slack_max_abs"] == 0.0 for r in report.values())
    return ok, report


CHECKS = [
    # (lengths, capacity, dim, causal, logit, num_ctas); num_ctas=None is the SM count.
    ([0, 1, 63, 64, 65, 0, 7, 130, 1000, 3], 1400, 64, False, None, None),
    ([0, 1, 63, 64, 65, 0, 7, 130, 1000, 3], 1403, 128, True, None, None),
    ([0, 0, 0], 64, 128, True, None, None),
    ([64, 192], 264, 128, False, -12.0, None),
    ([64, 192], 264, 128, True, -20.0, None),
    # Few persistent CTAs: each walks many items (ring and hand-off barriers over rounds).
    ([0, 1, 63, 64, 65, 0, 7, 130, 1000, 3], 1400, 64, False, None, 5),
    ([0, 1, 63, 64, 65, 0, 7, 130, 1000, 3], 1403, 128, True, None, 5),
    # The long-tailed benchmark case itself (several items per CTA).
    ("long_tailed_b64", None, 128, False, None, None),
    ("long_tailed_b64", None, 128, True, None, None),
]


def run_checks(record, selected):
    all_ok = True
    for index, (lengths, capacity, dim, causal, logit, num_ctas) in enumerate(CHECKS):
        if index not in selected:
            continue
        if isinstance(lengths, str):
            name = f"{lengths} D={dim} causal={causal}"
            lengths = CASES[lengths][0]()
            capacity = -(-int(np.sum(lengths)) // 8) * 8
        else:
            name = f"L={lengths} T={capacity} D={dim} causal={causal} logit={logit} ctas={num_ctas}"
        try:
            seed = int(time.time()) % 1000
            ok, report = check_case(lengths, capacity, dim, causal, logit, seed=seed, num_ctas=num_ctas)
        except Exception as e:
            traceback.print_exc()
            ok, report = False, {"error": f"{type(e).__name__}: {e}"[:2000]}
        all_ok &= ok
        record["checks"].append({"case": name, "ok": ok, "report": report})
        rels = {k: round(v["rel"], 5) for k, v in report.items() if isinstance(v, dict)}
        print(f"check {'OK ' if ok else 'BAD'} {name}: {rels or report}", flush=True)
    return all_ok


# --- benchmark ----------------------------------------------------------------------------------


def bench_case(name, causal, iters, record, impls):
    make_lengths, n = CASES[name]
    lengths = make_lengths()
    capacity = -(-int(lengths.sum()) // 8) * 8
    flops = real_flops(lengths, causal)
    packed = packed_inputs(lengths, capacity, DIM, seed=1, poison=False)
    padded = [to_padded(x, lengths, n) for x in packed]
    entry = {
        "case": name,
        "causal": causal,
        "batch": int(lengths.size),
        "capacity_T": capacity,
        "max_seq_len_N": n,
        "heads": HEADS,
        "head_dim": DIM,
        "dtype": "bfloat16",
        "lengths_mean": float(lengths.mean()),
        "lengths_median": float(np.median(lengths)),
        "lengths_max": int(lengths.max()),
        "padding_waste": 1.0 - float(lengths.sum()) / (lengths.size * n),
        "real_fwd_flops": flops,
        "impls": {},
    }
    for impl, (layout, f) in make_impls(lengths, n, causal).items():
        if impl not in impls:
            continue
        args = packed if layout == "packed" else padded
        res = {}
        for mode in ("fwd", "fwd_bwd"):
            fn = jax.jit(f) if mode == "fwd" else jax.jit(_timing.forward_backward(f))
            a = tuple(args[:3]) if mode == "fwd" else tuple(args)
            try:
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                compile_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                n_iter = int(np.clip(0.3 / max(time.perf_counter() - t0, 1e-6), 3, iters))
                dev = _timing.device_ms(fn, a, n_iter)
                wall = wall_ms(fn, a, n_iter)
                work = flops * (1.0 if mode == "fwd" else 3.5)
                res[mode] = {
                    "device_ms": dev,
                    "wall_ms": wall,
                    "device_tflops": work / (dev * 1e-3) / 1e12 if dev else None,
                    "wall_tflops": work / (wall * 1e-3) / 1e12,
                    "first_call_s": compile_s,
                }
                if impl == "jfa_pallas":
                    res[mode]["kernels_us"] = _timing.kernel_breakdown_us(fn, a)
            except Exception as e:
                traceback.print_exc()
                res[mode] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            r = res[mode]
            if "error" in r:
                print(f"  {name} causal={causal} {impl:18s} {mode:8s} ERROR", flush=True)
            else:
                dev_s = f"{r['device_ms']:.3f}" if r["device_ms"] else "n/a"
                dev_t = f"{r['device_tflops']:.1f}" if r["device_tflops"] else "n/a"
                print(
                    f"  {name} causal={causal} {impl:18s} {mode:8s} device {dev_s} ms ({dev_t} TF/s)"
                    f" wall {r['wall_ms']:.3f} ms ({r['wall_tflops']:.1f} TF/s)",
                    flush=True,
                )
        entry["impls"][impl] = res
    for mode in ("fwd", "fwd_bwd"):
        for metric in ("device_ms", "wall_ms"):
            peers = [
                r[mode][metric]
                for i, r in entry["impls"].items()
                if i not in ("jfa_pallas", "jfa_xla", "cudnn_padded") and r.get(mode, {}).get(metric)
            ]
            ours = entry["impls"].get("jfa_pallas", {}).get(mode, {}).get(metric)
            if peers and ours:
                entry.setdefault("speedup_vs_best_peer", {}).setdefault(mode, {})[metric] = min(peers) / ours
    record["cases"].append(entry)
    print(f"  speedup vs best correct peer: {entry.get('speedup_vs_best_peer')}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--cases", default=",".join(f"{c}:{m}" for c in CASES for m in (0, 1)), help="name:causal,...")
    parser.add_argument("--impls", default="jfa_pallas,cudnn_lengths,cudnn_padded,xla_padded_masked,jfa_xla")
    parser.add_argument("--checks", default=",".join(str(i) for i in range(len(CHECKS))), help="indices into CHECKS; '' for none")
    parser.add_argument("--time-budget", type=float, default=1e9, help="seconds; later cases are skipped")
    args = parser.parse_args()
    dev = jax.devices()[0]
    record = {
        "benchmark": "jagged flash attention",
        "gpu": dev.device_kind,
        "sm_count": getattr(dev, "core_count", None),
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "checks": [],
        "cases": [],
    }
    out = Path(args.out)

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))

    selected = {int(i) for i in args.checks.split(",") if i}
    if selected:
        record["checks_ok"] = run_checks(record, selected)
        save()
    start = time.perf_counter()
    impls = set(args.impls.split(","))
    for spec in args.cases.split(","):
        name, causal = spec.split(":")
        causal = bool(int(causal))
        if time.perf_counter() - start > args.time_budget:
            print(f"time budget spent: skipping {spec}", flush=True)
            record.setdefault("skipped", []).append(spec)
            continue
        # The XLA paths of the 1024-sequence case take long and tell nothing new.
        case_impls = impls - {"xla_padded_masked", "jfa_xla"} if name == "gem_like_b1024" else impls
        bench_case(name, causal, args.iters, record, case_impls)
        save()
    save()


if __name__ == "__main__":
    main()
