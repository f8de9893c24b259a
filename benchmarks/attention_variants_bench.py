"""Long-history attention variants on one Hopper GPU: block-local (RoPE fused), sliding-window JFA, peers.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/attention_variants_bench.py --out benchmarks/results/attention_variants_h200.json

and on a CPU (Mosaic GPU interpret mode, tiny shapes, no cuDNN) to check the script itself::

    PYTHONPATH=. python3 benchmarks/attention_variants_bench.py --cpu-smoke --out /tmp/attention_variants_smoke.json

`--only block_local` runs only the block-local checks (RoPE at default and at given positions, no
RoPE) and times only
block_local_pallas beside full_jfa_pallas (the ratio the block-local kernels are judged by), each
also forward alone (`forward_ms`) and kernel by kernel (`kernels_us`), to split the time between the
kernels and the XLA work around them::

    PYTHONPATH=. python3 benchmarks/attention_variants_bench.py --only block_local --out /tmp/block_local.json

1. Correctness (bf16 kernels against the float32 jnp reference, forward and dQ/dK/dV; lengths
   0, 1, 63, 64, 65, 130, 200; slack rows NaN-poisoned and required to come back 0):
   block_local with RoPE (default and given positions) and without, sliding-window JFA causal
   (w, 0) and two-sided, and causal SiLU GDPA (HSTU pointwise attention).
2. Timing, forward+backward (`jax.vjp` of the layer: its output and the grads w.r.t. q, k, v, the
   output kept so no forward is dropped as dead code: `_timing.forward_backward`), bf16, H=4, D=128,
   long-tailed lengths clip(lognormal(log 600, 1.0), 8, 4096):

   block_local_pallas   ours, RoPE fused in the kernels
   block_local_xla      what a JAX user writes: apply_rope, gather into [NB, 64, H, D] blocks,
                        batched einsum + masked softmax, scatter back
   window_pallas        sliding-window JFA, causal (W, 0), apply_rope unfused
   window_cudnn         jax.nn.dot_product_attention(implementation="cudnn", local_window_size=(W, 0),
                        query_seq_lengths, key_value_seq_lengths) on a padded copy, apply_rope unfused
   full_jfa_pallas      causal JFA over the whole history, apply_rope unfused
   causal_silu_pallas   causal SiLU GDPA over the whole history (HSTU), apply_rope unfused

Effective TFLOP/s count real work only: 4 H D per attended (query, key) pair for the forward,
3.5x for forward+backward (block: sum of block_len^2; window: sum_i min(i, W) + 1; full causal:
L (L + 1) / 2). The block variants also report GB/s over their least HBM traffic: q, k, v read and
out written by the forward, q, k, v, dout read and dq, dk, dv written by the backward (11 [T, H, D]
tensors of real rows; 4 for the forward alone). A forward alone is the layer's own call (the unfused
peers' apply_rope included). Device time from CUPTI (`benchmarks/_timing.py`), wall time as a
fallback. A failing variant records its error and the run goes on; no timed variant starts after
--budget-s seconds (default 260). Writes JSON to --out; prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _timing
from pallas_kernels import block_local_attention, gdpa, jagged_flash_attention
from pallas_kernels.block_local_attention.reference import rope
from pallas_kernels.jagged_layout import positions_in_sequence

EDGE_LENGTHS = [0, 1, 63, 64, 65, 130, 200]
ROPE_BASE = 10_000.0

# --only NAME: (correctness cases, timed layers) of a subset; without --only, every one of both. A subset's
# layers are also timed forward alone (`forward_ms`, `forward_wall_ms`), with the device time of each kernel
# of one forward+backward call (`kernels_us`: [name, us] in launch order; CUPTI).
SUBSETS = {
    "block_local": (("block_local_rope", "block_local_rope_positions", "block_local_plain"),
                    ("block_local_pallas", "full_jfa_pallas")),
}


def offsets_of(lengths) -> jnp.ndarray:
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def inputs(lengths, capacity, heads, dim, seed):
    """q, k, v, dout bf16 `[capacity, H, D]`, rows past the real data NaN."""
    end = int(np.sum(lengths))
    return [
        jax.random.normal(key, (capacity, heads, dim), jnp.float32).astype(jnp.bfloat16).at[end:].set(jnp.nan)
        for key in jax.random.split(jax.random.key(seed), 4)
    ]


def pairs(lengths, kind: str, size: int = 0) -> float:
    n = np.asarray(lengths, np.float64)
    if kind == "block":
        return float(np.sum((n // size) * size**2 + (n % size) ** 2))
    if kind == "window":
        head = np.minimum(n, size + 1)
        return float(np.sum(head * (head + 1) / 2 + (n - head) * (size + 1)))
    return float(np.sum(n * (n + 1) / 2))


# --- the layers under test: (q, k, v) -> out, all with RoPE on q and k -------------------------


def layers(offsets, max_seq_len: int, capacity: int, window: int):
    pos = positions_in_sequence(offsets, capacity)
    roped = lambda q, k: (rope(q, pos, ROPE_BASE), rope(k, pos, ROPE_BASE))

    def block_pallas(q, k, v):
        return block_local_attention(q, k, v, offsets, max_seq_len=max_seq_len, rope_base=ROPE_BASE,
                                     implementation="pallas")

    def block_xla(q, k, v):
        q, k = roped(q, k)
        return block_einsum(q, k, v, offsets, capacity)

    def window_pallas(q, k, v):
        q, k = roped(q, k)
        return jagged_flash_attention(q, k, v, offsets, max_seq_len=max_seq_len, causal=True, window=(window, 0),
                                      implementation="pallas")

    def window_cudnn(q, k, v):
        q, k = roped(q, k)
        return jagged_flash_attention(q, k, v, offsets, max_seq_len=max_seq_len, causal=True, window=(window, 0),
                                      implementation="cudnn")

    def full_pallas(q, k, v):
        q, k = roped(q, k)
        return jagged_flash_attention(q, k, v, offsets, max_seq_len=max_seq_len, causal=True, implementation="pallas")

    def silu_pallas(q, k, v):
        q, k = roped(q, k)
        return gdpa(q, k, v, offsets, offsets, max_seq_len_q=max_seq_len, max_seq_len_kv=max_seq_len, activation="silu",
                    causal=True, scale=q.shape[-1] ** -0.5, output_scale=1 / max_seq_len, implementation="pallas")

    return {
        "block_local_pallas": (block_pallas, ("block", 64)),
        "block_local_xla": (block_xla, ("block", 64)),
        "window_pallas": (window_pallas, ("window", window)),
        "window_cudnn": (window_cudnn, ("window", window)),
        "full_jfa_pallas": (full_pallas, ("full", 0)),
        "causal_silu_pallas": (silu_pallas, ("full", 0)),
    }


def block_einsum(q, k, v, offsets, capacity: int, block: int = 64):
    """64-row block attention as batched einsums over gathered blocks (a JAX user's version)."""
    lengths = offsets[1:] - offsets[:-1]
    per_seq = (lengths + block - 1) // block
    slots = (capacity + (block - 1) * lengths.shape[0]) // block
    first = jnp.cumsum(per_seq) - per_seq
    seq = jnp.clip(jnp.searchsorted(first, jnp.arange(slots), side="right") - 1, 0, lengths.shape[0] - 1)
    j = jnp.arange(slots) - first[seq]
    live = jnp.arange(slots) < jnp.sum(per_seq)
    r = jnp.arange(block)
    rows = offsets[seq][:, None] + j[:, None] * block + r[None, :]
    valid = live[:, None] & (j[:, None] * block + r[None, :] < lengths[seq][:, None])
    idx = jnp.where(valid, rows, 0)
    qb, kb, vb = (jnp.where(valid[..., None, None], x[idx], 0) for x in (q, k, v))  # [NB, 64, H, D]
    s = jnp.einsum("nqhd,nkhd->nhqk", qb, kb, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(valid[:, None, None, :], p, 0.0).astype(q.dtype)
    out = jnp.einsum("nhqk,nkhd->nqhd", p, vb)
    target = jnp.where(valid, rows, capacity)  # invalid rows scatter out of range: dropped
    return jnp.zeros_like(q).at[target.reshape(-1)].set(out.reshape(-1, *q.shape[1:]), mode="drop")


# --- correctness ------------------------------------------------------------------------------


def value_and_grads(fn, q, k, v, dout):
    return [np.asarray(x.astype(jnp.float32)) for x in _timing.forward_backward(fn)(q, k, v, dout)]


def check(name, kernel_fn, reference_fn, q, k, v, dout, end):
    """Kernel on bf16 inputs vs the reference on their float32 values; rel. max error per tensor."""
    got = value_and_grads(jax.jit(kernel_fn), q, k, v, dout)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    want = value_and_grads(jax.jit(reference_fn), *f32)
    result = {}
    for tensor, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        result[tensor] = {
            "rel_err": float(np.max(np.abs(g[:end] - w[:end])) / max(float(np.max(np.abs(w[:end]))), 1e-9)) if end else 0.0,
            "finite": bool(np.all(np.isfinite(g))),
            "slack_zero": bool(np.all(g[end:] == 0)),
        }
    ok = all(r["finite"] and r["slack_zero"] and r["rel_err"] < 3e-2 for r in result.values())
    return {"ok": ok, **result}


def correctness(heads, dim, names=None):
    """The correctness cases, or only those in `names`; the XLA peer's own check runs with all of them."""
    lengths = EDGE_LENGTHS
    capacity = sum(lengths) + 29
    offsets = offsets_of(lengths)
    q, k, v, dout = inputs(lengths, capacity, heads, dim, 1)
    end = sum(lengths)
    kw = dict(max_seq_len=max(lengths))
    cases = {
        "block_local_rope": lambda impl: lambda q, k, v: block_local_attention(
            q, k, v, offsets, rope_base=ROPE_BASE, implementation=impl, **kw),
        # given positions (angles to about 2e5 here): the kernels' tables take CUDA's sin/cos, not bounded_trig's
        "block_local_rope_positions": lambda impl: lambda q, k, v: block_local_attention(
            q, k, v, offsets, rope_base=ROPE_BASE, positions=positions_in_sequence(offsets, capacity) * 997 + 3,
            implementation=impl, **kw),
        "block_local_plain": lambda impl: lambda q, k, v: block_local_attention(q, k, v, offsets, implementation=impl, **kw),
        "window_causal_w100": lambda impl: lambda q, k, v: jagged_flash_attention(
            q, k, v, offsets, causal=True, window=(100, 0), implementation=impl, **kw),
        "window_two_sided_70_5": lambda impl: lambda q, k, v: jagged_flash_attention(
            q, k, v, offsets, window=(70, 5), implementation=impl, **kw),
        "window_causal_w1": lambda impl: lambda q, k, v: jagged_flash_attention(
            q, k, v, offsets, causal=True, window=(1, 0), implementation=impl, **kw),
        "causal_silu_gdpa": lambda impl: lambda q, k, v: gdpa(
            q, k, v, offsets, offsets, max_seq_len_q=max(lengths), max_seq_len_kv=max(lengths), activation="silu",
            causal=True, scale=0.1, implementation=impl),
    }
    results = {}
    for name, make in cases.items():
        if names is not None and name not in names:
            continue
        results[name] = guarded(lambda: check(name, make("pallas"), make("xla"), q, k, v, dout, end))
        print(f"  check {name}: {summary_of_check(results[name])}", flush=True)
    if names is not None:
        return results
    name = "block_einsum_peer"  # the timed XLA peer must compute the same thing
    results[name] = guarded(lambda: check(name, lambda q, k, v: block_einsum(q, k, v, offsets, capacity),
                                          cases["block_local_plain"]("xla"), q, k, v, dout, end))
    print(f"  check {name}: {summary_of_check(results[name])}", flush=True)
    return results


def summary_of_check(r):
    if "error" in r:
        return "ERROR " + r["error"].splitlines()[-1][:120]
    errs = " ".join(f"{t}={r[t]['rel_err']:.1e}" for t in ("out", "dq", "dk", "dv"))
    return ("ok " if r["ok"] else "FAIL ") + errs


def guarded(f):
    try:
        return f()
    except Exception as e:  # record, go on
        return {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}


# --- timing -----------------------------------------------------------------------------------


def timing(heads, dim, batch, window, iters, smoke, deadline, names=None, forward_names=()):
    """Times every layer of `layers` forward+backward, or only those in `names`; those in
    `forward_names` forward alone too (`forward_ms` device, `forward_wall_ms` wall) and kernel by
    kernel (`kernels_us`, None without CUPTI)."""
    rng = np.random.default_rng(0)
    if smoke:
        lengths = np.array([1, 63, 64, 65, 130, 9], np.int32)
    else:
        lengths = np.clip(rng.lognormal(np.log(600), 1.0, batch), 8, 4096).astype(np.int32)
    capacity = -(-int(lengths.sum()) // 128) * 128
    offsets = offsets_of(lengths)
    max_seq_len = int(lengths.max()) if smoke else 4096
    q, k, v, dout = inputs(lengths, capacity, heads, dim, 2)
    meta = {"batch": int(len(lengths)), "tokens": int(lengths.sum()), "capacity": capacity, "max_len": int(lengths.max()),
            "mean_len": float(lengths.mean()), "heads": heads, "dim": dim, "window": window}
    print(f"  lengths: {meta}", flush=True)
    results = {}
    for name, (fn, (kind, size)) in layers(offsets, max_seq_len, capacity, window).items():
        if names is not None and name not in names:
            continue
        if smoke and name == "window_cudnn":
            results[name] = {"skipped": "cuDNN needs an NVIDIA GPU"}
            continue
        if time.perf_counter() > deadline:
            results[name] = {"skipped": "time budget (--budget-s) spent"}
            print(f"  {name:20s} skipped: time budget spent", flush=True)
            continue

        def measure(f, args):
            """(device ms or None, wall seconds) of `f(*args)`."""
            ms = None if smoke else _timing.device_ms(f, args, iters)
            return ms, _timing.wall_seconds(f, *args, iters=1 if smoke else iters, reps=1 if smoke else 3)

        def run(name=name, fn=fn, kind=kind, size=size):
            step = jax.jit(_timing.forward_backward(fn))
            t0 = time.perf_counter()
            jax.block_until_ready(step(q, k, v, dout))
            compile_s = time.perf_counter() - t0
            ms, wall = measure(step, (q, k, v, dout))
            flops = 3.5 * 4 * heads * dim * pairs(lengths, kind, size)
            seconds = ms / 1e3 if ms else wall
            record = {"device_ms": ms, "wall_ms": wall * 1e3, "compile_s": compile_s, "real_flops": flops,
                      "tflops": flops / seconds / 1e12}
            tensor_bytes = int(lengths.sum()) * heads * dim * q.dtype.itemsize  # one [T, H, D] tensor's real rows
            if kind == "block":
                least = 11 * tensor_bytes
                record.update(least_hbm_bytes=least, gb_per_s=least / seconds / 1e9)
            if name in forward_names:
                fwd_ms, fwd_wall = measure(jax.jit(fn), (q, k, v))
                kernels = None if smoke else _timing.kernel_breakdown_us(step, (q, k, v, dout))
                record.update(forward_ms=fwd_ms, forward_wall_ms=fwd_wall * 1e3, kernels_us=kernels)
                if kind == "block":
                    record["forward_gb_per_s"] = 4 * tensor_bytes / (fwd_ms / 1e3 if fwd_ms else fwd_wall) / 1e9
            return record

        results[name] = guarded(run)
        r = results[name]
        line = f"ERROR {r['error'].splitlines()[0][:120]}" if "error" in r else (
            f"{r['device_ms'] or r['wall_ms']:.3f} ms  {r['tflops']:.1f} TFLOP/s"
            + (f"  {r['gb_per_s']:.0f} GB/s" if "gb_per_s" in r else "")
            + (f"  forward {r['forward_ms'] or r['forward_wall_ms']:.3f} ms" if "forward_wall_ms" in r else ""))
        print(f"  {name:20s} {line}", flush=True)
    return meta, results


def ratios(results):
    """Effective-TFLOP/s ratios of the targets, with the plain time ratios beside them."""
    done = {n: r for n, r in results.items() if isinstance(r, dict) and r.get("tflops")}
    ms = lambda r: r["device_ms"] or r["wall_ms"]
    pairs_ = [("block_local_pallas", "window_pallas", 1.3), ("block_local_pallas", "full_jfa_pallas", 3.0),
              ("block_local_pallas", "block_local_xla", 1.5), ("window_pallas", "window_cudnn", 1.3)]
    return {
        f"{a}/{b}": {"ratio": done[a]["tflops"] / done[b]["tflops"], "time_speedup": ms(done[b]) / ms(done[a]),
                     "target": target}
        for a, b, target in pairs_ if a in done and b in done
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in Mosaic GPU interpret mode on the CPU")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=260.0, help="start no timed variant after this many seconds")
    parser.add_argument("--only", choices=sorted(SUBSETS),
                        help="run only this subset: block_local = its checks, timed beside full_jfa_pallas")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    checks, timed = SUBSETS[args.only] if args.only else (None, None)
    heads, dim = (1, 64) if smoke else (args.heads, args.dim)
    ctx = contextlib.nullcontext()
    if smoke:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        ctx = plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "smoke": smoke, "only": args.only}
    start = time.perf_counter()
    with ctx:
        print("correctness (bf16 kernels vs float32 reference):", flush=True)
        with jax.default_matmul_precision("highest"):  # a float32 reference, not TF32
            report["correctness"] = correctness(heads, dim, checks)
        print("timing, forward+backward:", flush=True)
        deadline = start + args.budget_s
        report["timing_meta"], report["timing"] = timing(heads, dim, args.batch, args.window, args.iters, smoke, deadline,
                                                         timed, timed or ())
    report["ratios"] = ratios(report["timing"])
    report["total_s"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("summary:")
    print("  correctness: " + ", ".join(f"{n}={'ok' if r.get('ok') else 'FAIL'}" for n, r in report["correctness"].items()))
    for name, r in report["ratios"].items():
        print(f"  {name:42s} {r['ratio']:.2f}x TFLOP/s (target >= {r['target']}x), {r['time_speedup']:.2f}x time")
    print(f"  total {report['total_s']:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
