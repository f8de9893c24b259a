"""MXFP8 GEMM benchmark on one Hopper GPU: our block-scaled FP8 kernels against their peers.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/mxfp8_bench.py --out benchmarks/results/mxfp8_h200.json

`--model-shapes` instead times the GEMMs of the GEM-width model (configs/gem_h200.py) at its
own shapes: M = 168,192 and 655,360 token rows, (K, N) in {(1024, 3072), (1024, 1024),
(1024, 4096), (4096, 1024)}, forward, dgrad and wgrad-shaped, both block sizes against bf16
XLA in the model's layouts; a tile sweep at two of them first; and the quantization passes
(plain, fused with RMSNorm, fused with GELU) with their fusion counts in the optimized HLO::

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=. python3 benchmarks/mxfp8_bench.py --model-shapes \
        --out benchmarks/results/mxfp8_h200_model_shapes.json

Peers, all on the same `[M, K] x [N, K]^T` problem, timed in the same process:
  bf16_xla            `a @ b.T` in bf16 through XLA (cuBLAS)
  fp8_tensor_xla      per-tensor FP8 through XLA's dequantize->dot pattern (cuBLASLt f8), B pre-transposed
  torch_tensorwise    `torch._scaled_mm` per-tensor scales
  torch_blockwise     `torch._scaled_mm` 1x128 (A) x 128x128 (B) block scales (cuBLAS >= 12.9)
  jax_scaled_matmul   `jax.nn.scaled_matmul` mxfp8 (1x32 e8m0), pre-quantized
  jax_scaled_dot_general  `jax.nn.scaled_dot_general` mxfp8 config, quantization included
  ours_32x32          `mxfp8_matmul` Pallas kernel, 32x32 scales, promotion every 32 K
  ours_128            `mxfp8_matmul` Pallas kernel, 1x128 / 128x128 scales, promotion every 128 K
For ours, "gemm" is the kernel on pre-quantized operands, "quant" the quantization of both
bf16 operands, "total" both in one jitted function.

Timing: jitted functions, warm-up, then `reps` medians of the mean over `iters` back-to-back
calls (device work is asynchronous; one block at the end). torch timings use CUDA events.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time
import traceback

from gem_jax.device_memory import claim_device_memory

claim_device_memory("0.5")  # leave room for torch in the same process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _timing  # noqa: E402
from pallas_kernels.mxfp8 import (  # noqa: E402
    gelu_quantize_mxfp8,
    hadamard_signs,
    kernel_matmul,
    mxfp8_matmul,
    quantize_mxfp8,
    random_hadamard,
    rmsnorm_quantize_mxfp8,
)

SHAPES = [  # (M, N, K)
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 4096, 4096),
    # GEM-like dense layers: many tokens, narrow features (embed 256/512, MLP x2/x4)
    (65536, 1024, 256),
    (65536, 2048, 512),
]
SWEEP_SHAPE = (8192, 8192, 8192)
CHECK_SHAPES = [(300, 200, 260), (4096, 4096, 4096)]
SMOKE = False


ITERS, REPS = 20, 5


def jax_time(f, *args, iters=None, reps=None) -> float:
    """Median seconds per call of the jitted `f`."""
    iters, reps = (ITERS, REPS) if SMOKE else (iters or ITERS, reps or REPS)
    return _timing.wall_seconds(f, *args, iters=iters, reps=reps)


def torch_time(f, iters=20, reps=5) -> float:
    import torch

    f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            f()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def inputs(m, n, k, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    return a, b


BLOCKS = {"ours_32x32": ((32, 32), (32, 32)), "ours_128": ((1, 128), (128, 128))}


def ours_fns(name, config):
    a_block, b_block = BLOCKS[name]

    def gemm(a8, sa, b8, sb):
        return mxfp8_matmul(a8, sa, b8, sb, implementation="pallas", config=config)

    def quant(a, b):
        return quantize_mxfp8(a, block=a_block), quantize_mxfp8(b, block=b_block)

    def total(a, b):
        (a8, sa), (b8, sb) = quant(a, b)
        return gemm(a8, sa, b8, sb)

    return jax.jit(gemm), jax.jit(quant), jax.jit(total)


def check_correctness(log, configs=None):
    """Pallas kernel vs the jnp reference on unaligned and aligned shapes."""
    out = {}
    for name, (ab, bb) in BLOCKS.items():
        config = (configs or {}).get(name)
        for m, n, k in CHECK_SHAPES:
            a, b = inputs(m, n, k, seed=1)
            a8, sa = quantize_mxfp8(a, block=ab)
            b8, sb = quantize_mxfp8(b, block=bb)
            got = mxfp8_matmul(a8, sa, b8, sb, out_dtype=jnp.float32, implementation="pallas", config=config)
            ref = mxfp8_matmul(a8, sa, b8, sb, out_dtype=jnp.float32, implementation="xla")
            exact = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision="highest")
            key = f"{name}_{m}x{n}x{k}"
            out[key] = {
                "rel_err_vs_reference": rel_err(got, ref),
                "rel_err_vs_bf16_inputs_f32_product": rel_err(got, exact),
                "finite": bool(jnp.all(jnp.isfinite(got))),
            }
            log(f"correctness {key}: {out[key]}")
    return out


def torch_peers(m, n, k, log):
    import torch

    res = {}
    dev = "cuda"
    a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device=dev) / k**0.5 * 16).to(torch.float8_e4m3fn)  # [N, K] row-major = [K, N] col-major
    one = torch.tensor(1.0, device=dev)
    try:
        res["torch_tensorwise"] = torch_time(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001 -- record why a peer is missing
        res["torch_tensorwise_error"] = repr(e)[:300]
    # 1x128 (A, scales [M, K/128]) x 128x128 (B, scales [K/128, N/128] in v1 orientation).
    ref = None
    sa = torch.exp2(torch.randint(-2, 3, (m, k // 128), device=dev).float())
    sb = torch.exp2(torch.randint(-2, 3, (n // 128, k // 128), device=dev).float())
    if m * n * k <= 4096**3:
        af = a.float() * sa.repeat_interleave(128, 1)
        bf = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)
        ref = af @ bf.t()
    variants = {
        "sa_outer_major": lambda: (sa.t().contiguous().t(), sb.t()),
        "sa_row_major": lambda: (sa, sb.t()),
        "sa_outer_major_sb_contig": lambda: (sa.t().contiguous().t(), sb.t().contiguous()),
    }
    for vname, make in variants.items():
        try:
            s_a, s_b = make()
            f = lambda: torch._scaled_mm(a, b.t(), s_a, s_b, out_dtype=torch.bfloat16)  # noqa: E731
            got = f()
            if ref is not None:
                err = float((got.float() - ref).norm() / ref.norm())
                if err > 1e-2:
                    res[f"torch_blockwise_{vname}_error"] = f"rel_err {err:.3g}"
                    continue
                res["torch_blockwise_rel_err"] = err
            res["torch_blockwise"] = torch_time(f)
            res["torch_blockwise_variant"] = vname
            break
        except Exception as e:  # noqa: BLE001
            res[f"torch_blockwise_{vname}_error"] = repr(e)[:300]
    log(f"torch {m}x{n}x{k}: { {k_: v for k_, v in res.items()} }")
    return res


def jax_peers(a, b, log):
    res = {}
    dims = (((1,), (1,)), ((), ()))
    res["bf16_xla"] = jax_time(jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.bfloat16)), a, b)

    a8 = a.astype(jnp.float8_e4m3fn)
    b8 = (b * 16).astype(jnp.float8_e4m3fn)
    sa = jnp.float32(1.0)
    sb = jnp.float32(1 / 16)

    def fp8_tensor(x8, y8, sx, sy):
        x = x8.astype(jnp.bfloat16) * sx.astype(jnp.bfloat16)
        y = y8.astype(jnp.bfloat16) * sy.astype(jnp.bfloat16)
        return jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.bfloat16)

    f = jax.jit(fp8_tensor)
    hlo = f.lower(a8, b8, sa, sb).compile().as_text()
    res["fp8_tensor_xla_uses_cublaslt_f8"] = "__cublas$lt$matmul$f8" in hlo
    res["fp8_tensor_xla"] = jax_time(f, a8, b8, sa, sb)
    try:
        a32, sa32 = quantize_mxfp8(a, block=(1, 32))
        b32, sb32 = quantize_mxfp8(b, block=(1, 32))
        g = jax.jit(
            lambda x, y, sx, sy: jax.nn.scaled_matmul(x[None], y[None], sx[None], sy[None], preferred_element_type=jnp.bfloat16)
        )
        res["jax_scaled_matmul"] = jax_time(g, a32, b32, sa32, sb32)
    except Exception as e:  # noqa: BLE001
        res["jax_scaled_matmul_error"] = repr(e)[:300]
    try:
        cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
        h = jax.jit(
            lambda x, y: jax.nn.scaled_dot_general(x, y, dims, preferred_element_type=jnp.bfloat16, configs=[cfg, cfg, cfg])
        )
        res["jax_scaled_dot_general"] = jax_time(h, a, b)
    except Exception as e:  # noqa: BLE001
        res["jax_scaled_dot_general_error"] = repr(e)[:300]
    return res


def ours(a, b, name, config, log, gemm_only=False):
    gemm, quant, total = ours_fns(name, config)
    (a8, sa), (b8, sb) = quant(a, b)
    if gemm_only:
        return {f"{name}_gemm": jax_time(gemm, a8, sa, b8, sb)}
    return {
        f"{name}_gemm": jax_time(gemm, a8, sa, b8, sb),
        f"{name}_quant": jax_time(quant, a, b),
        f"{name}_total": jax_time(total, a, b),
    }


SWEEP = {  # (tile_n, k_blocks_per_step, cluster, max_concurrent_steps)
    "ours_32x32": [(128, 1, "n", 8), (128, 2, "n", 4), (128, 2, "m", 4), (128, 2, None, 4), (64, 4, "n", 3)],
    "ours_128": [(128, 1, "n", 4), (128, 2, "n", 2), (128, 2, "n", 3), (128, 2, "m", 3)],
}


def sweep(log):
    """Tile configs of both kernels at SWEEP_SHAPE; returns {name: (best_config, table)}."""
    m, n, k = SWEEP_SHAPE
    a, b = inputs(m, n, k)
    best = {}
    for name, (ab, bb) in BLOCKS.items():
        a8, sa = quantize_mxfp8(a, block=ab)
        b8, sb = quantize_mxfp8(b, block=bb)
        table = []
        for tile_n, per_step, cluster, steps in SWEEP[name]:
            cfg = kernel_matmul.TuningConfig(tile_n=tile_n, k_blocks_per_step=per_step, cluster=cluster, max_concurrent_steps=steps)
            row = {"tile_n": tile_n, "k_blocks_per_step": per_step, "cluster": cluster, "steps": steps}
            try:
                f = jax.jit(lambda *t, c=cfg: mxfp8_matmul(*t, implementation="pallas", config=c))
                t = jax_time(f, a8, sa, b8, sb, iters=10, reps=3)
                row.update(seconds=t, tflops=2 * m * n * k / t / 1e12, config=cfg)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
            table.append(row)
            log(f"sweep {name} {row}")
        ok = [r for r in table if "seconds" in r]
        cfg = min(ok, key=lambda r: r["seconds"])["config"] if ok else kernel_matmul.default_config(ab[1])
        best[name] = (cfg, table)
    return best


def quant_costs(m, k, log):
    a, _ = inputs(m, 128, k)
    key = jax.random.key(3)
    res = {}
    for label, fn in {
        "quantize_32x32_nearest": lambda x: quantize_mxfp8(x, block=(32, 32)),
        "quantize_32x32_stochastic": lambda x: quantize_mxfp8(x, block=(32, 32), rounding="stochastic", key=key),
        "quantize_1x128": lambda x: quantize_mxfp8(x, block=(1, 128)),
        "random_hadamard_32": lambda x: random_hadamard(x, key=key, block=32),
        "random_hadamard_128": lambda x: random_hadamard(x, key=key, block=128),
        "copy_bf16": lambda x: x * 2,
    }.items():
        res[label] = jax_time(jax.jit(fn), a)
    log(f"quantization {m}x{k}: {res}")
    return res


def layer_check(log, best, sizes=None):
    """FP8 dense layer forward+backward (pallas vs xla numerics; time vs a bf16 layer) at GEM-like sizes."""
    from gem_jax.quant import Fp8Recipe, fp8_matmul

    res = {}
    for t, din, dout in sizes or [(65536, 512, 1024), (16384, 4096, 4096)]:
        kx, kw, kg = jax.random.split(jax.random.key(5), 3)
        x = jax.random.normal(kx, (t, din), jnp.bfloat16)
        w = jax.random.normal(kw, (din, dout), jnp.float32) / np.sqrt(din)
        g = jax.random.normal(kg, (t, dout), jnp.bfloat16)

        def bf16_loss(x, w):
            y = jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return jnp.sum((y * g).astype(jnp.float32))

        row = {}
        step = jax.jit(jax.grad(bf16_loss, argnums=(0, 1)))
        row["bf16_fwd_bwd"] = jax_time(step, x, w, iters=10, reps=3)
        for block in (32, 128):
            for impl in ("pallas", "xla"):
                recipe = Fp8Recipe(block=block, implementation=impl, config=best[f"ours_{block}" if block == 128 else "ours_32x32"][0])

                def loss(x, w, recipe=recipe):
                    return jnp.sum((fp8_matmul(x, w, None, recipe, w.dtype) * g).astype(jnp.float32))

                f = jax.jit(jax.grad(loss, argnums=(0, 1)))
                dx, dw = f(x, w)
                row[f"fp8_{block}_{impl}_dx"], row[f"fp8_{block}_{impl}_dw"] = dx, dw
                if impl == "pallas":
                    row[f"fp8_{block}_fwd_bwd"] = jax_time(f, x, w, iters=10, reps=3)
            for part in ("dx", "dw"):
                row[f"fp8_{block}_pallas_vs_xla_{part}_rel_err"] = rel_err(row.pop(f"fp8_{block}_pallas_{part}"), row.pop(f"fp8_{block}_xla_{part}"))
        for block in (32, 128):
            row[f"fp8_{block}_speedup_vs_bf16"] = row["bf16_fwd_bwd"] / row[f"fp8_{block}_fwd_bwd"]
        res[f"{t}x{din}x{dout}"] = row
        log(f"layer {t}x{din}x{dout}: {row}")
    return res


MODEL_M = (168_192, 655_360)  # token rows of gem_h200: ~165K real history tokens (T_cap), and 4x that
MODEL_KN = ((1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024))  # qkv, attention out / pooled, mlp up, mlp down
MODEL_SWEEP = {  # (tile_n, k_blocks_per_step, cluster, max_concurrent_steps); the first is the default
    "ours_32x32": [(128, 2, "n", 4), (128, 2, "m", 4), (128, 2, None, 6), (64, 4, "n", 3)],
    "ours_128": [(128, 1, "n", 4), (128, 1, "n", 6), (128, 1, "m", 4), (128, 2, "n", 3)],
}
quantize_jit = jax.jit(quantize_mxfp8, static_argnames=("block", "rounding"))
MODEL_SWEEP_SHAPES = ((168_192, 3072, 1024), (168_192, 1024, 4096))  # (M, N, K): K = 1024 and K = 4096
MODEL_TIMING = {"iters": 5, "reps": 3}


def model_problems(ms=MODEL_M, kns=MODEL_KN):
    """`(kind, M, N, K)` of every distinct GEMM of a dense layer `x [M, K] @ w [K, N]` at the model's shapes.

    forward `x @ w` is (M, N, K); dgrad `dy @ w^T` is (M, K, N); wgrad `x^T dy` is (K, N, M),
    contracting the token axis. Forward and dgrad problems that coincide are listed once.
    """
    seen, out = set(), []
    for m in ms:
        for k, n in kns:
            for kind, shape in (("forward", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (k, n, m))):
                key = (kind == "wgrad", shape)
                if key not in seen:
                    seen.add(key)
                    out.append((kind, *shape))
    return out


def bf16_model_layout(kind):
    """The bf16 GEMM as the model runs it: forward `x @ w` (NN), dgrad `dy w^T` (NT), wgrad `x^T dy` (TN, float32 out)."""
    dims = {"forward": (((1,), (0,)), ((), ())), "dgrad": (((1,), (1,)), ((), ())), "wgrad": (((0,), (0,)), ((), ()))}[kind]
    out = jnp.float32 if kind == "wgrad" else jnp.bfloat16
    return jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims, preferred_element_type=out))


def bf16_model_operands(kind, m, n, k):
    """Random bf16 operands of `bf16_model_layout(kind)` for the (M, N, K) problem."""
    ka, kb = jax.random.split(jax.random.key(11))
    shapes = {"forward": ((m, k), (k, n)), "dgrad": ((m, k), (n, k)), "wgrad": ((k, m), (k, n))}[kind]
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip((ka, kb), shapes))


def model_sweep(log, deadline):
    """Tile configs at MODEL_SWEEP_SHAPES; returns ({(name, K): best config}, table)."""
    best, table = {}, []
    for m, n, k in MODEL_SWEEP_SHAPES:
        a, b = inputs(m, n, k)
        for name, (ab, bb) in BLOCKS.items():
            a8, sa = quantize_jit(a, block=ab)
            b8, sb = quantize_jit(b, block=bb)
            rows = []
            for tile_n, per_step, cluster, steps in MODEL_SWEEP[name]:
                row = {"M": m, "N": n, "K": k, "kernel": name, "tile_n": tile_n, "k_blocks_per_step": per_step, "cluster": cluster, "steps": steps}
                if time.monotonic() > deadline:
                    row["error"] = "skipped: time budget spent"
                else:
                    try:
                        cfg = kernel_matmul.TuningConfig(tile_n=tile_n, k_blocks_per_step=per_step, cluster=cluster, max_concurrent_steps=steps)
                        f = jax.jit(lambda *t, c=cfg: mxfp8_matmul(*t, implementation="pallas", config=c))
                        t = jax_time(f, a8, sa, b8, sb, **MODEL_TIMING)
                        row.update(seconds=t, tflops=2 * m * n * k / t / 1e12, config=cfg)
                    except Exception as e:  # noqa: BLE001 -- a config that does not fit is a result
                        row["error"] = repr(e)[:300]
                rows.append(row)
                log(f"model sweep {name} {m}x{n}x{k} {({k_: v for k_, v in row.items() if k_ != 'config'})}")
            ok = [r for r in rows if "seconds" in r]
            best[(name, k)] = min(ok, key=lambda r: r["seconds"])["config"] if ok else kernel_matmul.default_config(ab[1])
            table += rows
            del a8, sa, b8, sb
    return best, table


def model_gemms(log, best, deadline, problems):
    """bf16 XLA (model layouts) and our two kernels (pre-quantized, K-major) on every model problem."""
    rows = []
    for kind, m, n, k in problems:
        row = {"kind": kind, "M": m, "N": n, "K": k, "flops": 2 * m * n * k}
        if time.monotonic() > deadline:
            row["error"] = "skipped: time budget spent"
            rows.append(row)
            continue
        try:
            row["bf16_xla"] = jax_time(bf16_model_layout(kind), *bf16_model_operands(kind, m, n, k), **MODEL_TIMING)
            if kind == "wgrad":  # the same product with both operands already K-major (what an FP8 wgrad would need)
                row["bf16_xla_k_major"] = jax_time(bf16_model_layout("dgrad"), *bf16_model_operands("dgrad", m, n, k), **MODEL_TIMING)
        except Exception as e:  # noqa: BLE001
            row["bf16_error"] = repr(e)[:300]
        a, b = inputs(m, n, k)
        for name, (ab, bb) in BLOCKS.items():
            cfg = best[(name, min((kk for _, _, kk in MODEL_SWEEP_SHAPES), key=lambda kk: abs(kk - k)))]
            try:
                a8, sa = quantize_jit(a, block=ab)
                b8, sb = quantize_jit(b, block=bb)
                gemm = jax.jit(lambda *t, c=cfg: mxfp8_matmul(*t, implementation="pallas", config=c))
                row[f"{name}_gemm"] = jax_time(gemm, a8, sa, b8, sb, **MODEL_TIMING)
                row[f"{name}_config"] = repr(cfg)
                if kind == "forward" and m == MODEL_M[0]:  # the kernel at these shapes against the dequantized product
                    ref = jax.jit(lambda *t: mxfp8_matmul(*t, out_dtype=jnp.float32, implementation="xla"))
                    got, want = gemm(a8, sa, b8, sb).astype(jnp.float32), ref(a8, sa, b8, sb)
                    row[f"{name}_rel_err_vs_reference_bf16_out"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                    del got, want
                del a8, sa, b8, sb
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = repr(e)[:300]
        del a, b
        if "bf16_xla" in row:
            row["speedup_vs_bf16"] = {
                key: row["bf16_xla"] / v for key, v in row.items() if key.endswith("_gemm") or key == "bf16_xla_k_major"
            }
        rows.append(row)
        shown = {k_: (round(v * 1e6, 1) if k_.endswith("_gemm") or k_.startswith("bf16_xla") else v) for k_, v in row.items()}
        log(f"model {kind} {m}x{n}x{k} (times in us): " + json.dumps({k_: v for k_, v in shown.items() if k_ not in ("speedup_vs_bf16", "flops")}))
        if "speedup_vs_bf16" in row:
            log("  speedup vs bf16: " + json.dumps({k_: round(v, 3) for k_, v in row["speedup_vs_bf16"].items()}))
    return rows


def fusion_count(f, *args) -> dict:
    """Fusions, custom calls and transposes/copies in the ENTRY computation of `f`'s optimized HLO."""
    hlo = jax.jit(f).lower(*args).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    return {
        "fusions": len(re.findall(r" fusion\(", entry)),
        "custom_calls": len(re.findall(r" custom-call\(", entry)),
        "transposes_or_copies": len(re.findall(r" (?:transpose|copy)\(", entry)),
    }


def model_quantization(log, m, deadline, widths=(1024, 4096)):
    """Quantization passes at `[m, width]` (plain, fused with RMSNorm, fused with GELU) beside a bf16 copy."""
    res = {}
    for width in widths:
        if time.monotonic() > deadline:
            res[f"{m}x{width}"] = {"error": "skipped: time budget spent"}
            continue
        x = jax.random.normal(jax.random.key(5), (m, width), jnp.bfloat16)
        g = jnp.ones((width,), jnp.bfloat16)
        fns = {"copy_bf16": lambda x, g: x * 2}
        variants = (("32x32", (32, 32), "xla"), ("1x128_xla", (1, 128), "xla"), ("1x128_kernel", (1, 128), "pallas"))
        signs = hadamard_signs(width)  # Fp8Recipe(hadamard=True)'s rotation
        for label, block, impl in variants:
            fns[f"quantize_{label}"] = lambda x, g, b=block, i=impl: quantize_mxfp8(x, block=b, implementation=i)
            fns[f"rmsnorm_quantize_{label}"] = lambda x, g, b=block, i=impl: rmsnorm_quantize_mxfp8(x, g, block=b, implementation=i)
            fns[f"gelu_quantize_{label}"] = lambda x, g, b=block, i=impl: gelu_quantize_mxfp8(x, block=b, implementation=i)
            if block == (1, 128):  # with the random Hadamard rotation (in the kernel's pass on the kernel path)
                fns[f"hadamard_quantize_{label}"] = lambda x, g, i=impl: quantize_mxfp8(x, block=(1, 128), hadamard_signs=signs, implementation=i)
                fns[f"hadamard_rmsnorm_quantize_{label}"] = lambda x, g, i=impl: rmsnorm_quantize_mxfp8(
                    x, g, block=(1, 128), hadamard_signs=signs, implementation=i
                )
                fns[f"hadamard_gelu_quantize_{label}"] = lambda x, g, i=impl: gelu_quantize_mxfp8(
                    x, bias=g, block=(1, 128), hadamard_signs=signs, implementation=i
                )
        for label, fn in fns.items():
            try:
                res[f"{m}x{width}_{label}"] = {"seconds": jax_time(jax.jit(fn), x, g, **MODEL_TIMING), **fusion_count(fn, x, g)}
            except Exception as e:  # noqa: BLE001
                res[f"{m}x{width}_{label}"] = {"error": repr(e)[:300]}
            log(f"model quantization {m}x{width} {label}: {res[f'{m}x{width}_{label}']}")
    return res


def quantize_kernel_check(log, smoke=False) -> dict:
    """The one-pass quantize kernel against the jnp reference on the GPU, bit for bit.

    Cases: rows not a multiple of the kernel's 64, one row, one 128-column block, an all-zero
    tile, NaN- and Inf-poisoned rows (slack), values near E4M3's subnormal edge and above 448,
    and fresh random inputs at the model's width, each op also with the random Hadamard
    rotation of `Fp8Recipe(hadamard=True)` for the plain, RMSNorm and GELU quantizations. Counts the
    data and scale bytes that differ; for GELU, bytes may differ where the GPU's `tanhf` and
    XLA's tanh differ by an ulp; with the rotation, where the kernel's dot sums in another
    order than XLA's (a scale byte where a tile's amax sits at a scale boundary).
    """
    out = {}
    cases = [(200, 512, 0), (1, 128, 1), (65, 1024, 2)] + ([] if smoke else [(4099, 4096, 3)])
    for m, k, seed in cases:
        kx, kg = jax.random.split(jax.random.key(seed))
        x = (jax.random.normal(kx, (m, k), jnp.float32) * jnp.exp(jax.random.normal(kg, (m, 1)) * 4)).astype(jnp.bfloat16)
        if m > 10:
            x = x.at[3].set(jnp.nan).at[7, 5].set(jnp.inf).at[9, :128].set(0).at[10, :128].set(1e-38).at[11, 3].set(3e4)
        g = jax.random.normal(kg, (k,), jnp.float32)
        ops = {
            "quantize": lambda x, i: quantize_mxfp8(x, block=(1, 128), implementation=i),
            "rmsnorm": lambda x, i: rmsnorm_quantize_mxfp8(x, g, block=(1, 128), implementation=i),
            "gelu": lambda x, i: gelu_quantize_mxfp8(x, block=(1, 128), implementation=i),
            "gelu_bias": lambda x, i: gelu_quantize_mxfp8(x, bias=g, block=(1, 128), implementation=i),
            "hadamard_quantize": lambda x, i: quantize_mxfp8(x, block=(1, 128), hadamard_signs=hadamard_signs(k), implementation=i),
            "hadamard_rmsnorm": lambda x, i: rmsnorm_quantize_mxfp8(x, g, block=(1, 128), hadamard_signs=hadamard_signs(k), implementation=i),
            "hadamard_gelu_bias": lambda x, i: gelu_quantize_mxfp8(x, bias=g, block=(1, 128), hadamard_signs=hadamard_signs(k), implementation=i),
        }
        for name, op in ops.items():
            got = jax.jit(lambda x, op=op: op(x, "pallas"))(x)
            want = jax.jit(lambda x, op=op: op(x, "xla"))(x)
            diff = [int(jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint8) != jax.lax.bitcast_convert_type(b, jnp.uint8))) for a, b in zip(got, want)]
            out[f"{name}_{m}x{k}"] = {"data_bytes_differing": diff[0], "scale_bytes_differing": diff[1], "elements": m * k}
            log(f"quantize kernel check {name} {m}x{k}: {out[f'{name}_{m}x{k}']}")
    return out


def run_quantize(args, result, log):
    """The `--quantize` run: the quantize kernel's GPU check, then its timings beside XLA's passes."""
    global MODEL_TIMING
    m, widths = (MODEL_M[0], (1024, 3072, 4096)) if not args.smoke else (256, (128,))
    if args.smoke:
        MODEL_TIMING = {"iters": 1, "reps": 1}
    result["timing"] = f"median of {MODEL_TIMING['reps']} x mean of {MODEL_TIMING['iters']} back-to-back calls; seconds per call"
    result["quantize_kernel_check"] = quantize_kernel_check(log, smoke=args.smoke)
    result["model_quantization"] = model_quantization(log, m, time.monotonic() + args.time_budget, widths=widths)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"wrote {args.out}")


def run_model_shapes(args, result, log):
    """The `--model-shapes` run: sweep, GEMMs, quantization passes; the JSON is rewritten after each part."""
    global MODEL_M, MODEL_KN, MODEL_SWEEP_SHAPES, MODEL_TIMING
    if args.smoke:
        MODEL_M, MODEL_KN = (256,), ((128, 384), (512, 128))
        MODEL_SWEEP_SHAPES, MODEL_TIMING = ((256, 384, 128), (256, 128, 512)), {"iters": 1, "reps": 1}
        for name in MODEL_SWEEP:
            MODEL_SWEEP[name] = MODEL_SWEEP[name][:2]
    deadline = time.monotonic() + args.time_budget

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    result["timing"] = f"median of {MODEL_TIMING['reps']} x mean of {MODEL_TIMING['iters']} back-to-back calls; seconds per call"
    result["time_budget_s"] = args.time_budget
    best, result["model_sweep"] = model_sweep(log, deadline)
    result["model_chosen_configs"] = {f"{name}_K{k}": repr(cfg) for (name, k), cfg in best.items()}
    save()
    result["model_gemms"] = []
    for row in model_gemms(log, best, deadline, model_problems(MODEL_M, MODEL_KN)):
        result["model_gemms"].append(row)
        save()
    result["model_quantization"] = model_quantization(log, MODEL_M[0], deadline, widths=sorted({k for k, _ in MODEL_KN}))
    save()
    log(f"wrote {args.out}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--ours-only", action="store_true", help="only bf16 XLA (the reference peer) and our kernels")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in Mosaic GPU interpret mode (CPU check of this script)")
    p.add_argument("--model-shapes", action="store_true", help="the GEM-width model's GEMM shapes (see the module docstring)")
    p.add_argument("--quantize", action="store_true", help="the 1x128 quantize kernel: GPU check against the reference, timings beside XLA")
    p.add_argument("--time-budget", type=float, default=170.0, help="--model-shapes, --quantize: seconds after which remaining timings are skipped")
    args = p.parse_args()
    if args.smoke:
        global SHAPES, SWEEP_SHAPE, CHECK_SHAPES, SMOKE, ITERS, REPS
        SHAPES, SWEEP_SHAPE, CHECK_SHAPES = [(256, 256, 256)], (256, 256, 256), [(300, 200, 260)]
        SMOKE, ITERS, REPS = True, 1, 1
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.set_gpu_interpret_mode(plgpu.InterpretGPUParams())
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    device = jax.devices()[0]
    result = {
        "gpu": device.device_kind,
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "timing": "median of 5 x mean of 20 back-to-back calls (sweep: 3 x 10); seconds per call",
    }
    if args.model_shapes:
        return run_model_shapes(args, result, log)
    if args.quantize:
        return run_quantize(args, result, log)
    try:
        import torch

        result["torch_version"] = torch.__version__
    except ImportError:
        args.skip_torch = True
    best = sweep(log)
    result["sweep"] = {name: table for name, (_, table) in best.items()}
    result["chosen_configs"] = {name: repr(cfg) for name, (cfg, _) in best.items()}
    result["correctness"] = check_correctness(log, {name: cfg for name, (cfg, _) in best.items()})
    if args.ours_only:
        args.skip_torch = True
    result["shapes"] = []
    for m, n, k in SHAPES:
        a, b = inputs(m, n, k)
        row = {"M": m, "N": n, "K": k, "flops": 2 * m * n * k}
        try:
            if args.ours_only:
                dims = (((1,), (1,)), ((), ()))
                bf16 = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.bfloat16))
                row["bf16_xla"] = jax_time(bf16, a, b)
            else:
                row.update(jax_peers(a, b, log))
        except Exception as e:  # noqa: BLE001
            row["jax_peers_error"] = repr(e)[:400]
        for name, (cfg, _) in best.items():
            try:
                row.update(ours(a, b, name, cfg, log, gemm_only=args.ours_only))
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = repr(e)[:400]
                traceback.print_exc()
        if not args.skip_torch:
            try:
                row.update(torch_peers(m, n, k, log))
            except Exception as e:  # noqa: BLE001
                row["torch_error"] = repr(e)[:400]
        base = row.get("bf16_xla")
        if base:
            row["speedup_vs_bf16"] = {
                key: base / v for key, v in row.items() if isinstance(v, float) and key != "bf16_xla" and "err" not in key and not key.endswith("_quant")
            }
        log(f"shape {m}x{n}x{k}: " + json.dumps({k_: (round(v * 1e6, 1) if isinstance(v, float) else v) for k_, v in row.items() if k_ != "speedup_vs_bf16"}))
        if base:
            log("  speedup vs bf16: " + json.dumps({k_: round(v, 3) for k_, v in row["speedup_vs_bf16"].items()}))
        result["shapes"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if not args.smoke:
        try:
            result["layer"] = layer_check(log, best, sizes=[(16384, 4096, 4096)] if args.ours_only else None)
        except Exception as e:  # noqa: BLE001
            result["layer_error"] = repr(e)[:400]
            traceback.print_exc()
    if not args.ours_only:
        quant_shapes = [(256, 256)] if args.smoke else [(8192, 8192), (65536, 1024)]
        result["quantization"] = {f"{m}x{k}": quant_costs(m, k, log) for m, k in quant_shapes}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
