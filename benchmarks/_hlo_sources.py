"""Which lines of the model a profiled kernel runs: XLA kernel names mapped to source through the optimized HLO.

XLA names the GPU kernel of a fusion after the fusion instruction (`loop_add_fusion.1` launches
as `loop_add_fusion_1`: the name with every character that is not a letter, digit or `_` made
`_`). The instruction calls a fused computation; each instruction in it carries the jax source
location it was traced from (`metadata={... stack_frame_id=N}`, resolved through the module's
`FileNames` / `FunctionNames` / `FileLocations` / `StackFrames` tables). `kernel_sources` reads
that from the compiled step's optimized HLO text (`jax.stages.Compiled.as_text()`), so the
longest kernels of a profile can be named by the model code they run.
"""

from __future__ import annotations

import collections
import os
import re

_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELDS = re.compile(r"(\w+)=(-?\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


def kernel_name(instruction: str) -> str:
    """The name XLA's GPU backend gives the kernel of HLO instruction `instruction`."""
    return _UNSAFE.sub("_", instruction)


def _tables(lines: list[str]) -> dict[str, dict[int, str]]:
    """The module's `FileNames`, `FunctionNames`, `FileLocations` and `StackFrames` rows, by id."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (row := _TABLE_ROW.match(line)):
            current[int(row.group(1))] = row.group(2)
        elif not line.strip() or line.startswith("%") or line.startswith("ENTRY"):
            current = None
    return tables


def _frame_sources(tables: dict[str, dict[int, str]], root: str) -> dict[int, str]:
    """`{stack frame id: "path:line (function)"}` of the innermost frame inside `root` (path relative
    to it), or of the innermost frame when none of the stack is inside `root`. Installed packages
    (a `site-packages` folder, e.g. a virtual environment inside `root`) are not inside it, and are
    named from their top-level module (`optax/transforms/_clipping.py:105`). jax keeps the
    innermost 10 frames of each location (`jax_traceback_in_locations_limit`), so a deep
    library call may show no project frame at all."""
    files = {i: name.strip('"') for i, name in tables.get("FileNames", {}).items()}
    functions = {i: name.strip('"') for i, name in tables.get("FunctionNames", {}).items()}
    locations, inside = {}, set()
    for i, row in tables.get("FileLocations", {}).items():
        fields = dict((k, int(v)) for k, v in _FIELDS.findall(row))
        path = files.get(fields.get("file_name_id"), "?")
        installed = f"{os.sep}site-packages{os.sep}"
        if installed in path:
            path = path.split(installed, 1)[1]  # an installed package: named from its top-level module on
        elif path.startswith(root + os.sep):
            path = path[len(root) + 1 :]
            inside.add(i)
        locations[i] = f"{path}:{fields.get('line', 0)} ({functions.get(fields.get('function_name_id'), '?')})"
    frames = {}  # id -> (location id, parent id)
    for i, row in tables.get("StackFrames", {}).items():
        fields = dict((k, int(v)) for k, v in _FIELDS.findall(row))
        frames[i] = (fields.get("file_location_id"), fields.get("parent_frame_id"))
    sources = {}
    for i, (location, _) in frames.items():
        frame, seen = i, set()
        while frame in frames and frame not in seen and frames[frame][0] not in inside:
            seen.add(frame)
            frame = frames[frame][1]
        sources[i] = locations.get(frames[frame][0] if frame in frames else location, "?")
    return sources


def kernel_sources(hlo_text: str, root: str | None = None, top: int = 3) -> dict[str, list[str]]:
    """`{kernel name: the source lines its instructions come from}` for every fusion of an HLO module.

    Args:
      hlo_text: an optimized HLO module as text (`Compiled.as_text()`).
      root: source paths inside this folder are given relative to it; default the working folder.
      top: how many source lines to give per kernel.

    Returns:
      For each fusion instruction (by its kernel name), up to `top` entries
      `"path:line (function) xN"`: the source lines of the instructions in its fused
      computation (and the computations that calls), N instructions each, most first.
      Instructions without a source location are not counted.
    """
    root = os.path.abspath(root or os.getcwd())
    lines = hlo_text.splitlines()
    sources = _frame_sources(_tables(lines), root)
    frames: dict[str, list[int]] = collections.defaultdict(list)  # computation -> its instructions' frames
    callees: dict[str, list[str]] = collections.defaultdict(list)
    fusions: dict[str, str] = {}  # fusion instruction -> the computation it calls
    current = None
    for line in lines:
        if head := _COMPUTATION.match(line):
            current = head.group(1)
            continue
        if current is None or not (instruction := _INSTRUCTION.match(line)):
            continue
        called = _CALLS.findall(line)
        callees[current] += called
        if instruction.group(2) == "fusion" and called:
            fusions[instruction.group(1)] = called[0]
        if frame := _FRAME.search(line):
            frames[current].append(int(frame.group(1)))

    def counted(computation: str, seen: set[str]) -> collections.Counter:
        counts = collections.Counter(sources.get(f, "?") for f in frames[computation])
        for callee in callees[computation]:
            if callee not in seen:
                seen.add(callee)
                counts += counted(callee, seen)
        return counts

    return {
        kernel_name(name): [f"{source} x{n}" for source, n in counted(computation, {computation}).most_common(top)]
        for name, computation in fusions.items()
    }


def attribute(top_kernels: list[dict], hlo_text: str, root: str | None = None) -> list[dict]:
    """`top_kernels` (`_profile.breakdown`'s list) with each fusion kernel's `sources` from the HLO."""
    known = kernel_sources(hlo_text, root)
    return [dict(kernel, sources=known[kernel["name"]]) if kernel["name"] in known else kernel for kernel in top_kernels]
