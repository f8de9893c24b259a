"""GDPA on one GPU: the Mosaic GPU kernels beside XLA's compiled jnp GDPA and cuDNN softmax attention.

Shapes (H = 4, D = 128, bf16): the three of ../shared/BASELINES.md (cross
256x1024x64, pooled 256x32x1024 with shared learned queries, self 128x512x512)
and a jagged production-like batch (B = 1024, query lengths uniform in
[0, 1000] so about half of a padded batch is empty, 256 keys per sequence).

Reports forward, forward+backward and (their difference) backward times, as wall
time (median of 3 repetitions of 5 back-to-back calls: launch gaps and the XLA ops
that build the work list included) and CUPTI device time (the kernels of one call),
in TFLOP/s of real work (forward 4 * sum_b Lq_b Lkv_b * H * D; backward 2.5x, for
its five products against the forward's two) and as a fraction of a bf16 GEMM
(8192^3 jnp.dot) timed in the same run, with each kernel's time for our calls.
Also checks the kernels against the float32 reference on every shape and on a
small jagged batch with NaN slack in each of `CHECK_FORMS` (GELU, GELU with
`output_scale`, causal SiLU with HSTU's 1/N), forward and gradients. `--sweep` also times the forward under each
tiling of `FORWARD_VARIANTS`.

    PYTHONPATH=. python3 benchmarks/gdpa_bench.py --out benchmarks/results/gdpa_h200.json [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import dataclasses
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _timing
from gem_jax.jagged import offsets_from_lengths
from pallas_kernels.gdpa import config, ops

H, D = 4, 128
DTYPE = jnp.bfloat16
DEVICE_ITERS = 10


def gemm_ceiling() -> dict:
    n = 8192
    a = jax.random.normal(jax.random.key(0), (n, n), DTYPE)
    b = jax.random.normal(jax.random.key(1), (n, n), DTYPE)
    t = _timing.wall_seconds(jax.jit(lambda a, b: a @ b), a, b)
    return {"shape": [n, n, n], "seconds": t, "tflops": 2 * n**3 / t / 1e12}


def make_case(name: str, rng: np.random.Generator) -> dict:
    """Inputs of one benchmark shape: jagged q/k/v, offsets, padded copies for cuDNN."""
    if name == "cross":
        q_lens, kv_lens, broadcast = np.full(256, 1024), np.full(256, 64), False
    elif name == "pooled":
        q_lens, kv_lens, broadcast = np.full(256, 32), np.full(256, 1024), True
    elif name == "self":
        q_lens, kv_lens, broadcast = np.full(128, 512), np.full(128, 512), False
    elif name == "jagged":
        q_lens, kv_lens, broadcast = rng.integers(0, 1001, 1024), np.full(1024, 256), False
    else:
        raise ValueError(name)
    batch = len(kv_lens)
    max_q, max_kv = (1000 if name == "jagged" else int(q_lens.max())), int(kv_lens.max())
    keys = jax.random.split(jax.random.key(len(name)), 4)
    # A jagged batch lives in a fixed-capacity buffer: the real rows, then slack up to a multiple of 128.
    tq = int(q_lens[0]) if broadcast else -(-int(q_lens.sum()) // 128) * 128
    q = jax.random.normal(keys[0], (tq, H, D), DTYPE)
    k = jax.random.normal(keys[1], (int(kv_lens.sum()), H, D), DTYPE)
    v = jax.random.normal(keys[2], (int(kv_lens.sum()), H, D), DTYPE)
    out_rows = batch * int(q_lens[0]) if broadcast else tq
    d_out = jax.random.normal(keys[3], (out_rows, H, D), DTYPE)
    offsets = lambda lens: jnp.asarray(offsets_from_lengths(lens))
    return dict(
        name=name,
        q=q,
        k=k,
        v=v,
        d_out=d_out,
        q_offsets=None if broadcast else offsets(q_lens),
        kv_offsets=offsets(kv_lens),
        q_lens=q_lens,
        kv_lens=kv_lens,
        kw=dict(max_seq_len_q=max_q, max_seq_len_kv=max_kv, broadcast_q=broadcast),
        fwd_flops=4.0 * float(np.sum(q_lens.astype(np.float64) * kv_lens)) * H * D,
    )


def gdpa_fns(case: dict, impl: str):
    kw = dict(case["kw"], activation="gelu", implementation=impl)
    qo, ko = case["q_offsets"], case["kv_offsets"]

    def fwd(q, k, v):
        return ops.gdpa(q, k, v, qo, ko, **kw)

    def fwd_bwd(q, k, v, d_out):
        out, vjp = jax.vjp(fwd, q, k, v)
        return out, vjp(d_out)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def cudnn_fns(case: dict):
    """cuDNN flash attention (softmax) on the padded `[B, L, H, D]` version of the same batch."""
    batch = len(case["kv_lens"])
    max_q = case["kw"]["max_seq_len_q"]
    max_kv = case["kw"]["max_seq_len_kv"]
    rng = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(rng[0], (batch, max_q, H, D), DTYPE)
    k = jax.random.normal(rng[1], (batch, max_kv, H, D), DTYPE)
    v = jax.random.normal(rng[2], (batch, max_kv, H, D), DTYPE)
    d_out = jax.random.normal(rng[3], q.shape, DTYPE)
    q_len = jnp.asarray(case["q_lens"], jnp.int32)
    kv_len = jnp.asarray(case["kv_lens"], jnp.int32)
    jagged = case["name"] == "jagged"

    def fwd(q, k, v):
        lens = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len) if jagged else {}
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **lens)

    def fwd_bwd(q, k, v, d_out):
        out, vjp = jax.vjp(fwd, q, k, v)
        return out, vjp(d_out)

    return (jax.jit(fwd), jax.jit(fwd_bwd)), (q, k, v, d_out)


def relative_error(got, want) -> float:
    got = jnp.asarray(got, jnp.float32)
    want = jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-6))


def check(case: dict, ours, ref) -> dict:
    names = ("out", "dq", "dk", "dv")
    ours = (ours[0], *ours[1])
    ref = (ref[0], *ref[1])
    return {
        n: {"rel_max_err": relative_error(a, b), "nan": bool(jnp.isnan(jnp.asarray(a, jnp.float32)).any())}
        for n, a, b in zip(names, ours, ref)
    }


def run_case(case: dict, gemm_tflops: float) -> dict:
    result = {"shape": case["name"], "batch": len(case["kv_lens"]), "heads": H, "head_dim": D}
    result.update({k: v for k, v in case["kw"].items()})
    result["real_q_rows"] = int(case["q_lens"].sum()) if not case["kw"]["broadcast_q"] else int(case["q_lens"].sum())
    result["fwd_gflop"] = case["fwd_flops"] / 1e9
    args = (case["q"], case["k"], case["v"])
    flops = {"fwd": case["fwd_flops"], "fwd_bwd": 3.5 * case["fwd_flops"], "bwd": 2.5 * case["fwd_flops"]}
    impls = {}
    for impl in ("pallas", "xla"):
        fwd, fwd_bwd = gdpa_fns(case, impl)
        impls[impl] = (fwd, fwd_bwd)
    (cf, cfb), cargs = cudnn_fns(case)
    runs = {
        "pallas": (impls["pallas"], args),
        "xla_gelu": (impls["xla"], args),
        "cudnn_softmax": ((cf, cfb), cargs[:3]),
    }
    for name, ((fwd, fwd_bwd), a) in runs.items():
        entry = {}
        try:
            d_out = case["d_out"] if name != "cudnn_softmax" else cargs[3]
            entry["fwd_ms"] = _timing.wall_seconds(fwd, *a) * 1e3
            entry["fwd_bwd_ms"] = _timing.wall_seconds(fwd_bwd, *a, d_out) * 1e3
            entry["fwd_device_ms"] = _timing.device_ms(fwd, a, DEVICE_ITERS)
            entry["fwd_bwd_device_ms"] = _timing.device_ms(fwd_bwd, (*a, d_out), DEVICE_ITERS)
            if entry["fwd_device_ms"] and entry["fwd_bwd_device_ms"]:
                entry["bwd_device_ms"] = entry["fwd_bwd_device_ms"] - entry["fwd_device_ms"]
            if name == "pallas":
                entry["fwd_kernels_us"] = _timing.kernel_breakdown_us(fwd, a)
                entry["fwd_bwd_kernels_us"] = _timing.kernel_breakdown_us(fwd_bwd, (*a, d_out))
            entry["bwd_ms"] = entry["fwd_bwd_ms"] - entry["fwd_ms"]
            for part in ("fwd", "fwd_bwd", "bwd"):
                if entry[f"{part}_ms"] <= 0:
                    continue
                tf = flops[part] / (entry[f"{part}_ms"] * 1e-3) / 1e12
                entry[f"{part}_tflops"] = tf
                entry[f"{part}_of_gemm"] = tf / gemm_tflops
        except Exception as e:  # keep the other implementations' numbers
            entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            traceback.print_exc()
        result[name] = entry
        print(f"  {case['name']:7s} {name:14s} {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})}", flush=True)
    try:
        ours = impls["pallas"][1](*args, case["d_out"])
        ref = impls["xla"][1](*args, case["d_out"])
        result["check_vs_reference"] = check(case, ours, ref)
    except Exception as e:
        result["check_vs_reference"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    print(f"  {case['name']:7s} check {result['check_vs_reference']}", flush=True)
    for part in ("fwd", "bwd", "fwd_device", "bwd_device"):
        for peer in ("xla_gelu", "cudnn_softmax"):
            try:
                result[f"{part}_speedup_vs_{peer}"] = result[peer][f"{part}_ms"] / result["pallas"][f"{part}_ms"]
            except (KeyError, TypeError, ZeroDivisionError):
                pass
    return result


# The forms the small jagged check runs: each activation path the kernels specialise on, the
# causal (HSTU) walk, and output_scale in the kernels' last step.
CHECK_FORMS = {
    "gelu": dict(activation="gelu"),
    "gelu_output_scale": dict(activation="gelu", output_scale=0.25),
    "silu_causal_hstu": dict(activation="silu", causal=True, output_scale=1 / 320),
}


def small_jagged_check(forms=CHECK_FORMS) -> dict:
    """Forward and gradients of each of `forms` against the float32 reference on a jagged batch
    with empty sequences (on either side), lengths off the tile sizes, keys past the column ring
    and NaN slack rows in q, k, v and the cotangent. Per form and output: the max relative error
    on the real rows, whether the slack rows are zero, and whether any NaN came out."""
    q_lens, kv_lens = [70, 0, 130, 5, 64, 9, 300], [40, 17, 0, 64, 33, 1, 200]
    keys = jax.random.split(jax.random.key(3), 4)
    tq = sum(q_lens)
    q = jax.random.normal(keys[0], (tq + 5, H, D), DTYPE).at[tq:].set(jnp.nan)
    d_out = jax.random.normal(keys[3], (tq + 5, H, D), DTYPE).at[tq:].set(jnp.nan)
    qo = jnp.asarray(offsets_from_lengths(q_lens))
    results = {}
    for name, kw in forms.items():
        kv_side = q_lens if kw.get("causal") else kv_lens  # causal: self-attention, one set of offsets
        tkv = sum(kv_side)
        k = jax.random.normal(keys[1], (tkv + 3, H, D), DTYPE).at[tkv:].set(jnp.nan)
        v = jax.random.normal(keys[2], (tkv + 3, H, D), DTYPE).at[tkv:].set(jnp.nan)
        ko = jnp.asarray(offsets_from_lengths(kv_side))
        got = {}
        for impl in ("pallas", "xla"):
            f = lambda q, k, v: ops.gdpa(q, k, v, qo, ko, max_seq_len_q=320, max_seq_len_kv=max(kv_side), implementation=impl, **kw)
            out, vjp = jax.vjp(f, q, k, v)
            got[impl] = (out, *vjp(d_out))
        rows = (tq, tq, tkv, tkv)
        results[name] = {
            n: {
                "rel_max_err": relative_error(a[:r], b[:r]),
                "slack_zero": bool(jnp.all(jnp.asarray(a[r:], jnp.float32) == 0)),
                "nan": bool(jnp.isnan(jnp.asarray(a, jnp.float32)).any()),
            }
            for n, a, b, r in zip(("out", "dq", "dk", "dv"), got["pallas"], got["xla"], rows)
        }
        print(f"  small jagged {name}: {results[name]}", flush=True)
    return results


# Forward tilings tried by --sweep (overrides of `config.choose`'s pick; the ring
# gives up column slots when the rows need the shared memory).
FORWARD_VARIANTS = {
    "default": {},
    "row_slots3": {"row_slots": 3},
    "row_slots4": {"row_slots": 4},
    "cols64": {"block_cols": 64},
    "cols64_row_slots3": {"block_cols": 64, "row_slots": 3},
    # Items by their own work, as cross and pooled attention deal them (the causal forward deals them by sequence).
    "items2": {"row_tiles_per_item": 2, "group_sequences": False},
    "items4": {"row_tiles_per_item": 4, "group_sequences": False},
    "items8": {"row_tiles_per_item": 8, "group_sequences": False},
    "cols64_ring4": {"block_cols": 64, "col_slots": 4},
    "cols64_ring5": {"block_cols": 64, "col_slots": 5},
    # A sequence's items dealt together, heaviest sequence first (`TileConfig.group_sequences`): neighbouring
    # CTAs stream the same keys at about the same time.
    "grouped_items1": {"row_tiles_per_item": 1, "group_sequences": True},
    "grouped_items2": {"row_tiles_per_item": 2, "group_sequences": True},
}


def forward_tiling(overrides: dict, chosen: list):
    """A `config.choose` that applies `overrides` to the forward pass only (records what it picked)."""
    real = config.choose

    def choose(**kw):
        if kw["n_row_inputs"] != 1:  # dQ and dK/dV keep their tiling
            return real(**kw)
        cfg = real(**{**kw, "block_cols": overrides.get("block_cols", kw.get("block_cols"))})
        cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if k != "block_cols"})

        def fits(c):
            smem = config.smem_bytes(c, head_dim=kw["head_dim"], itemsize=kw["itemsize"], n_row_inputs=1, n_col_inputs=2)
            return smem <= config.SMEM_BUDGET

        while not fits(cfg) and cfg.col_slots > 2:
            cfg = dataclasses.replace(cfg, col_slots=cfg.col_slots - 1)
        if not fits(cfg):
            raise ValueError(f"{overrides} does not fit in shared memory")
        chosen.append(dataclasses.asdict(cfg))
        return cfg

    return choose


def sweep_tilings(make_forward, args, want, label: str, *, device: bool = True) -> dict:
    """Forward device and wall time of each `FORWARD_VARIANTS` tiling, with its error against `want`.

    make_forward: `() -> jitted forward of args`, built anew for each tiling (the ops' lowering is
    cached per trace). `device=False` (the interpreter) leaves out CUPTI's device time. A variant
    that fails (e.g. does not fit in shared memory) records its error and the sweep goes on.
    """
    results = {}
    real = config.choose
    for name, overrides in FORWARD_VARIANTS.items():
        chosen = []
        config.choose = forward_tiling(overrides, chosen)
        jax.clear_caches()  # the ops' cached lowering would reuse the last variant's trace
        try:
            fwd = make_forward()
            got = fwd(*args)
            if not chosen:
                raise RuntimeError("the forward was not traced under this tiling (a cached lowering was reused)")
            results[name] = {
                "tiling": chosen[-1],
                "device_ms": _timing.device_ms(fwd, args, DEVICE_ITERS) if device else None,
                "wall_ms": _timing.wall_seconds(fwd, *args) * 1e3,
                "rel_max_err": relative_error(got, want),
            }
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        finally:
            config.choose = real
            jax.clear_caches()
        print(f"  {label:7s} sweep {name:18s} {results[name]}", flush=True)
    return results


def sweep_forward(case: dict) -> dict:
    """`sweep_tilings` of the case's forward, against XLA's."""
    args = (case["q"], case["k"], case["v"])
    want = gdpa_fns(case, "xla")[0](*args)
    return sweep_tilings(lambda: gdpa_fns(case, "pallas")[0], args, want, case["name"])


def with_smem_fallback(fn):
    """Runs `fn`; if the kernels do not fit in shared memory, retries once with a smaller budget."""
    try:
        return fn()
    except Exception as e:
        if "shared memory" not in str(e).lower() and "smem" not in str(e).lower():
            raise
        print(f"shared memory overflow at budget {config.SMEM_BUDGET}; retrying at 192 KiB", flush=True)
        config.SMEM_BUDGET = 192 * 1024
        return fn()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="cross,pooled,self,jagged")
    parser.add_argument("--budget-s", type=float, default=600.0, help="start no new shape after this many seconds")
    parser.add_argument("--sweep", action="store_true", help="also time the forward under each of FORWARD_VARIANTS")
    args = parser.parse_args()
    device = jax.devices()[0]
    report = {
        "benchmark": "gdpa",
        "gpu": device.device_kind,
        "sm_count": getattr(device, "core_count", None),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "bfloat16",
        "activation": "gelu (tanh) for GDPA; softmax for cuDNN",
        "timing": "wall: median of 3 repetitions of 5 back-to-back calls after a warm-up call; device: CUPTI kernel time of one call, median of 10",
        "flops": "fwd = 4 sum_b Lq_b Lkv_b H D (real work only); bwd = 2.5 fwd; fwd_bwd = 3.5 fwd",
        "smem_budget_bytes": config.SMEM_BUDGET,
        "cases": [],
    }

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    report["gemm_bf16"] = gemm_ceiling()
    gemm = report["gemm_bf16"]["tflops"]
    print(f"bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s", flush=True)
    save()
    try:
        report["small_jagged_check"] = with_smem_fallback(small_jagged_check)
        report["smem_budget_bytes"] = config.SMEM_BUDGET
    except Exception as e:
        report["small_jagged_check"] = {"error": f"{type(e).__name__}: {str(e)[:3000]}"}
        traceback.print_exc()
        save()
        sys.exit("the kernels fail on a small batch; not benchmarking")
    save()
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for name in args.shapes.split(","):
        if time.perf_counter() - start > args.budget_s:
            print(f"skipping {name}: over the time budget", flush=True)
            continue
        case = make_case(name, rng)
        print(f"{name}: fwd {case['fwd_flops'] / 1e9:.1f} GFLOP", flush=True)
        report["cases"].append(run_case(case, gemm))
        save()
        if args.sweep:
            report["cases"][-1]["forward_sweep"] = sweep_forward(case)
            save()
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
