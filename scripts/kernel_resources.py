"""What ptxas allocates for each Mosaic GPU kernel of a fixed set of kernel calls, on any machine.

The calls are `scripts/kernel_fingerprints.py`'s cases (one public op with `implementation="pallas"`,
forward or forward and gradients). Each case is compiled in a process of its own for a
compile-only H200 (`benchmarks/offline_compile.py`'s `h200_device`, from
`benchmarks/h200_target.txtpb`), inside `pallas_kernels.compiling_for` that device, with Mosaic
GPU's ptxas report switched on (`MOSAIC_GPU_DUMP_PTXAS=1`: jaxlib writes ptxas's verbose output to
the process's standard output, which this script reads) and jax's persistent compilation cache off
(a cached executable would compile no kernel). For each kernel, in the order XLA compiles them
(not that of the program: the block-local backward comes before its forward), ptxas's
registers per thread, named barriers, stack frame bytes and spill store and spill load bytes. A
kernel whose warpgroups hand registers over at run time (`plgpu.set_max_registers`: JFA, GDPA, the
FP8 GEMM) starts every thread with the registers shown (168 for three warpgroups of 128 threads);
its compute warpgroups' pressure shows as spills.

A Hopper SM has 64K registers for the threads resident on it and a thread at most 255: code that
needs more than its thread has spills values to local memory, and their stores and loads go
through the cache hierarchy on the kernel's critical path. So a kernel change can be checked for
register pressure on a CPU before it is timed on the GPU. The numbers are those of the cases'
shapes: the sequence lengths leave them alone, but other shape constants that reach the kernel's
code can move them (the block-local backward at D=128 spills 268 B of stores with the cases' 2
heads, 276 B with 4: cases `block_local_rope_d128` and `..._h4`), so compare runs of this script
with each other, not with other calls.

    PYTHONPATH=. python3 scripts/kernel_resources.py --out before.json
    (change a kernel)
    PYTHONPATH=. python3 scripts/kernel_resources.py --compare before.json

Exit status: 0; 1 when a case did not compile, and with `--compare` when a kernel uses more
registers or spills more bytes (stores or loads) than in the file, or a case cannot be compared
with it (missing from the file, failed in either run, another number of kernels); 2 when jax has no
CUDA plugin to compile for an H200 with (`pip install -e '.[offline-compile]'`) or the file is not
one of this script's.

Not covered: the numbers are those of the ptxas in this jax's toolchain for sm_90a (a file written
under another jax is compared with a warning: its ptxas may allocate differently), not what the GPU
does with them (occupancy, timing); kernels that are not Mosaic GPU (Triton) have no report, and a
case of only such kernels lists none.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 900  # one case's compile (5 to 15 s each on 2 cores)

# ptxas's verbose report of one kernel (`ptxas -v`): the entry function it compiles, then its
# properties; `used N barriers` is left out when a kernel uses none.
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")

COLUMNS = (  # (record key, title) of the table, after the case and the kernel's index
    ("registers", "registers"),
    ("barriers", "barriers"),
    ("stack_bytes", "stack B"),
    ("spill_store_bytes", "spill stores B"),
    ("spill_load_bytes", "spill loads B"),
)
GROWTH = ("registers", "spill_store_bytes", "spill_load_bytes")  # what `--compare` fails on when it grows


def _load(path: Path, name: str):
    """The module at `path` (this checkout's), imported by its path."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_offline_compile = _load(REPO / "benchmarks" / "offline_compile.py", "kernel_resources_offline_compile")
_fingerprints = _load(REPO / "scripts" / "kernel_fingerprints.py", "kernel_resources_fingerprints")
CASES = _fingerprints.CASES
PluginMissing = _offline_compile.PluginMissing


def parse_ptxas(text: str) -> list[dict]:
    """One record per kernel of ptxas's verbose report `text`, in its order: `function`, `arch`,
    `registers`, `barriers`, `stack_bytes`, `spill_store_bytes`, `spill_load_bytes`. Lines that are
    not ptxas's are skipped.

    Raises:
      ValueError: a kernel's report without its registers or its stack frame line.
    """
    kernels: list[dict] = []
    properties_of = None  # the function whose properties the next stack frame line gives
    for line in text.splitlines():
        if entry := _ENTRY.search(line):
            kernels.append({"function": entry.group(1), "arch": entry.group(2)})
        elif properties := _PROPERTIES.search(line):
            properties_of = properties.group(1)
        elif (frame := _FRAME.search(line)) and kernels and properties_of == kernels[-1]["function"]:
            kernels[-1].update(stack_bytes=int(frame.group(1)), spill_store_bytes=int(frame.group(2)),
                               spill_load_bytes=int(frame.group(3)))
            properties_of = None
        elif (used := _USED.search(line)) and kernels:
            kernels[-1].update(registers=int(used.group(1)), barriers=int(used.group(2) or 0))
    for index, kernel in enumerate(kernels):
        missing = [key for key, _ in COLUMNS if key not in kernel]
        if missing:
            raise ValueError(f"ptxas's report of kernel {index} ({kernel['function']}) has no {', '.join(missing)}")
    return kernels


def _compile_case(case: str) -> None:
    """Compiles `case` for the compile-only H200 (run by the child process, whose standard output ptxas reports to)."""
    import jax

    from pallas_kernels import compiling_for

    device = _offline_compile.h200_device()
    fn, args = CASES[case]()
    sharding = jax.sharding.SingleDeviceSharding(device)
    with compiling_for(device):
        jax.jit(fn, in_shardings=sharding, out_shardings=sharding).trace(*args).lower().compile()


def resources(case: str) -> dict:
    """`{"kernels": [record per Mosaic GPU kernel, in compile order]}` of one case (`parse_ptxas`'s
    records), or `{"error": what went wrong}` when it did not compile or its report did not parse."""
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", JAX_ENABLE_COMPILATION_CACHE="false",
               JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", case], env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"did not compile in {CHILD_TIMEOUT_S} s"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}
    try:
        return {"kernels": parse_ptxas(proc.stdout)}
    except ValueError as exc:
        return {"error": str(exc)}


def target() -> str:
    """The compile-only device's name.

    Raises:
      PluginMissing: jax has no CUDA plugin to build it with.
    """
    return _offline_compile.h200_device().device_kind


def _column_width(heading: str) -> int:
    """A table column's width: its heading's, at least 9."""
    return max(len(heading), 9)


def heading(width: int) -> str:
    """The table's heading, its case column `width` wide."""
    return f"{'case':{width}s} kernel " + " ".join(f"{title:>{_column_width(title)}s}" for _, title in COLUMNS)


def rows(case: str, result: dict, width: int) -> list[str]:
    """The table's lines of one case (a `resources` result): one per kernel, or one saying why there is none."""
    if "error" in result:
        return [f"{case:{width}s} ERROR {result['error']}"]
    if not result["kernels"]:
        return [f"{case:{width}s} no Mosaic GPU kernel"]
    return [f"{case:{width}s} {index:6d} " + " ".join(f"{kernel[key]:>{_column_width(title)}d}" for key, title in COLUMNS)
            for index, kernel in enumerate(result["kernels"])]


def compare(before: dict[str, dict], after: dict[str, dict]) -> tuple[list[str], bool]:
    """What changed from `before` to `after` (case -> `resources` result, each), and whether that
    fails `--compare`: a kernel with more registers or spill bytes, or a case not comparable."""
    lines, fails, same = [], False, 0
    for case, result in after.items():
        earlier = before.get(case)
        if earlier is None:
            lines.append(f"MISSING {case}: not in the compared file")
        elif "error" in earlier or "error" in result:
            lines.append(f"NOT COMPARED {case}: {earlier.get('error', 'compiled')} -> {result.get('error', 'compiled')}")
        elif len(earlier["kernels"]) != len(result["kernels"]):
            lines.append(f"NOT COMPARED {case}: {len(earlier['kernels'])} kernels -> {len(result['kernels'])}")
        else:
            for index, (old, new) in enumerate(zip(earlier["kernels"], result["kernels"])):
                changes = [f"{title} {old[key]} -> {new[key]}" for key, title in COLUMNS if old[key] != new[key]]
                if not changes:
                    same += 1
                    continue
                grew = any(new[key] > old[key] for key in GROWTH)
                fails |= grew
                lines.append(f"{'GREW' if grew else 'CHANGED'} {case} kernel {index}: {', '.join(changes)}")
            continue
        fails = True
    total = sum(len(result.get("kernels", [])) for result in after.values())
    lines.append(f"{same} of {total} kernels use the same registers, barriers, stack and spills")
    return lines, fails


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="default: all")
    parser.add_argument("--out", help="write the records to this JSON file")
    parser.add_argument("--compare", help="a JSON file of an earlier run: report what changed, fail on growth")
    parser.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)  # compile one case, report on stdout
    args = parser.parse_args(argv)
    if args.child:
        _compile_case(args.child)
        return 0
    import jax

    if args.compare:
        try:
            with open(args.compare) as f:
                before = json.load(f)
            before_cases = before["cases"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{args.compare}: not a record of scripts/kernel_resources.py ({exc!r})", file=sys.stderr)
            return 2
        if before.get("jax") != jax.__version__:
            print(f"warning: {args.compare} was written under jax {before.get('jax')}, this is jax {jax.__version__}: "
                  "its ptxas may allocate differently", file=sys.stderr)
    try:
        name = target()
    except PluginMissing as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"ptxas of jax {jax.__version__}'s toolchain, for a compile-only {name}", flush=True)
    width = max(len("case"), *map(len, args.cases))
    print(heading(width), flush=True)
    results = {}
    for case in args.cases:
        results[case] = resources(case)
        print("\n".join(rows(case, results[case], width)), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "target": name, "cases": results}, f, indent=1)
    failed = any("error" in result for result in results.values())
    if not args.compare:
        return 1 if failed else 0
    lines, fails = compare(before_cases, results)
    print("\n".join(lines))
    return 1 if failed or fails else 0


if __name__ == "__main__":
    sys.exit(main())
