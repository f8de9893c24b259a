"""What a config's train step runs on an H200, from XLA's own GPU compile on a machine without one.

XLA compiles for a GPU it cannot see when it is given the GPU's description: the CUDA PJRT
plugin builds a compile-only device from a `GpuTargetConfigProto` (`benchmarks/h200_target.txtpb`,
through `jax.experimental.topologies.get_topology_desc(..., target_config=...)`), and
`jit(...).lower(...).compile()` on that device runs the whole GPU pipeline: fusion, layout,
cuBLAS GEMM rewriting, scheduling, buffer assignment, thunk emission. The step is the trainer's
own (`gem_jax.train.setup.setup_training`, abstract state, the benchmark's first batch); inside
`pallas_kernels.compiling_for` the ops choose and size their Mosaic GPU kernels for that device.

The result is the step's kernel list as the GPU runs it (XLA's thunk sequence: every launch, in
order), and for each fusion kernel its launches, the bytes its operands and result take per
launch (an upper bound on its HBM traffic where a fusion reads only part of an operand: slices,
in-place scatters), its launch grid and the model lines it runs (`benchmarks/_hlo_sources.py`);
the compiled memory (arguments, temporaries); the GEMMs by operand and output types; the sorts.

What differs from the GPU's compile: no autotuning (cuBLAS algorithms are picked at run time
anyway; Triton GEMMs are off in `scripts/xla_flags.py`), and sorts take XLA's fallback emitter
instead of CUB (XLA says so in a warning: the deviceless CUB scratch sizes are missing). On
`configs/gem_h200.py` at the tree measured on the GPU (682d161) it gives the same fusion kernels
with the same launch counts as the CUPTI profile of `train_bench.py --profile`, and the same
compiled memory (80.7 GB against 80.8 GB peak).

`--profile` joins a `train_bench.py --profile` result: each measured fusion's milliseconds and
the bandwidth its bytes imply, so a kernel far below the H200's 4.8 TB/s stands out, and the
measured time summed by the model line each kernel mostly runs. `--compare` prints what changed against another run of this script (a
variant's `--set`, another tree, other XLA options): fusion launches, bytes, memory, and a
predicted change of the step: the bytes that went or came (fusions', and the GEMMs' outputs: an
epilogue that takes over a fusion writes more) at the bandwidth the measured fusions reach
(`--profile`'s median), with the GEMMs' own time and the kernels unchanged.

Needs the CUDA PJRT plugin of the installed jax, not its CUDA libraries: `pip install -e
'.[offline-compile]'` (`jax-cuda13-plugin` without its `with-cuda` extra). On a machine without a
GPU, jax then still runs on the CPU.

    PYTHONPATH=. python3 benchmarks/offline_compile.py --config configs/gem_h200.py \\
        --profile benchmarks/results/step_h200_gem_h200_682d161.json --out offline.json
    PYTHONPATH=. python3 benchmarks/offline_compile.py --config configs/gem_h200.py \\
        --set optim.moments_dtype=bfloat16 --compare offline.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the plugin's CUDA libraries are not needed to compile

import jax  # noqa: E402

from benchmarks import _hlo_sources  # noqa: E402
from benchmarks._lowered import _bytes  # noqa: E402

TARGET = Path(__file__).with_name("h200_target.txtpb")
H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e peak

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_KIND = re.compile(r"kind=(k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"([\w]+)"')
_THUNK = re.compile(r"^\d+: (k\w+)\s+\[[^\]]*\]\s+(\S+)(?: grid: \[([\d, ]+)\] threads: \[([\d, ]+)\])?")
_ARRAY_DTYPE = re.compile(r"([a-z][a-z0-9]*)\[")


class PluginMissing(RuntimeError):
    """The CUDA PJRT plugin that compiles for a GPU without one is not installed."""


def h200_device() -> jax.Device:
    """A compile-only H200 (`benchmarks/h200_target.txtpb`).

    Raises:
      PluginMissing: jax has no CUDA plugin to build it with.
    """
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("h200", "cuda", target_config=TARGET.read_text(), topology="1x1x1")
    except (NotImplementedError, RuntimeError) as exc:
        raise PluginMissing(
            f"compiling for an H200 without one needs the CUDA PJRT plugin of jax {jax.__version__}: "
            f"pip install jax-cuda13-plugin=={jax.__version__} (no CUDA libraries needed) ({exc})"
        ) from exc
    return topology.devices[0]


def compile_step(config, device: jax.Device, dump_dir: str, xla_options: dict[str, str]) -> dict:
    """Lowers and compiles `config`'s train step for `device`, XLA's dumps in `dump_dir`.

    Returns `{"lower_s", "compile_s", "capacity", "memory", "hlo", "thunks"}`: the optimized
    HLO text and the thunk sequence text.
    """
    import pallas_kernels
    from gem_jax.parallel.placement import stack_batch
    from gem_jax.train.setup import setup_training

    with pallas_kernels.compiling_for(device):
        training, _ = setup_training(config, devices=[device], init_state=False)
        host = training.dataset.train_batch(range(training.dataset.batch_size))
        capacity = int(stack_batch(host, 1, training.placement.buckets).history.values.shape[1])
        batch = training.placement.abstract(host, capacity)
        t0 = time.perf_counter()
        lowered = training.train_step.trace(training.state.abstract, batch).lower()
        t1 = time.perf_counter()
        options = {"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": ".*train_step.*", **xla_options}
        compiled = lowered.compile(compiler_options=options)
        t2 = time.perf_counter()
    stats = compiled.memory_analysis()
    memory = {key: getattr(stats, f"{key}_size_in_bytes") for key in ("argument", "output", "alias", "temp")}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    (thunks,) = Path(dump_dir).glob("*train_step.thunk_sequence.txt")
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "capacity": capacity, "memory": memory, "hlo": compiled.as_text(), "thunks": thunks.read_text()}


def launches(thunk_text: str) -> tuple[collections.Counter, dict[str, dict]]:
    """`(launches per thunk kind, {kernel name: {"launches", "grid", "threads"}})` of a thunk sequence."""
    kinds: collections.Counter = collections.Counter()
    kernels: dict[str, dict] = {}
    for line in thunk_text.splitlines():
        if not (match := _THUNK.match(line.strip())):
            continue
        kind, name, grid, threads = match.groups()
        kinds[kind] += 1
        if grid is not None:
            entry = kernels.setdefault(name, {"launches": 0, "grid": [int(g) for g in grid.split(",")], "threads": [int(t) for t in threads.split(",")]})
            entry["launches"] += 1
    return kinds, kernels


def instructions(hlo_text: str) -> tuple[dict[str, str], dict[str, dict]]:
    """`(type of every instruction, {fusion kernel name: {"kind", "result", "bytes"}})` of an optimized HLO module.

    A fusion's `bytes` are its result's and its operands' (an instruction's type without layout).
    """
    types: dict[str, str] = {}
    fusions: dict[str, tuple[str, str, list[str], str]] = {}
    for line in hlo_text.splitlines():
        if not (match := _INSTRUCTION.match(line)):
            continue
        name, result, op, rest = match.groups()
        types[name] = re.sub(r"\{[^}]*\}", "", result)
        if op == "fusion":
            operands = [o.strip().lstrip("%") for o in rest.split(")", 1)[0].split(",") if o.strip()]
            operands = [re.sub(r"^/\*index=\d+\*/", "", o).lstrip("%") for o in operands]
            kind = _BACKEND_KIND.search(line) if "kind=kCustom" in line else None
            fusions[name] = (kind.group(1) if kind else _KIND.search(line).group(1), types[name], operands, line)
    table = {}
    for name, (kind, result, operands, _) in fusions.items():
        table[_hlo_sources.kernel_name(name)] = {
            "kind": kind,
            "result": result,
            "bytes": _bytes(result) + sum(_bytes(types.get(o, "")) for o in operands),
        }
    return types, table


def gemms(hlo_text: str, types: dict[str, str]) -> tuple[collections.Counter, int]:
    """`(cuBLAS GEMMs by "<lhs> x <rhs> -> <result>" element types, the bytes they write)`.

    The bytes are every GEMM's outputs once (an epilogue's extra output, e.g. GELU_AUX's
    pre-activation, included; the s8 workspace not).
    """
    counts: collections.Counter = collections.Counter()
    written = 0
    for line in hlo_text.splitlines():
        if "custom-call(" not in line or "cublas" not in line or not (match := _INSTRUCTION.match(line)):
            continue
        operands = [o.strip().lstrip("%") for o in match.group(4).split(")", 1)[0].split(",")][:2]
        dtypes = [(_ARRAY_DTYPE.findall(types.get(o, "?[")) or ["?"])[0] for o in operands]
        result = types[match.group(1)]
        counts[f"{' x '.join(dtypes)} -> {_ARRAY_DTYPE.findall(result)[0]}"] += 1
        written += _bytes(re.sub(r"s8\[[\d,]*\]", "", result))
    return counts, written


def kernel_table(hlo_text: str, thunk_text: str) -> dict:
    """The step as the GPU runs it: launches by kind, GEMM types, sorts, and every fusion kernel
    (`launches`, `grid`, `threads`, `kind`, `result`, `bytes` per launch, `sources`), most bytes first."""
    kinds, launched = launches(thunk_text)
    types, fusions = instructions(hlo_text)
    sources = _hlo_sources.kernel_sources(hlo_text)
    kernels = []
    for name, launch in launched.items():
        fusion = fusions.get(name)
        if fusion is None:  # a kernel XLA emits without a fusion instruction of its name (rare; reported as such)
            kernels.append({"name": name, **launch})
            continue
        kernels.append({"name": name, **launch, **fusion, "sources": sources.get(name, [])})
    kernels.sort(key=lambda k: -k.get("bytes", 0) * k["launches"])
    gemm_types, gemm_bytes = gemms(hlo_text, types)
    return {
        "thunks": dict(kinds),
        "gemms": dict(gemm_types),
        "gemm_output_bytes": gemm_bytes,
        "sorts": sum(1 for line in hlo_text.splitlines() if " sort(" in line),
        "fusion_bytes": sum(k.get("bytes", 0) * k["launches"] for k in kernels),
        "kernels": kernels,
    }


def join_profile(kernels: list[dict], profile: dict) -> dict:
    """Adds each measured fusion's `ms` (all its launches) and implied `tb_per_s` from a
    `train_bench.py --profile` result; returns `{"matched", "median_tb_per_s", "measured_ms"}`."""
    run = profile["runs"][0]
    measured = {k["name"]: k for k in run["profile"]["top_kernels"]}
    rates, total = [], 0.0
    for kernel in kernels:
        if (m := measured.get(kernel["name"])) is None or "bytes" not in kernel:
            continue
        if m["calls"] != kernel["launches"]:
            kernel["measured_launches"] = m["calls"]
        kernel["ms"] = m["ms"]
        kernel["tb_per_s"] = kernel["bytes"] * m["calls"] / (m["ms"] * 1e-3) / 1e12
        rates.append(kernel["tb_per_s"])
        total += m["ms"]
    return {
        "matched": len(rates),
        "median_tb_per_s": statistics.median(rates) if rates else None,
        "measured_ms": total,
        "profile_commit": profile.get("git_commit"),
    }


def by_source(kernels: list[dict]) -> list[dict]:
    """The measured fusion kernels (`join_profile`'s) summed by the source line most of their
    instructions come from (their first `sources` entry, without its count): `{"source", "ms",
    "bytes", "launches", "kernels"}`, longest first."""
    groups: dict[str, dict] = {}
    for kernel in kernels:
        if "ms" not in kernel:
            continue
        source = re.sub(r" x\d+$", "", (kernel.get("sources") or ["?"])[0])
        group = groups.setdefault(source, {"source": source, "ms": 0.0, "bytes": 0, "launches": 0, "kernels": []})
        group["ms"] += kernel["ms"]
        group["bytes"] += kernel["bytes"] * kernel["launches"]
        group["launches"] += kernel["launches"]
        group["kernels"].append(kernel["name"])
    return sorted(groups.values(), key=lambda g: -g["ms"])


def compare(new: dict, old: dict) -> dict:
    """What changed from `old` to `new` (two results of this script), with a predicted step change."""
    def by_name(result):
        return {k["name"]: k for k in result["kernels"]}

    rate = (old.get("profile") or {}).get("median_tb_per_s") or H200_BANDWIDTH / 1e12
    delta = new["fusion_bytes"] - old["fusion_bytes"] + new["gemm_output_bytes"] - old["gemm_output_bytes"]
    old_kernels, new_kernels = by_name(old), by_name(new)
    changed = []
    for name in sorted(set(old_kernels) | set(new_kernels)):
        a, b = old_kernels.get(name, {}), new_kernels.get(name, {})
        before, after = a.get("bytes", 0) * a.get("launches", 0), b.get("bytes", 0) * b.get("launches", 0)
        if before != after:
            changed.append({"name": name, "bytes_before": before, "bytes_after": after, "sources": (b or a).get("sources", [])[:1]})
    changed.sort(key=lambda c: -abs(c["bytes_after"] - c["bytes_before"]))
    return {
        "fusion_bytes_change": new["fusion_bytes"] - old["fusion_bytes"],
        "gemm_output_bytes_change": new["gemm_output_bytes"] - old["gemm_output_bytes"],
        "predicted_ms_change": delta / (rate * 1e12) * 1e3,
        "at_tb_per_s": rate,
        "launches_change": {kind: new["thunks"].get(kind, 0) - old["thunks"].get(kind, 0) for kind in set(new["thunks"]) | set(old["thunks"])},
        "peak_memory_change": new["memory"]["peak"] - old["memory"]["peak"],
        "gemms": {"before": old["gemms"], "after": new["gemms"]},
        "largest_changes": changed[:20],
    }


def _report(result: dict) -> str:
    gb = 1e9
    lines = [
        f"{result['config']} {' '.join(result['overrides'])}: capacity {result['capacity']}, lower {result['lower_s']:.1f} s, compile {result['compile_s']:.1f} s",
        f"  memory: arguments {result['memory']['argument'] / gb:.1f} GB, temporaries {result['memory']['temp'] / gb:.1f} GB, peak {result['memory']['peak'] / gb:.1f} GB",
        f"  launches: {result['thunks']}; GEMMs: {result['gemms']}; sorts: {result['sorts']}",
        f"  fusion bytes: {result['fusion_bytes'] / gb:.1f} GB a step ({result['fusion_bytes'] / H200_BANDWIDTH * 1e3:.1f} ms at 4.8 TB/s)",
    ]
    for k in result["kernels"][:25]:
        measured = f" {k['ms']:6.2f} ms {k['tb_per_s']:4.2f} TB/s" if "ms" in k else ""
        source = (k.get("sources") or ["?"])[0]
        lines.append(f"  {k['name'][:36]:36s} x{k['launches']:<3d} {k.get('bytes', 0) / gb:6.2f} GB{measured}  {source}")
    if "profile" in result:
        lines.append(f"  measured fusions by source line ({result['profile']['matched']} kernels, {result['profile']['measured_ms']:.1f} ms):")
        for g in result["profile"]["by_source"][:12]:
            lines.append(f"    {g['ms']:6.2f} ms {g['bytes'] / gb:6.2f} GB x{g['launches']:<3d} {g['source']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gem_h200.py")
    parser.add_argument("--set", nargs="*", default=[], dest="overrides", help="config overrides (gem_jax.train.config_tree)")
    parser.add_argument("--xla", nargs="*", default=[], help="extra XLA options for this compile, KEY=VALUE (e.g. xla_gpu_enable_triton_gemm=false)")
    parser.add_argument("--profile", help="a train_bench.py --profile result to join (measured ms per fusion kernel)")
    parser.add_argument("--compare", help="another result of this script: print and record what changed")
    parser.add_argument("--dump", help="keep XLA's dumps here (default: a temporary folder)")
    parser.add_argument("--out", help="write the result JSON here")
    args = parser.parse_args(argv)

    from gem_jax.mesh import Topology
    from gem_jax.train import config_tree
    from gem_jax.train.config import load_config
    from gem_jax.train.run_record import code_version

    try:
        device = h200_device()
    except PluginMissing as exc:
        print(exc, file=sys.stderr)
        return 2
    config = config_tree.apply_overrides(load_config(args.config), args.overrides)
    config = dataclasses.replace(config, topology=Topology())  # one GPU
    xla_options = dict(option.split("=", 1) for option in args.xla)
    with tempfile.TemporaryDirectory() as scratch:
        compiled = compile_step(config, device, args.dump or scratch, xla_options)
    result = {
        "benchmark": "offline_compile",
        "date": datetime.date.today().isoformat(),
        "target": f"{device.device_kind} ({TARGET.name}), compiled without a GPU",
        "jax": jax.__version__,
        "code": code_version(),
        "config": args.config,
        "overrides": args.overrides,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_options": xla_options,
        **{key: compiled[key] for key in ("capacity", "lower_s", "compile_s", "memory")},
        **kernel_table(compiled["hlo"], compiled["thunks"]),
    }
    if args.profile:
        result["profile"] = join_profile(result["kernels"], json.loads(Path(args.profile).read_text()))
        result["profile"]["by_source"] = by_source(result["kernels"])
    print(_report(result), flush=True)
    if args.compare:
        result["compare"] = {"against": args.compare, **compare(result, json.loads(Path(args.compare).read_text()))}
        change = result["compare"]
        print(
            f"against {args.compare}: fusion bytes {change['fusion_bytes_change'] / 1e9:+.2f} GB, "
            f"GEMM outputs {change['gemm_output_bytes_change'] / 1e9:+.2f} GB, "
            f"predicted {change['predicted_ms_change']:+.2f} ms at {change['at_tb_per_s']:.2f} TB/s; "
            f"launches {change['launches_change']}; peak memory {change['peak_memory_change'] / 1e9:+.2f} GB"
        )
        for c in change["largest_changes"][:10]:
            print(f"  {c['name'][:36]:36s} {c['bytes_before'] / 1e9:7.2f} -> {c['bytes_after'] / 1e9:7.2f} GB  {(c['sources'] or ['?'])[0]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
