"""Causal SiLU GDPA (HSTU pointwise attention) against HSTU's own Triton kernel, on one Hopper GPU.

Run on the GPU machine from the repository root, with a copy of generative-recommenders' python
package (`triton_hstu_mha`; it needs torch and triton) in a directory of its own::

    PYTHONPATH=. python3 benchmarks/hstu_bench.py --hstu-src PATH --hstu-commit SHA --out hstu_h200.json [--backward]

and on a CPU (our side only, Mosaic GPU interpret mode, tiny shapes) to check the script itself::

    PYTHONPATH=. python3 benchmarks/hstu_bench.py --cpu-smoke --out /tmp/hstu_smoke.json

What it compares, on the same jagged bf16 inputs (`[T, H, D]` rows of all sequences back to
back, H = 4, D = 128, lengths of `CASES` drawn with numpy seed 0; numpy makes the data, jax
arrays go to ours and CUDA torch tensors to HSTU):

  ours   `pallas_kernels.gdpa(q, k, v, offsets, offsets, activation="silu", causal=True,
         scale=alpha, output_scale=1/N, implementation="pallas")` (the 1/N in the kernels'
         last step: silu is not homogeneous, so 1/N cannot go into `scale`);
         "gdpa_only" is the op without the 1/N.
  HSTU   `triton_hstu_mha(N, alpha, q, k, v, seq_offsets, sort_by_length=True)` from
         generative_recommenders/ops/triton/triton_hstu_attention.py (sort_by_length as HSTU's STU
         layer and its benchmark set it; `fwd_unsorted` is the API default False), which computes
         per sequence and head `out_i = sum_{j <= i} silu(alpha * q_i . k_j) / N * v_j` (the
         diagonal included), with num_targets None, max_attn_len 0 and contextual_seq_len 0
         (plain causal), enable_tma False, seq_offsets int64. Its forward is autotuned over 29
         configurations (its backward over 20) on the first call of each case (autotune key:
         prev_power_of_2(B), H, D; not N unless HSTU's `set_use_runtime_max_seq_len(True)`): that
         first call is timed apart (`first_call_s`) and the chosen configuration recorded.

with alpha = D^-0.5 (HSTU's STU default) and N = the case's length bound (`high`), passed to both.

Checks: ours and HSTU against each other and against the float32 jnp reference
(`pallas_kernels.gdpa.reference` with scale alpha, times 1/N; every sequence, a chunk of
sequences at a time), as max |err| / max |ref| on the real rows; with --backward also dq, dk, dv
(the reference's vjp). A comparison over CHECK_BOUND (2%, bf16 level) or a non-finite output is
flagged in the JSON (`flags`) and printed loudly; its times are still recorded.

Clocks (each number in the JSON names its clock):
  ours device_ms   CUPTI: the summed kernel time of one call (`benchmarks/_timing.py`), median of
                   --iters calls, back to back (warm L2). It includes the XLA kernels that build
                   the work list from the offsets: the offsets are an argument of the jitted
                   function, so nothing of the list is folded into constants.
  ours wall_ms     median of 3 repetitions of --iters back-to-back calls, launch gaps included.
  hstu do_bench_ms `triton.testing.do_bench` median (CUDA events around each call, L2 flushed
                   before each: a colder cache than ours; host time shows where the host, which
                   goes through autograd and a torch custom op, falls behind the GPU).
  hstu kernel_ms   torch.profiler: the summed CUDA kernel time of one call (the Triton kernel and
                   the length sort), mean of --iters back-to-back calls: the same clock as ours'
                   device_ms. Measured after every CUPTI measurement of ours (both use CUPTI).
  hstu wall_ms     as ours' wall_ms, with torch.cuda.synchronize().
Ratios are HSTU time / ours (> 1: ours faster): `device` = kernel_ms / device_ms, `do_bench`
= do_bench_ms / device_ms, `wall` = wall / wall.

TFLOP/s count real work only: 4 H D per attended (query, key) pair, L (L + 1) / 2 pairs per
sequence of length L (forward); forward+backward 3.5x that (seven products against two). The
printout gives each case's work and its time at CEILING_TFLOPS to check times against.

Forward only by default. `--backward` also times forward+backward of both (ours: `jax.vjp` of the
1/N-scaled op; HSTU: `torch.autograd.grad`) and compares the gradients; HSTU's backward runs
last, one case at a time, its errors caught (a CUDA fault ends the process: the JSON is written
after every step). `--sweep` also times our forward under each tiling of
`gdpa_bench.FORWARD_VARIANTS` (rows in flight, column block and ring, row tiles a work item, the
work list grouped by sequence; each against our default tiling's output, in the case's
`ours_forward_sweep`), on the causal cases (gdpa_bench's sweep runs its dense GELU shapes); a
case's sweep runs whole once the case has started (about a compile and 10 timed calls a tiling).
No case starts after --budget-s seconds. Writes JSON to --out: GPU, versions,
date, git commit ($GEM_GIT_COMMIT or git), HSTU's source commit (--hstu-commit), cases, times,
ratios, checks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# jax and torch share the GPU: jax allocates as it goes (at most half) instead of taking 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if not any(os.environ.get(name) for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")):
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.5"  # jaxlib refuses the deprecated name beside it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: `benchmarks` and `pallas_kernels` from this tree
    sys.path.insert(0, str(REPO))

from benchmarks import _timing, gdpa_bench  # noqa: E402
from gem_jax.train.run_record import code_version  # noqa: E402
from pallas_kernels import gdpa  # noqa: E402
from pallas_kernels.gdpa import reference  # noqa: E402

# One row per case: `batch` lengths round(clip(lognormal(log(median), sigma), low, high)), numpy
# default_rng(SEED) afresh for each case; `high` is also N, the max length given to both kernels.
CASES = {
    "long-tailed": dict(batch=64, median=600, sigma=1.0, low=8, high=1024),
    "gem-like": dict(batch=1024, median=600, sigma=1.0, low=8, high=1024),
    "long": dict(batch=32, median=2000, sigma=1.0, low=8, high=4096),
}
# --cpu-smoke: the same drawing on tiny shapes (interpret mode), two of them.
SMOKE_CASES = {
    "smoke-a": dict(batch=5, median=40, sigma=1.0, low=1, high=96),
    "smoke-b": dict(batch=3, median=20, sigma=1.0, low=8, high=64),
}
SEED = 0
DATA_SEED = 1
HEADS, DIM = 4, 128
SMOKE_HEADS, SMOKE_DIM = 1, 64
CHECK_BOUND = 0.02  # max |err| / max |ref|: bf16 inputs and outputs with float32 accumulation stay well under
CEILING_TFLOPS = 780.0  # about what a large bf16 GEMM reaches on an H100/H200 (gdpa.md: 743 measured on the H200)
ROW_ALIGN = 128  # a jagged batch lives in a buffer of whole 128-row blocks; the slack rows are zero
REF_SCORE_ELEMENTS = 2**28  # float32 scores per reference chunk (1 GiB): B_chunk * H * N^2 at most
INPUT_BLOCK_ROWS = 8192  # rows per numpy generator when making the inputs
COMPARE_BLOCK_ROWS = 1 << 16  # rows per step of the host-side comparisons


# --- cases and real work --------------------------------------------------------------------


def draw_lengths(case: dict, seed: int = SEED) -> np.ndarray:
    """int64 lengths of one `CASES` row: round(clip(lognormal(log(median), sigma, batch), low, high))."""
    rng = np.random.default_rng(seed)
    drawn = rng.lognormal(math.log(case["median"]), case["sigma"], case["batch"])
    return np.rint(np.clip(drawn, case["low"], case["high"])).astype(np.int64)


def lengths_summary(lengths) -> dict:
    lengths = np.asarray(lengths)
    return {"count": int(lengths.size), "sum": int(lengths.sum()), "max": int(lengths.max(initial=0)),
            "mean": float(lengths.mean()) if lengths.size else 0.0}


def causal_pairs(lengths) -> int:
    """Attended (query, key) pairs of causal self-attention: L (L + 1) / 2 per sequence (keys 0..i for query i)."""
    n = np.asarray(lengths, np.int64)
    return int(np.sum(n * (n + 1) // 2))


def forward_flops(lengths, heads: int, dim: int) -> float:
    """Real forward work: 4 H D per attended pair (QK^T and PV, 2 flops per multiply-add, each H D)."""
    return 4.0 * heads * dim * causal_pairs(lengths)


def offsets_of(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))])


# --- inputs --------------------------------------------------------------------------------


def capacity_of(lengths) -> int:
    """Rows of the buffer a batch of `lengths` lives in: their sum in whole `ROW_ALIGN` blocks, at least one."""
    return max(ROW_ALIGN, -(-int(np.sum(lengths)) // ROW_ALIGN) * ROW_ALIGN)


def make_inputs(lengths, heads: int, dim: int, with_dout: bool, seed: int = DATA_SEED) -> dict:
    """bf16 numpy q, k, v (and dout) `[capacity, H, D]`: standard normal real rows, zero slack rows.

    numpy draws each block of INPUT_BLOCK_ROWS rows from its own child of `SeedSequence(seed)` (one
    per tensor, then one per block), in a thread pool: the same values whatever the thread count.
    """
    total, capacity = int(np.sum(lengths)), capacity_of(lengths)
    names = ("q", "k", "v") + (("dout",) if with_dout else ())
    arrays, jobs = {}, []
    for name, tensor_seed in zip(names, np.random.SeedSequence(seed).spawn(len(names))):
        arrays[name] = x = np.zeros((capacity, heads, dim), jnp.bfloat16)
        starts = range(0, total, INPUT_BLOCK_ROWS)
        jobs += [(x, lo, min(lo + INPUT_BLOCK_ROWS, total), block_seed)
                 for lo, block_seed in zip(starts, tensor_seed.spawn(len(starts)))]

    def fill(job):
        x, lo, hi, block_seed = job
        x[lo:hi] = np.random.default_rng(block_seed).standard_normal((hi - lo, heads, dim), np.float32).astype(jnp.bfloat16)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, jobs))
    return {"total": total, "capacity": capacity, **arrays}


# --- our side -------------------------------------------------------------------------------


def ours_gdpa(q, k, v, offsets, *, n: int, alpha: float, implementation: str, output_scale: float = 1.0):
    """Our causal SiLU GDPA with HSTU's alpha inside the activation: sum_{j<=i} silu(alpha q_i.k_j) v_j * output_scale."""
    return gdpa(q, k, v, offsets, offsets, max_seq_len_q=n, max_seq_len_kv=n, activation="silu", causal=True,
                scale=alpha, output_scale=output_scale, implementation=implementation)


def ours_hstu_semantics(q, k, v, offsets, *, n: int, alpha: float, implementation: str):
    """HSTU's output from our op: scale=alpha and output_scale=1/N (HSTU divides silu's output by N)."""
    return ours_gdpa(q, k, v, offsets, n=n, alpha=alpha, implementation=implementation, output_scale=1.0 / n)


def ours_functions(n: int, alpha: float, implementation: str) -> dict:
    """Jitted (q, k, v, offsets[, dout]) -> ... functions; offsets are an argument (the work list is built per call)."""
    kw = dict(n=n, alpha=alpha, implementation=implementation)

    def fwd_bwd(q, k, v, offsets, dout):
        out, vjp = jax.vjp(lambda q, k, v: ours_hstu_semantics(q, k, v, offsets, **kw), q, k, v)
        return out, vjp(dout)

    return {
        "fwd": jax.jit(lambda q, k, v, offsets: ours_hstu_semantics(q, k, v, offsets, **kw)),
        "gdpa_only": jax.jit(lambda q, k, v, offsets: ours_gdpa(q, k, v, offsets, **kw)),
        "fwd_bwd": jax.jit(fwd_bwd),
    }


def time_ours(fn, args, flops: float, iters: int, smoke: bool) -> dict:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    device = None if smoke else _timing.device_ms(fn, args, iters)
    wall = _timing.wall_seconds(fn, *args, iters=1 if smoke else iters, reps=1 if smoke else 3) * 1e3
    ms = device or wall
    return {"device_ms": device, "wall_ms": wall, "first_call_s": compile_s, "real_flops": flops,
            "tflops": flops / (ms / 1e3) / 1e12, "tflops_clock": "device" if device else "wall"}


# --- checks ---------------------------------------------------------------------------------


def reference_chunks(lengths, n: int, heads: int, score_elements: int = REF_SCORE_ELEMENTS):
    """Split the batch into runs of sequences whose padded float32 scores fit `score_elements`.

    Returns `(chunk_batch, [(first, end), ...])` with at most `chunk_batch` sequences per run.
    """
    batch = len(lengths)
    chunk = int(max(1, min(batch, score_elements // max(1, heads * n * n))))
    return chunk, [(s, min(s + chunk, batch)) for s in range(0, batch, chunk)]


def reference_outputs(inputs: dict, lengths, *, n: int, alpha: float, grads: bool = False,
                      score_elements: int = REF_SCORE_ELEMENTS) -> tuple[dict, int]:
    """The float32 reference of HSTU's semantics on the real rows: `({"out"[, "dq", "dk", "dv"]}, chunks)`.

    `pallas_kernels.gdpa.reference` (silu, causal, scale=alpha) times 1/N on float32 copies of the
    bf16 inputs, `[total, H, D]` float32 each; with `grads`, its vjp against `inputs["dout"]`.
    Sequences are independent, so it runs a chunk of them at a time (`reference_chunks`).
    """
    offsets = offsets_of(lengths)
    total = int(offsets[-1])
    heads = inputs["q"].shape[1]
    chunk, runs = reference_chunks(lengths, n, heads, score_elements)
    rows = max(8, -(-max(int(offsets[e] - offsets[s]) for s, e in runs) // 8) * 8)

    def semantics(q, k, v, local):
        out = reference.gdpa(q, k, v, local, local, max_seq_len_q=n, max_seq_len_kv=n, activation="silu",
                             scale=alpha, causal=True)
        return out * (1.0 / n)

    @jax.jit
    def forward(q, k, v, local):
        return (semantics(q, k, v, local),)

    @jax.jit
    def forward_backward(q, k, v, local, dout):
        out, vjp = jax.vjp(lambda q, k, v: semantics(q, k, v, local), q, k, v)
        return (out, *vjp(dout))

    names = ("out", "dq", "dk", "dv") if grads else ("out",)
    result = {name: np.zeros((total,) + inputs["q"].shape[1:], np.float32) for name in names}
    for s, e in runs:
        lo, hi = int(offsets[s]), int(offsets[e])
        local = np.full(chunk + 1, hi - lo, np.int32)
        local[: e - s + 1] = offsets[s : e + 1] - lo
        padded = []
        for name in ("q", "k", "v") + (("dout",) if grads else ()):
            x = np.zeros((rows,) + inputs[name].shape[1:], np.float32)
            x[: hi - lo] = inputs[name][lo:hi].astype(np.float32)
            padded.append(jnp.asarray(x))
        with jax.default_matmul_precision("highest"):  # a float32 reference, not TF32
            outs = forward_backward(*padded[:3], jnp.asarray(local), padded[3]) if grads else forward(
                *padded, jnp.asarray(local))
        for name, x in zip(names, outs):
            result[name][lo:hi] = np.asarray(x)[: hi - lo]
    return result, len(runs)


def rel_err(got, want) -> float:
    """max |got - want| / max |want| in float32 (0 for empty arrays), a block of rows at a time."""
    worst = scale = 0.0
    for lo in range(0, len(want), COMPARE_BLOCK_ROWS):
        w = np.asarray(want[lo : lo + COMPARE_BLOCK_ROWS], np.float32)
        g = np.asarray(got[lo : lo + COMPARE_BLOCK_ROWS], np.float32)
        worst = max(worst, float(np.max(np.abs(g - w), initial=0.0)))
        scale = max(scale, float(np.max(np.abs(w), initial=0.0)))
    return worst / max(scale, 1e-30) if len(want) else 0.0


def all_finite(x) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x[lo : lo + COMPARE_BLOCK_ROWS], np.float32))))
               for lo in range(0, len(x), COMPARE_BLOCK_ROWS))


def compare(ref: dict, ours: dict | None, hstu: dict | None, bound: float = CHECK_BOUND) -> dict:
    """Each tensor of `ref` (`[total, H, D]`) against ours and HSTU's (`[capacity, H, D]`, real rows compared).

    Per tensor: `ours_vs_ref`, `hstu_vs_ref` (max |err| / max |ref|), `ours_vs_hstu` (/ max |HSTU|) and
    whether each is finite; `ok` when every error is within `bound` and everything is finite.
    """
    result = {"measure": "max |err| / max |reference| on the real rows; ours_vs_hstu: / max |HSTU|", "bound": bound}
    errors, finite = [], []
    for name, want in ref.items():
        total = want.shape[0]
        got = {who: side[name][:total] for who, side in (("ours", ours), ("hstu", hstu)) if side is not None}
        r = {}
        for who, x in got.items():
            r[f"{who}_vs_ref"] = rel_err(x, want)
            r[f"{who}_finite"] = all_finite(x)
        if len(got) == 2:
            r["ours_vs_hstu"] = rel_err(got["ours"], got["hstu"])
        errors += [v for key, v in r.items() if not key.endswith("_finite")]
        finite += [v for key, v in r.items() if key.endswith("_finite")]
        result[name] = r
    result["ok"] = bool(errors) and all(v <= bound for v in errors) and all(finite)  # nothing compared: not ok
    return result


def check_summary(check: dict) -> str:
    if "error" in check:
        return "ERROR " + check["error"].splitlines()[0][:200]
    parts = [f"{name}.{key}={value:.3g}" for name, r in check.items() if isinstance(r, dict)
             for key, value in r.items() if not key.endswith("_finite")]
    return ("ok " if check["ok"] else "FAIL ") + ", ".join(parts)


# --- HSTU's side (torch) --------------------------------------------------------------------


def import_hstu(src: str | None) -> tuple[object | None, str | None]:
    """`(triton_hstu_mha, None)`, or `(None, why not)`; `src` goes first on sys.path."""
    if not src:
        return None, "no --hstu-src given"
    try:
        path = str(Path(src).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)
        from generative_recommenders.ops.triton.triton_hstu_attention import triton_hstu_mha

        return triton_hstu_mha, None
    except BaseException as e:  # noqa: BLE001 - an import can fail in any way; record it
        if isinstance(e, KeyboardInterrupt):
            raise
        return None, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"


def hstu_runnable(mha, smoke: bool) -> bool:
    """HSTU's kernel runs only where it was imported and a GPU is (not in --cpu-smoke)."""
    return mha is not None and not smoke


def torch_tensor(x: np.ndarray):
    """A CUDA torch tensor of a numpy array (bf16 through its 16-bit pattern)."""
    import torch

    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def torch_numpy(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def torch_wall_ms(fn, iters: int, reps: int = 3) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples) * 1e3


def torch_kernel_ms(fn, iters: int) -> dict:
    """torch.profiler: `{"kernel_ms": summed CUDA kernel time per call, "kernels": [(name, us per call)]}`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue  # CPU ops, and GPU-side annotation ranges that span kernels
        us = float(event.time_range.end - event.time_range.start)
        per_name[event.name] = per_name.get(event.name, 0.0) + us
    if not per_name:
        raise RuntimeError("torch.profiler recorded no CUDA kernels")
    kernels = sorted(((name[:80], round(us / iters, 2)) for name, us in per_name.items()), key=lambda t: -t[1])
    return {"kernel_ms": sum(per_name.values()) / iters / 1e3, "kernels": kernels[:12]}


def hstu_best_config() -> dict:
    """The autotuned configurations HSTU's forward and backward kernels chose last (as strings)."""
    try:
        from generative_recommenders.ops.triton import triton_hstu_attention as hstu

        return {name: str(getattr(getattr(hstu, name, None), "best_config", None))
                for name in ("_hstu_attn_fwd", "_hstu_attn_bwd")}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def hstu_calls(mha, t: dict, n: int, alpha: float) -> dict:
    """Zero-argument HSTU calls on the case's torch tensors: forward (sorted, unsorted) and forward+backward."""
    import torch

    def fwd(sort_by_length=True):
        return mha(n, alpha, t["q"], t["k"], t["v"], t["offsets"], sort_by_length=sort_by_length)

    def fwd_bwd():
        q, k, v = (t[name].detach().requires_grad_(True) for name in ("q", "k", "v"))
        out = mha(n, alpha, q, k, v, t["offsets"], sort_by_length=True)
        return (out, *torch.autograd.grad(out, (q, k, v), t["dout"]))

    return {"fwd": fwd, "fwd_unsorted": lambda: fwd(False), "fwd_bwd": fwd_bwd}


def time_hstu(fn, flops: float, iters: int) -> dict:
    import torch
    import triton.testing

    t0 = time.perf_counter()
    fn()  # autotuning and compiling happen here
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    median = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    wall = torch_wall_ms(fn, iters)
    return {"first_call_s": first, "do_bench_ms": float(median), "wall_ms": wall, "real_flops": flops,
            "tflops_do_bench": flops / (median / 1e3) / 1e12}


# --- run --------------------------------------------------------------------------------------


def guarded(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - record, go on
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}


def git_commit() -> str:
    """$GEM_GIT_COMMIT when set (a copy of the tree run elsewhere), else the tree's own (`code_version`)."""
    return os.environ.get("GEM_GIT_COMMIT") or code_version()["commit"]


def versions() -> dict:
    found = {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__}
    for name in ("jaxlib", "torch", "triton"):
        try:
            found[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001
            found[name] = f"unavailable ({type(e).__name__})"
    return found


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    return str(jax.devices()[0].device_kind)


def ratio(num, den):
    return num / den if num and den else None


def case_ratios(c: dict) -> dict:
    """HSTU time / ours per mode (> 1: ours faster), on comparable clocks."""
    out = {}
    for mode, ours_key in (("fwd", "fwd"), ("fwd_gdpa_only", "gdpa_only"), ("fwd_bwd", "fwd_bwd")):
        ours = c.get("ours", {}).get(ours_key, {})
        hstu = c.get("hstu", {}).get("fwd_bwd" if mode == "fwd_bwd" else "fwd", {})
        if "error" in ours or "error" in hstu or not ours or not hstu:
            continue
        out[mode] = {
            "device": ratio(hstu.get("kernel_ms"), ours.get("device_ms")),
            "do_bench": ratio(hstu.get("do_bench_ms"), ours.get("device_ms")),
            "wall": ratio(hstu.get("wall_ms"), ours.get("wall_ms")),
        }
    return out


def flag(report: dict | None, name: str, c: dict, what: str, check: dict) -> None:
    """Records a failed check in the case (and in the report's `flags`, when given) and prints it loudly."""
    text = f"{what} disagree beyond {CHECK_BOUND:.0%} (or not finite, or the check failed): {check_summary(check)}"
    c.setdefault("flags", []).append(text)
    if report is not None:
        report["flags"].append(f"{name}: {text}")
    loud(f"{name}: {text}")


def loud(message: str) -> None:
    bar = "!" * 78
    print(f"{bar}\n!!! {message}\n{bar}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hstu-src", help="directory put first on sys.path to import generative_recommenders")
    parser.add_argument("--hstu-commit", help="commit of the HSTU source (recorded)")
    parser.add_argument("--cases", default=None, help="comma-separated names of CASES (default: all)")
    parser.add_argument("--backward", action="store_true", help="also time and compare forward+backward")
    parser.add_argument("--sweep", action="store_true",
                        help="also time our forward under each tiling of gdpa_bench.FORWARD_VARIANTS (ours only)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no case after this many seconds")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="our side only, tiny shapes, Mosaic GPU interpret mode on the CPU")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    start = time.perf_counter()
    deadline = start + args.budget_s
    if smoke:  # interpret-mode warpgroups need pool threads (benchmarks/gdpa.md, "Interpret-mode hang")
        os.environ.setdefault("PJRT_NPROC", "8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    table = SMOKE_CASES if smoke else CASES
    names = list(table) if not args.cases else args.cases.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(table)}")
    heads, dim = (SMOKE_HEADS, SMOKE_DIM) if smoke else (HEADS, DIM)
    alpha = dim**-0.5
    impl = "pallas"
    mha, import_error = import_hstu(args.hstu_src)
    run_hstu = hstu_runnable(mha, smoke)
    if import_error:
        print(f"HSTU not imported (timing ours only): {import_error.splitlines()[0]}", flush=True)
    report = {
        "benchmark": "hstu_bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "gpu": None if smoke else gpu_name(),
        "device": str(jax.devices()[0].device_kind),
        "versions": versions(),
        "smoke": smoke,
        "hstu": {"src": args.hstu_src, "commit": args.hstu_commit, "import_error": import_error, "ran": run_hstu,
                 "call": "triton_hstu_mha(N, alpha, q, k, v, seq_offsets int64, sort_by_length=True); "
                         "num_targets=None, max_attn_len=0, contextual_seq_len=0, enable_tma=False"},
        "ours": {"call": f"gdpa(q, k, v, offsets, offsets, activation='silu', causal=True, scale=alpha, "
                         f"output_scale=1/N, implementation='{impl}'); gdpa_only without the 1/N"},
        "settings": {"heads": heads, "dim": dim, "dtype": "bfloat16", "alpha": alpha, "N": "the case's high bound",
                     "iters": args.iters, "backward": args.backward, "check_bound": CHECK_BOUND,
                     "ceiling_tflops": CEILING_TFLOPS, "seed_lengths": SEED, "seed_data": DATA_SEED},
        "clocks": {
            "ours.device_ms": "CUPTI summed kernel time of one call, median of iters (work-list build included)",
            "ours.wall_ms": "median of 3 repetitions of iters back-to-back calls",
            "hstu.do_bench_ms": "triton.testing.do_bench median (L2 flushed before each call)",
            "hstu.kernel_ms": "torch.profiler summed CUDA kernel time per call, mean of iters back-to-back calls",
            "hstu.wall_ms": "median of 3 repetitions of iters back-to-back calls",
            "ratios": "HSTU / ours (>1: ours faster); device = kernel_ms / device_ms; do_bench = do_bench_ms / device_ms",
            "flops": "fwd = 4 H D sum L(L+1)/2; fwd_bwd = 3.5 fwd",
        },
        "case_table": {n: table[n] for n in names},
        "cases": {},
        "flags": [],
    }

    def save():
        report["total_s"] = time.perf_counter() - start
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    ctx = contextlib.nullcontext()
    if smoke:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        ctx = plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())
    torch_inputs = {}  # case -> CUDA tensors, kept for the profiler and backward phases
    save()
    # Phase 1, per case: inputs; ours (CUPTI); HSTU forward (do_bench, wall); output checks.
    with ctx:
        for name in names:
            if time.perf_counter() > deadline:
                report["cases"][name] = {"skipped": "time budget (--budget-s) spent"}
                print(f"{name}: skipped, time budget spent", flush=True)
                continue
            report["cases"][name] = c = guarded(lambda: run_case(name, table[name], heads, dim, alpha, impl, args, smoke,
                                                                 mha if run_hstu else None, torch_inputs))
            if "error" in c:
                loud(f"{name}: the case failed: {c['error'].splitlines()[0][:200]}")
            for text in c.get("flags", []):
                report["flags"].append(f"{name}: {text}")
            save()
    # Phase 2: HSTU's kernel time by torch.profiler, after every CUPTI measurement of ours.
    if run_hstu:
        for name, t in torch_inputs.items():
            c = report["cases"][name]
            for mode in ("fwd", "fwd_unsorted"):  # forward+backward: phase 3, last (HSTU's backward may fault)
                if "error" not in c["hstu"].get(mode, {"error": ""}):
                    profiled = guarded(lambda: torch_kernel_ms(t["calls"][mode], args.iters))
                    c["hstu"][mode].update(profiled if "error" not in profiled else {"kernel_ms_error": profiled["error"]})
            c["ratios"] = case_ratios(c)
            save()
    # Phase 3 (--backward): HSTU's forward+backward, one case at a time, compared with ours' gradients.
    if run_hstu and args.backward:
        for name, t in torch_inputs.items():
            c = report["cases"][name]
            if time.perf_counter() > deadline:
                c["hstu"]["fwd_bwd"] = {"skipped": "time budget (--budget-s) spent"}
                continue
            print(f"{name}: HSTU forward+backward", flush=True)
            flops = 3.5 * c["real_flops_fwd"]

            def fwd_bwd_case(t=t, flops=flops, c=c):
                timed = time_hstu(t["calls"]["fwd_bwd"], flops, args.iters)
                profiled = guarded(lambda: torch_kernel_ms(t["calls"]["fwd_bwd"], args.iters))
                timed.update(profiled if "error" not in profiled else {"kernel_ms_error": profiled["error"]})
                _, dq, dk, dv = t["calls"]["fwd_bwd"]()
                t["hstu_grads"] = {"dq": torch_numpy(dq), "dk": torch_numpy(dk), "dv": torch_numpy(dv)}
                return timed

            c["hstu"]["fwd_bwd"] = r = guarded(fwd_bwd_case)
            c["hstu"]["best_config"] = hstu_best_config()
            if "error" in r:
                loud(f"{name}: HSTU forward+backward failed: {r['error'].splitlines()[0][:200]}")
            elif t.get("ref_grads") is not None:
                ours_ok = c.get("checks_grads", {}).get("ok", False)
                c["checks_grads"] = guarded(lambda: compare(t["ref_grads"], t["ours_grads"], t["hstu_grads"]))
                print(f"  check gradients: {check_summary(c['checks_grads'])}", flush=True)
                if ours_ok and not c["checks_grads"].get("ok", False):  # ours alone was flagged in phase 1
                    flag(report, name, c, "gradients", c["checks_grads"])
            c["ratios"] = case_ratios(c)
            save()
    save()
    print_summary(report)
    print(f"total {report['total_s']:.0f} s; wrote {args.out}", flush=True)
    return 0


def run_ours(data, offsets, n, alpha, impl, flops, iters, backward, smoke):
    """Times our modes on the case's inputs: `(results per mode, forward output, {dq, dk, dv} or None)` as numpy."""
    j = {key: jnp.asarray(data[key]) for key in ("q", "k", "v", "dout") if key in data}
    j_offsets = jnp.asarray(offsets, jnp.int32)
    fns = ours_functions(n, alpha, impl)
    results = {}
    for mode in ("fwd", "gdpa_only") + (("fwd_bwd",) if backward else ()):
        fargs = (j["q"], j["k"], j["v"], j_offsets) + ((j["dout"],) if mode == "fwd_bwd" else ())
        mode_flops = 3.5 * flops if mode == "fwd_bwd" else flops
        results[mode] = r = guarded(lambda: time_ours(fns[mode], fargs, mode_flops, iters, smoke))
        line = f"ERROR {r['error'].splitlines()[0][:160]}" if "error" in r else (
            f"device {_fmt(r['device_ms'])} ms, wall {r['wall_ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s ({r['tflops_clock']})")
        print(f"  ours {mode:10s} {line}", flush=True)
    out = grads = None
    if "error" not in results["fwd"]:
        out = np.asarray(fns["fwd"](j["q"], j["k"], j["v"], j_offsets))
    if backward and "error" not in results["fwd_bwd"]:
        _, dqkv = fns["fwd_bwd"](j["q"], j["k"], j["v"], j_offsets, j["dout"])
        grads = {key: np.asarray(g) for key, g in zip(("dq", "dk", "dv"), dqkv)}
    return results, out, grads


def run_case(name, case, heads, dim, alpha, impl, args, smoke, mha, torch_inputs) -> dict:
    lengths = draw_lengths(case)
    n = int(case["high"])
    pairs = causal_pairs(lengths)
    flops = forward_flops(lengths, heads, dim)
    c = {"definition": case, "lengths": lengths_summary(lengths), "N": n, "alpha": alpha, "tokens": int(lengths.sum()),
         "causal_pairs": pairs, "real_flops_fwd": flops, "real_flops_fwd_bwd": 3.5 * flops,
         "ceiling_ms_fwd": flops / (CEILING_TFLOPS * 1e12) * 1e3, "ours": {}, "hstu": {}, "flags": []}
    print(f"{name}: lengths {c['lengths']}, N={n}; forward real work {flops / 1e12:.4f} TFLOP "
          f"({pairs} pairs x 4 H D) = {c['ceiling_ms_fwd']:.3f} ms at {CEILING_TFLOPS:.0f} TFLOP/s", flush=True)
    data = make_inputs(lengths, heads, dim, with_dout=args.backward)
    c["capacity"] = data["capacity"]
    offsets = offsets_of(lengths)
    c["ours"], ours_out, ours_grads = run_ours(data, offsets, n, alpha, impl, flops, args.iters, args.backward, smoke)
    if args.sweep and ours_out is not None:
        fargs = tuple(jnp.asarray(data[key]) for key in ("q", "k", "v")) + (jnp.asarray(offsets, jnp.int32),)
        c["ours_forward_sweep"] = guarded(lambda: gdpa_bench.sweep_tilings(
            lambda: ours_functions(n, alpha, impl)["fwd"], fargs, ours_out, name, device=not smoke))
    hstu_out = None
    if mha is not None:
        def setup():
            t = {key: torch_tensor(data[key]) for key in ("q", "k", "v", "dout") if key in data}
            t["offsets"] = torch_tensor(offsets.astype(np.int64))
            t["calls"] = hstu_calls(mha, t, n, alpha)
            return t

        t = guarded(setup)
        if "error" in t:
            c["hstu"]["fwd"] = t
        else:
            for mode in ("fwd", "fwd_unsorted"):
                c["hstu"][mode] = r = guarded(lambda: time_hstu(t["calls"][mode], flops, args.iters))
                line = f"ERROR {r['error'].splitlines()[0][:160]}" if "error" in r else (
                    f"do_bench {r['do_bench_ms']:.3f} ms, wall {r['wall_ms']:.3f} ms, first call {r['first_call_s']:.1f} s")
                print(f"  hstu {mode:12s} {line}", flush=True)
            c["hstu"]["best_config"] = hstu_best_config()
            if "error" not in c["hstu"]["fwd"]:
                got = guarded(lambda: {"out": torch_numpy(t["calls"]["fwd"]())})
                if "error" in got:
                    c["hstu"]["fwd"]["output_error"] = got["error"]
                else:
                    hstu_out = got["out"]
            torch_inputs[name] = t

    def checks():
        ref, chunks = reference_outputs(data, lengths, n=n, alpha=alpha, grads=args.backward,
                                        score_elements=2 * heads * n * n if smoke else REF_SCORE_ELEMENTS)
        out = compare({"out": ref["out"]}, None if ours_out is None else {"out": ours_out},
                      None if hstu_out is None else {"out": hstu_out})
        grads = None
        if args.backward:
            grads = compare({g: ref[g] for g in ("dq", "dk", "dv")}, ours_grads, None)
            if name in torch_inputs:
                torch_inputs[name].update(ref_grads={g: ref[g] for g in ("dq", "dk", "dv")}, ours_grads=ours_grads)
        return {**out, "reference_chunks": chunks}, grads

    checked = guarded(checks)
    c["checks"], grads = (checked, None) if isinstance(checked, dict) else checked
    print(f"  check: {check_summary(c['checks'])}", flush=True)
    if not c["checks"].get("ok", False):
        flag(None, name, c, "outputs", c["checks"])
    if grads is not None:
        c["checks_grads"] = grads
        print(f"  check gradients (ours): {check_summary(grads)}", flush=True)
        if not grads.get("ok", False):
            flag(None, name, c, "gradients", grads)
    c["ratios"] = case_ratios(c)
    return c


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def print_summary(report: dict) -> None:
    print("summary (ms; ratios HSTU / ours, > 1: ours faster):", flush=True)
    header = f"  {'case':12s} {'mode':8s} {'ours dev':>9s} {'ours wall':>9s} {'hstu krn':>9s} {'do_bench':>9s} " \
             f"{'hstu wall':>9s} {'x device':>8s} {'x dobench':>9s} {'x wall':>7s} {'at ceil':>8s}"
    print(header)
    errors = []
    for name, c in report["cases"].items():
        if "skipped" in c or "error" in c:
            print(f"  {name:12s} " + (f"skipped: {c['skipped']}" if "skipped" in c else "ERROR " + c["error"].splitlines()[0][:150]))
            continue
        errors += [f"{name} {side} {mode}: {r['error'].splitlines()[0][:150]}" for side in ("ours", "hstu")
                   for mode, r in c[side].items() if isinstance(r, dict) and "error" in r]
        for mode, ours_key in (("fwd", "fwd"), ("fwd_bwd", "fwd_bwd")):
            ours = c["ours"].get(ours_key)
            if ours is None:
                continue
            hstu = c["hstu"].get(mode, {})
            rat = c.get("ratios", {}).get(mode, {})
            ceil = c["ceiling_ms_fwd"] * (3.5 if mode == "fwd_bwd" else 1)
            print(f"  {name:12s} {mode:8s} {_fmt(ours.get('device_ms')):>9s} {_fmt(ours.get('wall_ms')):>9s} "
                  f"{_fmt(hstu.get('kernel_ms')):>9s} {_fmt(hstu.get('do_bench_ms')):>9s} {_fmt(hstu.get('wall_ms')):>9s} "
                  f"{_fmt(rat.get('device')):>8s} {_fmt(rat.get('do_bench')):>9s} {_fmt(rat.get('wall')):>7s} {ceil:8.3f}")
    for line in errors:
        print(f"  error: {line}", flush=True)
    if report["flags"]:
        loud("FLAGS: " + " | ".join(report["flags"]))
    else:
        print("  no flags: every check within its bound", flush=True)


if __name__ == "__main__":
    sys.exit(main())
