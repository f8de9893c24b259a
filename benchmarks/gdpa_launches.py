"""The XLA kernels a GDPA forward call launches around its Mosaic GPU kernel, from XLA's H200 compile.

No GPU needed: the forward of each dense shape of `gdpa_bench.py` (H = 4, D = 128, bf16, GELU;
offsets as arguments, so the work list is built in the call) is jitted alone and compiled for the
compile-only H200 of `offline_compile.py` (the CUDA PJRT plugin and `benchmarks/h200_target.txtpb`).
Every launch is read from XLA's thunk sequence; each XLA kernel is filed as part of the work list
when all it writes is integers or booleans (the list is integer bookkeeping: lengths, cumulative
sums, the counting sort, the per-CTA table), else as data (tail windows, padding, the partial sums
of the columns split). A launch of this kind is a few microseconds of latency whatever its size
(`benchmarks/gdpa.md`, "The work list's launches").

    PYTHONPATH=. python3 benchmarks/gdpa_launches.py --out gdpa_launches.json [--shapes cross,pooled,self]

Needs the CUDA PJRT plugin (`pip install -e '.[offline-compile]'`); exit 2 without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import offline_compile
from pallas_kernels import gdpa

HEADS, DIM = 4, 128
# name: (sequences, query rows each, key rows each, queries shared by every sequence)
SHAPES = {
    "cross": (256, 1024, 64, False),
    "pooled": (256, 32, 1024, True),
    "self": (128, 512, 512, False),
}
LIST_TYPES = ("s32", "u32", "s64", "pred")  # what the work list's kernels write


def compile_forward(device: jax.Device, batch: int, lq: int, lkv: int, broadcast_q: bool, dump_dir: str) -> dict:
    """Compiles one GDPA forward for `device`; returns `{"hlo", "thunks"}` (optimized HLO and thunk sequence text).

    Abstract inputs: q bf16 `[batch * lq, 4, 128]` (`[lq, 4, 128]` with `broadcast_q`), k and v bf16
    `[batch * lkv, 4, 128]`, offsets int32 `[batch + 1]`. XLA's dumps go to `dump_dir`.

    Raises:
      ValueError: `dump_dir` holds no thunk sequence, or more than one (it must be empty).
    """
    sharding = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((lq if broadcast_q else batch * lq, HEADS, DIM), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((batch * lkv, HEADS, DIM), jnp.bfloat16, sharding=sharding)
    offsets = jax.ShapeDtypeStruct((batch + 1,), jnp.int32, sharding=sharding)

    def forward(q, k, v, q_offsets, kv_offsets):
        return gdpa(
            q, k, v, None if broadcast_q else q_offsets, kv_offsets, max_seq_len_q=lq, max_seq_len_kv=lkv,
            activation="gelu", broadcast_q=broadcast_q, implementation="pallas",
        )

    with pallas_kernels.compiling_for(device):
        compiled = jax.jit(forward).lower(q, kv, kv, offsets, offsets).compile(compiler_options={"xla_dump_to": dump_dir})
    (thunks,) = Path(dump_dir).glob("*thunk_sequence.txt")
    return {"hlo": compiled.as_text(), "thunks": thunks.read_text()}


def classify(hlo: str, thunks: str) -> dict:
    """`{"kinds", "work_list", "data"}`: launches per thunk kind, and the XLA kernels (name -> launches, result type)
    that write only integers or booleans (the work list) and the others."""
    kinds, kernels = offline_compile.launches(thunks)
    _, fusions = offline_compile.instructions(hlo)
    out = {"kinds": dict(kinds), "work_list": {}, "data": {}}
    for name, entry in kernels.items():
        result = fusions.get(name, {}).get("result", "?")
        element_types = {t for t in result.replace("(", " ").replace(",", " ").split() if "[" in t}
        integer = bool(element_types) and all(t.split("[")[0] in LIST_TYPES for t in element_types)
        out["work_list" if integer else "data"][name] = {"launches": entry["launches"], "result": result}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    try:
        device = offline_compile.h200_device()
    except offline_compile.PluginMissing as exc:
        print(exc, file=sys.stderr)
        return 2
    record = {"jax": jax.__version__, "target": "benchmarks/h200_target.txtpb", "heads": HEADS, "head_dim": DIM, "shapes": {}}
    for name in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as dump:
            result = classify(**compile_forward(device, *SHAPES[name], dump))
        record["shapes"][name] = {"shape": SHAPES[name], **result}
        print(f"{name}: {len(result['work_list'])} work-list kernels, {len(result['data'])} others, {result['kinds']}")
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
