"""What a config's train step runs on an H200, from XLA's own GPU compile on a machine without one.

XLA compiles for a GPU it cannot see when it is given the GPU's description: the CUDA PJRT
plugin builds a compile-only device from a `GpuTargetConfigProto` (`benchmarks/h200_target.txtpb`,
through `jax.experimental.topologies.get_topology_desc(..., target_config=...)`), and
`jit(...).lower(...).compile()` on that device runs the whole GPU pipeline: fusion, layout,
cuBLAS GEMM rewriting, scheduling, buffer assignment, thunk emission. The step is the trainer's
own (`gem_jax.train.setup.setup_training`, abstract state, the benchmark's first batch); inside
`pallas_kernels.compiling_for` the ops choose and size their Mosaic GPU kernels for that device.

It compiles with the XLA flags a training run sets (`gem_jax.xla_options`), plus any `--xla`
options. The result is the step's kernel list as the GPU runs it (XLA's thunk sequence: every launch, in
order), and for each fusion kernel its launches, the bytes its operands and result take per
launch (an upper bound on its HBM traffic where a fusion reads only part of an operand: slices,
in-place scatters), its launch grid and the model lines it runs (`benchmarks/_hlo_sources.py`);
the compiled memory (arguments, temporaries); the GEMMs by operand and output types; the sorts;
and every Pallas kernel call (Triton and Mosaic GPU custom calls) by the op that traced it, with
its operands' and results' bytes (a memory-bound row kernel's traffic).

What differs from the GPU's compile: no autotuning (cuBLAS algorithms are picked at run time
anyway; Triton GEMMs are off in `gem_jax.xla_options`), and sorts take XLA's fallback emitter
instead of CUB (XLA says so in a warning: the deviceless CUB scratch sizes are missing). On
`configs/gem_h200.py` at the tree measured on the GPU (682d161) it gives the same fusion kernels
with the same launch counts as the CUPTI profile of `train_bench.py --profile`, and the same
compiled memory (80.7 GB against 80.8 GB peak).

`--profile` joins a `train_bench.py --profile` result of the same config (the program it
measured: a kernel joins by name and launch count): each measured fusion's milliseconds and the
bandwidth its bytes imply, so a kernel far below the H200's 4.8 TB/s stands out, and the measured
time summed by the model line each kernel mostly runs. `--compare` prints what changed against
another run of this script (a variant's `--set`, another tree, other `--xla` options): fusion
launches, bytes, memory, and a predicted change of the step: the bytes that went or came
(fusions', the GEMMs' outputs: an epilogue that takes over a fusion writes more, and the Pallas
kernels' operands and results, when the compared record counted them) at the
bandwidth the measured fusions reach (the compared run's `--profile` median, else the target's
peak), with the GEMMs' own time and the kernels unchanged.

Needs the CUDA PJRT plugin of the installed jax, not its CUDA libraries: `pip install -e
'.[offline-compile]'` (`jax-cuda13-plugin` without its `with-cuda` extra). On a machine without a
GPU, jax then still runs on the CPU. A missing plugin, a config of more than one device, an
--xla option XLA does not know and an input file of the wrong kind are refused (exit 2) before
or instead of compiling.

    PYTHONPATH=. python3 benchmarks/offline_compile.py --config configs/gem_h200.py \\
        --profile benchmarks/results/step_h200_gem_h200_682d161.json --out offline.json
    PYTHONPATH=. python3 benchmarks/offline_compile.py --config configs/gem_h200.py \\
        --set optim.moments_dtype=bfloat16 --compare offline.json
"""

from __future__ import annotations

import argparse
import collections
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

REPO = Path(__file__).resolve().parents[1]


def _sibling(name: str):
    """`benchmarks/<name>.py` of this script's own checkout, whatever checkout `PYTHONPATH` puts
    first (the model compiled may be another tree's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"offline_compile_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_hlo_sources = _sibling("_hlo_sources")
_lowered = _sibling("_lowered")
_bytes, _operand_type = _lowered._bytes, _lowered.operand_type
TARGET = Path(__file__).with_name("h200_target.txtpb")
BANDWIDTH = float(re.search(r"memory_bandwidth: (\d+)", TARGET.read_text()).group(1))  # bytes/s, the target's HBM peak

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_KIND = re.compile(r"kind=(k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"([\w]+)"')
_THUNK = re.compile(r"^\d+: (k\w+)\s+\[[^\]]*\]\s+(\S+)(?: grid: \[([\d, ]+)\] threads: \[([\d, ]+)\])?")
_ARRAY_DTYPE = re.compile(r"([a-z][a-z0-9]*)\[")


class PluginMissing(RuntimeError):
    """The CUDA PJRT plugin that compiles for a GPU without one is not installed."""


class BadInput(ValueError):
    """An argument or input file this script cannot use (what and where named)."""


def option_value(text: str) -> bool | int | float | str:
    """An XLA flag's value as a compile option wants it: `true`/`false` as bools, numbers as numbers."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def project_xla_options() -> dict[str, bool | int | float | str]:
    """`gem_jax.xla_options.XLA_FLAGS` (the flags a training run sets) as compile options: `{name: value}`."""
    from gem_jax.xla_options import XLA_FLAGS, effective_flags

    return {name.removeprefix("--"): option_value(value) for name, value in effective_flags(" ".join(XLA_FLAGS)).items()}


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction, from the text after its opcode's `(`."""
    names = (re.sub(r"^/\*index=\d+\*/", "", o.strip()).lstrip("%") for o in rest.split(")", 1)[0].split(","))
    return [name for name in names if name]


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
    fusions: dict[str, tuple[str, str, list[str]]] = {}
    for line in hlo_text.splitlines():
        if not (match := _INSTRUCTION.match(line)):
            continue
        name, result, op, rest = match.groups()
        types[name] = re.sub(r"\{[^}]*\}", "", result)
        if op == "fusion":
            kind = _BACKEND_KIND.search(line) if "kind=kCustom" in line else None
            fusions[name] = (kind.group(1) if kind else _KIND.search(line).group(1), types[name], _operands(rest))
    table = {}
    for name, (kind, result, operands) in fusions.items():
        table[_hlo_sources.kernel_name(name)] = {
            "kind": kind,
            "result": result,
            "bytes": _bytes(result) + sum(_bytes(_operand_type(types, o)) for o in operands),
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
        if "custom-call(" not in line or 'custom_call_target="__cublas' not in line or not (match := _INSTRUCTION.match(line)):
            continue
        dtypes = [(_ARRAY_DTYPE.findall(_operand_type(types, o)) or ["?"])[0] for o in _operands(match.group(4))[:2]]
        result = types[match.group(1)]
        counts[f"{' x '.join(dtypes)} -> {_ARRAY_DTYPE.findall(result)[0]}"] += 1
        written += _bytes(re.sub(r"s8\[[\d,]*\]", "", result))
    return counts, written


_KERNEL_TARGETS = ('custom_call_target="__gpu$xla.gpu.triton"', 'custom_call_target="mosaic_gpu')  # Pallas: Triton, Mosaic GPU
_OP_NAME = re.compile(r'op_name="(?:jit\(train_step\)/)?([^"]*?)(?:/pallas_call|/mpmd_map)?"')


def pallas_kernels(hlo_text: str, types: dict[str, str]) -> list[dict]:
    """Every Pallas kernel call of the optimized module (Triton and Mosaic GPU custom calls), grouped by the op
    path that traced it (e.g. "jvp()/rms_norm_forward", "transpose(jvp())/jit(gdpa)/gdpa_bwd_dq"): `calls` and
    `bytes`, its operands' and results' summed over the calls, most bytes first. For a memory-bound kernel
    (a row kernel reading and writing each element once) that is its traffic; a compute-bound one's bytes
    are a lower bound of no use alone, but cancel between two compiles where it is unchanged."""
    groups: dict[str, dict] = {}
    for line in hlo_text.splitlines():
        if "custom-call(" not in line or not any(t in line for t in _KERNEL_TARGETS) or not (match := _INSTRUCTION.match(line)):
            continue
        name = (op_name.group(1) if (op_name := _OP_NAME.search(line)) else match.group(1))
        entry = groups.setdefault(name, {"name": name, "calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += _bytes(types[match.group(1)]) + sum(_bytes(_operand_type(types, o)) for o in _operands(match.group(4)))
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def kernel_table(hlo_text: str, thunk_text: str, root: str | Path = REPO) -> dict:
    """The step as the GPU runs it: launches by kind, GEMM types, sorts, and every fusion kernel
    (`launches`, `grid`, `threads`, `kind`, `result`, `bytes` per launch, `sources`: paths relative
    to `root`, the checkout whose model was compiled), most bytes first."""
    kinds, launched = launches(thunk_text)
    types, fusions = instructions(hlo_text)
    sources = _hlo_sources.kernel_sources(hlo_text, root=str(root))
    kernels = []
    for name, launch in launched.items():
        fusion = fusions.get(name)
        if fusion is None:  # a kernel XLA emits without a fusion instruction of its name (rare; reported as such)
            kernels.append({"name": name, **launch})
            continue
        kernels.append({"name": name, **launch, **fusion, "sources": sources.get(name, [])})
    kernels.sort(key=lambda k: -k.get("bytes", 0) * k["launches"])
    gemm_types, gemm_bytes = gemms(hlo_text, types)
    pallas = pallas_kernels(hlo_text, types)
    return {
        "thunks": dict(kinds),
        "gemms": dict(gemm_types),
        "gemm_output_bytes": gemm_bytes,
        "sorts": sum(1 for line in hlo_text.splitlines() if " sort(" in line),
        "fusion_bytes": sum(k.get("bytes", 0) * k["launches"] for k in kernels),
        "pallas_kernel_bytes": sum(g["bytes"] for g in pallas),
        "pallas_kernels": pallas,
        "kernels": kernels,
    }


def join_profile(kernels: list[dict], profile: dict) -> dict:
    """Adds each measured fusion's `ms` (all its launches) and implied `tb_per_s` from a
    `train_bench.py --profile` result of the same program.

    A kernel joins by name only with the same launch count (XLA numbers fusions per program:
    the same name in another program can be another fusion); one whose implied bandwidth is
    above the target's peak has fewer bytes than its operands' (a slice, an in-place update) and
    is marked `bytes_overcounted`, out of the median.

    Returns:
      `{"matched", "median_tb_per_s" (of the kernels not overcounted), "measured_ms" (matched),
      "profile_commit", "unmatched" (names measured here with another launch count)}`.
    """
    measured = {k["name"]: k for k in profile["runs"][0]["profile"]["top_kernels"]}
    rates, total, unmatched = [], 0.0, []
    for kernel in kernels:
        if (m := measured.get(kernel["name"])) is None or "bytes" not in kernel:
            continue
        if m["calls"] != kernel["launches"]:
            unmatched.append(kernel["name"])
            continue
        kernel["ms"] = m["ms"]
        kernel["tb_per_s"] = kernel["bytes"] * m["calls"] / (m["ms"] * 1e-3) / 1e12
        total += m["ms"]
        if kernel["tb_per_s"] * 1e12 > BANDWIDTH:
            kernel["bytes_overcounted"] = True
        else:
            rates.append(kernel["tb_per_s"])
    return {
        "matched": sum(1 for k in kernels if "ms" in k),
        "median_tb_per_s": statistics.median(rates) if rates else None,
        "measured_ms": total,
        "profile_commit": profile.get("git_commit"),
        "unmatched": unmatched,
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

    rate = (old.get("profile") or {}).get("median_tb_per_s") or BANDWIDTH / 1e12
    delta = new["fusion_bytes"] - old["fusion_bytes"] + new["gemm_output_bytes"] - old["gemm_output_bytes"]
    # Pallas kernels' operand and result bytes: a record written before this script counted them has none (not in the delta).
    kernel_change = new["pallas_kernel_bytes"] - old["pallas_kernel_bytes"] if "pallas_kernel_bytes" in old else None
    delta += kernel_change or 0
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
        "pallas_kernel_bytes_change": kernel_change,
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
        f"  fusion bytes (operands and results: an upper bound on their traffic): {result['fusion_bytes'] / gb:.1f} GB a step "
        f"({result['fusion_bytes'] / BANDWIDTH * 1e3:.1f} ms at {BANDWIDTH / 1e12:.1f} TB/s); GEMM outputs {result['gemm_output_bytes'] / gb:.1f} GB",
        f"  Pallas kernels: {sum(g['calls'] for g in result['pallas_kernels'])} calls, operands and results "
        f"{result['pallas_kernel_bytes'] / gb:.1f} GB a step ("
        + ", ".join(f"{g['name']} x{g['calls']} {g['bytes'] / gb:.1f} GB" for g in result["pallas_kernels"][:6]) + ")",
        "  kernel                              launches  GB a launch  [measured ms, implied TB/s]  source line",
    ]
    for k in result["kernels"][:25]:
        over = " (bytes overcounted)" if k.get("bytes_overcounted") else ""
        measured = f" {k['ms']:6.2f} ms {k['tb_per_s']:4.2f} TB/s{over}" if "ms" in k else ""
        source = (k.get("sources") or ["?"])[0]
        lines.append(f"  {k['name'][:36]:36s} x{k['launches']:<3d} {k.get('bytes', 0) / gb:6.2f} GB{measured}  {source}")
    if "profile" in result:
        lines.append(f"  measured fusions by source line ({result['profile']['matched']} kernels, {result['profile']['measured_ms']:.1f} ms):")
        for g in result["profile"]["by_source"][:12]:
            lines.append(f"    {g['ms']:6.2f} ms {g['bytes'] / gb:6.2f} GB x{g['launches']:<3d} {g['source']}")
    return "\n".join(lines)


def _read_json(path: str, what: str, keys: tuple[str, ...]) -> dict:
    """A JSON input, checked to hold `keys` (a dotted key names a nested one).

    Raises:
      BadInput: the file is missing, not JSON, or lacks a key (all named).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise BadInput(f"{what} {path}: {error}") from error
    for key in keys:
        node = data
        for part in key.split("."):
            if isinstance(node, list) and part.isdigit():
                node = node[int(part)] if int(part) < len(node) else None
            else:
                node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise BadInput(f"{what} {path} has no {key!r}: not a {'train_bench.py --profile result' if what == '--profile' else 'result of this script'} (or one written before the field existed: re-run it)")
    return data


def _inputs(args) -> tuple[dict, dict | None, dict | None]:
    """`(extra XLA options, --profile JSON, --compare JSON)`, read and checked before anything compiles.

    Raises:
      BadInput: an --xla option not KEY=VALUE, a JSON input that is not what it should be, or a
        profile of another config or overrides than this compile's.
    """
    bad = [option for option in args.xla if "=" not in option or not option.split("=", 1)[0]]
    if bad:
        raise BadInput(f"--xla takes KEY=VALUE options (e.g. xla_gpu_enable_triton_gemm=false), got {bad}")
    profile = compared = None
    if args.profile:
        profile = _read_json(args.profile, "--profile", ("runs.0.profile.top_kernels", "config"))
        if (Path(profile["config"]).name, profile.get("overrides") or []) != (Path(args.config).name, args.overrides):
            raise BadInput(
                f"--profile {args.profile} measured {profile['config']} {profile.get('overrides') or []}, this compile is "
                f"{args.config} {args.overrides}: kernel names are only comparable within one program"
            )
    if args.compare:
        compared = _read_json(args.compare, "--compare", ("kernels", "thunks", "fusion_bytes", "gemm_output_bytes", "memory.peak"))
    return {name: option_value(value) for name, value in (option.split("=", 1) for option in args.xla)}, profile, compared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gem_h200.py")
    parser.add_argument("--set", nargs="*", action="extend", default=[], dest="overrides", help="config overrides (gem_jax.train.config_tree)")
    parser.add_argument("--xla", nargs="*", default=[], help="XLA options on top of gem_jax.xla_options's, KEY=VALUE")
    parser.add_argument("--profile", help="a train_bench.py --profile result of the same config: measured ms per fusion kernel")
    parser.add_argument("--compare", help="another result of this script: print and record what changed")
    parser.add_argument("--dump", help="keep XLA's dumps here (default: a temporary folder)")
    parser.add_argument("--out", help="write the result JSON here")
    args = parser.parse_args(argv)

    import gem_jax
    from gem_jax.train import config_tree
    from gem_jax.train.config import load_config
    from gem_jax.train.run_record import code_version

    try:
        extra, profile, compared = _inputs(args)
        config = config_tree.apply_overrides(load_config(args.config), args.overrides)
        if config.topology.num_devices != 1:
            raise BadInput(f"{args.config} runs on {config.topology.num_devices} devices; this compiles one GPU's step: give a one-device config")
        device = h200_device()
        xla_options = {**project_xla_options(), **extra}
        with tempfile.TemporaryDirectory() as scratch:
            compiled = compile_step(config, device, args.dump or scratch, xla_options)
    except (PluginMissing, BadInput) as error:
        print(error, file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" not in str(error):
            raise
        print(f"--xla: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    result = {
        "benchmark": "offline_compile",
        "date": datetime.date.today().isoformat(),
        "target": f"{device.device_kind} ({TARGET.name}), compiled without a GPU",
        "jax": jax.__version__,
        "code": code_version(),
        "config": args.config,
        "overrides": args.overrides,
        "xla_options": xla_options,
        **{key: compiled[key] for key in ("capacity", "lower_s", "compile_s", "memory")},
        **kernel_table(compiled["hlo"], compiled["thunks"], root=Path(gem_jax.__file__).resolve().parents[1]),
    }
    if profile is not None:
        result["profile"] = join_profile(result["kernels"], profile)
        result["profile"]["by_source"] = by_source(result["kernels"])
    print(_report(result), flush=True)
    if compared is not None:
        result["compare"] = {"against": args.compare, **compare(result, compared)}
        change = result["compare"]
        if compared.get("xla_options") != xla_options:
            print(f"note: {args.compare} was compiled with other XLA options: {compared.get('xla_options')}")
        print(
            f"against {args.compare}: fusion bytes {change['fusion_bytes_change'] / 1e9:+.2f} GB, "
            f"GEMM outputs {change['gemm_output_bytes_change'] / 1e9:+.2f} GB, "
            + (f"Pallas kernels {change['pallas_kernel_bytes_change'] / 1e9:+.2f} GB, " if change["pallas_kernel_bytes_change"] is not None
               else "Pallas kernels not in the compared record, ")
            + f"predicted {change['predicted_ms_change']:+.2f} ms at {change['at_tb_per_s']:.2f} TB/s; "
            f"launches {change['launches_change']}; peak memory {change['peak_memory_change'] / 1e9:+.2f} GB"
        )
        for c in change["largest_changes"][:10]:
            print(f"  {c['name'][:36]:36s} {c['bytes_before'] / 1e9:7.2f} -> {c['bytes_after'] / 1e9:7.2f} GB  {(c['sources'] or ['?'])[0]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
