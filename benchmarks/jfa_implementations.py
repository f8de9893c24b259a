"""JFA's implementations on one GPU through the public op: what None picks, correctness of each, and time.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/jfa_implementations.py --out benchmarks/results/jfa_implementations_h200.json

1. `pallas_kernels.describe_choice` for JFA, GDPA and MXFP8 at a few dtypes and head dims.
2. `jagged_flash_attention(..., implementation=impl)` for impl in pallas, cudnn and None against
   "xla" (the float32 jnp reference): forward and dQ/dK/dV, bf16, edge lengths (0, 1, 63-65, 130,
   1000), NaN slack rows, D 64 and 128, causal and not; q/k/v also as a jagged container under jit.
3. Forward+backward time of the Pallas kernels, the "cudnn" path (scatter to `[B, max_seq_len, H, D]`,
   cuDNN with lengths, gather back: the layout change included) and cuDNN on ready-padded inputs
   (the peer `jfa_bench.py` times), on the long-tailed B=64 lengths. Device time from CUPTI
   (median of `--iters` calls) and wall time.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from benchmarks import _timing
from benchmarks.jfa_bench import HEADS, lognormal_lengths, offsets_of, packed_inputs, real_flops, to_padded
from gem_jax.jagged import Jagged


def choices() -> dict:
    out = {}
    for op, dtype, dim in [
        ("jagged_flash_attention", jnp.bfloat16, 128),
        ("jagged_flash_attention", jnp.bfloat16, 96),
        ("jagged_flash_attention", jnp.float32, 64),
        ("gdpa", jnp.bfloat16, 64),
        ("gdpa", jnp.bfloat16, 96),
        ("mxfp8_matmul", jnp.float8_e4m3fn, None),
    ]:
        choice = pallas_kernels.describe_choice(op, dtype, dim)
        out[f"{op} {jnp.dtype(dtype).name} D={dim}"] = [choice.implementation.value, choice.reason]
    return out


def value_and_grads(impl, q, k, v, g, offsets, n, causal):
    f = functools.partial(
        pallas_kernels.jagged_flash_attention, offsets=offsets, max_seq_len=n, causal=causal, implementation=impl
    )
    return [np.asarray(x.astype(jnp.float32)) for x in jax.jit(_timing.forward_backward(f))(q, k, v, g)]


def compare(got, want, end) -> dict:
    report = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        scale = float(np.max(np.abs(b[:end]))) if end else 0.0
        err = float(np.max(np.abs(a[:end] - b[:end]))) if end else 0.0
        report[name] = {
            "rel": err / max(scale, 1e-9),
            "nonfinite": int(np.sum(~np.isfinite(a))),
            "slack_max_abs": float(np.max(np.abs(a[end:]))) if a.shape[0] > end else 0.0,
        }
    report["ok"] = all(r["rel"] <= 2e-2 and r["nonfinite"] == 0 and r["slack_max_abs"] == 0.0 for r in report.values())
    return report


def checks() -> tuple[bool, list]:
    lengths = np.array([0, 1, 63, 64, 65, 0, 7, 130, 1000, 3], np.int32)
    end = int(lengths.sum())
    offsets = jnp.asarray(offsets_of(lengths))
    n = int(lengths.max())
    results, all_ok = [], True
    for dim, causal in [(64, False), (128, True)]:
        q, k, v, g = packed_inputs(lengths, end + 13, dim, seed=dim)
        want = value_and_grads("xla", q, k, v, g, offsets, n, causal)
        for impl in ("pallas", "cudnn", None):
            entry = dict(impl=str(impl), dim=dim, causal=causal)
            try:
                entry.update(compare(value_and_grads(impl, q, k, v, g, offsets, n, causal), want, end))
            except Exception as e:
                entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:400])
                traceback.print_exc()
            all_ok &= entry["ok"]
            results.append(entry)
            print(json.dumps(entry), flush=True)
        # The same call with q, k, v as jagged containers (pytree arguments of a jitted function).
        attend = jax.jit(lambda q, k, v: pallas_kernels.jagged_flash_attention(q, k, v, causal=causal))
        got = attend(*(Jagged(x, offsets, n) for x in (q, k, v)))
        ok = isinstance(got, Jagged) and bool(
            np.array_equal(np.asarray(got.values[:end], np.float32), np.asarray(
                pallas_kernels.jagged_flash_attention(q, k, v, offsets, max_seq_len=n, causal=causal)[:end], np.float32))
        )
        results.append(dict(impl="None, jagged containers", dim=dim, causal=causal, ok=ok))
        all_ok &= ok
        print(json.dumps(results[-1]), flush=True)
    return all_ok, results


def timings(iters: int) -> dict:
    lengths = lognormal_lengths(64, 0)
    n, causal, dim = 1024, True, 128
    capacity = int(lengths.sum())
    offsets = jnp.asarray(offsets_of(lengths))
    q, k, v, g = packed_inputs(lengths, capacity, dim, seed=1, poison=False)
    lens = jnp.asarray(lengths)

    def jfa(impl):
        return lambda q, k, v: pallas_kernels.jagged_flash_attention(
            q, k, v, offsets, max_seq_len=n, causal=causal, implementation=impl
        )

    def cudnn_padded(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=lens, key_value_seq_lengths=lens, implementation="cudnn"
        )

    padded = [to_padded(x, lengths, n) for x in (q, k, v, g)]
    cases = {
        "jfa_pallas": (jfa("pallas"), (q, k, v, g)),
        "jfa_cudnn_path": (jfa("cudnn"), (q, k, v, g)),
        "cudnn_ready_padded": (cudnn_padded, padded),
    }
    flops = real_flops(lengths, causal) * 3.5
    out = dict(lengths="long_tailed_b64", batch=64, max_seq_len=n, heads=HEADS, head_dim=dim, causal=causal)
    for name, (f, args) in cases.items():
        run = jax.jit(_timing.forward_backward(f))
        dev = _timing.device_ms(run, args, iters)
        wall = _timing.wall_seconds(run, *args, iters=iters, reps=5) * 1e3
        out[name] = dict(fwd_bwd_device_ms=dev, fwd_bwd_wall_ms=wall, tflops_device=flops / dev / 1e9 if dev else None)
        print(name, out[name], flush=True)
    for peer in ("jfa_cudnn_path", "cudnn_ready_padded"):
        if out[peer]["fwd_bwd_device_ms"] and out["jfa_pallas"]["fwd_bwd_device_ms"]:
            out[f"pallas_speedup_vs_{peer}_device"] = out[peer]["fwd_bwd_device_ms"] / out["jfa_pallas"]["fwd_bwd_device_ms"]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    record = dict(
        gpu=jax.devices()[0].device_kind,
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        heads=HEADS,
    )
    record["choices"] = choices()
    print(json.dumps(record["choices"], indent=1), flush=True)
    record["checks_ok"], record["checks"] = checks()
    record["timing"] = timings(args.iters)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("checks_ok", record["checks_ok"])


if __name__ == "__main__":
    main()
