"""Programs lowered on fake CPU devices: starting the process with them, and reading a program's collectives
(kind, mesh axes, types and bytes) from its HLO text."""

from __future__ import annotations

import math
import os
import re
import sys

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?([\w.\-]+) = (.+?) ([a-z][a-z\-]*)\(([^)]*)\)")
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
GROUP_AXES = re.compile(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}")
HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _bytes(hlo_type: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) * HLO_BYTES[dtype] for dtype, dims in ARRAY.findall(hlo_type))


def operand_type(types: dict[str, str], operand: str) -> str:
    """The type of an instruction's operand `operand` ("" when unknown): `name`'s, or for `name#i` (HLO's short form
    of element i of a tuple result, e.g. a cuBLAS GEMM's output beside its workspace) that element's."""
    name, hash_, index = operand.partition("#")
    if not hash_:
        return types.get(name, "")
    elements = re.findall(r"[a-z][a-z0-9]*\[[\d,]*\]", types.get(name, ""))
    return elements[int(index)] if index.isdigit() and int(index) < len(elements) else ""


COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
CALLEE = re.compile(r"\bcall\(.*to_apply=%?([\w.\-]+)")


def _executions(hlo_text: str) -> dict[str, int]:
    """How many times one run of the module runs each computation reached through `call` ops.

    Identical kernel calls that jax lowered once (`pallas_kernels/_src/shared_lowering.py`) are
    one computation called from every site. Computations entered otherwise (loop bodies,
    branches, reducers), and what they call, count once per appearance.
    """
    entry, calls, current = None, {}, None
    for line in hlo_text.splitlines():
        if head := COMPUTATION.match(line):
            current = head.group(2)
            calls[current] = []
            entry = current if head.group(1) else entry
        elif current is not None and (callee := CALLEE.search(line)):
            calls[current].append(callee.group(1))
    runs = dict.fromkeys(calls, 0)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for callee in calls.get(name, ()):
            visit(callee, times)

    called = {callee for callees in calls.values() for callee in callees}
    for root in [entry, *(name for name in calls if name not in called and name != entry)]:
        if root is not None:
            visit(root, 1)  # the entry, and computations entered otherwise (loop bodies, branches) once
    return runs


def collectives(hlo_text: str) -> list[dict]:
    """`{op, axes, type, operand_types, bytes}` of every collective in an HLO module's text, per run.

    A collective in a computation that `call` ops run n times is listed n times; one in a
    loop body or a branch (whose run count the text does not give) once. `axes`: the mesh
    axes it runs over. `bytes` is the larger of its result and its operands (a tuple: its
    arrays summed): the buffer the collective needs, e.g. a reduce-scatter's whole input.
    """
    runs = _executions(hlo_text)
    types: dict[str, str] = {}
    found, current = [], None
    for line in hlo_text.splitlines():
        if head := COMPUTATION.match(line):
            current = head.group(2)
            continue
        match = INSTRUCTION.match(line)
        if not match:
            continue
        name, result, op, operands = match.groups()
        result = re.sub(r"\{[^}]*\}", "", result)
        types[name] = result
        if op.removesuffix("-start") in COLLECTIVES:
            inputs = [operand_type(types, o.strip()) for o in operands.split(",")]
            axes = GROUP_AXES.search(line)
            collective = {
                "op": op,
                "axes": re.findall(r"'(\w+)'", axes.group(1)) if axes else [],
                "type": result,
                "operand_types": inputs,
                "bytes": max(_bytes(result), sum(map(_bytes, inputs))),
            }
            found.extend([collective] * max(runs.get(current, 0), 1))
    return found


def restart_with_fake_devices(count: int) -> None:
    """Re-executes this process on `count` fake CPU devices unless it runs on them already.

    jax reads `XLA_FLAGS` once, when it starts, so the flag cannot be set later.
    """
    flag = f"--xla_force_host_platform_device_count={count}"
    if flag not in os.environ.get("XLA_FLAGS", "") or os.environ.get("JAX_PLATFORMS") != "cpu":
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(), JAX_PLATFORMS="cpu")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
