"""Kernel breakdown of a step: CUPTI kernel times grouped by what the kernel is.

The groups follow the kernel names that XLA, cuBLAS(Lt)/CUTLASS, cuDNN, NCCL and Pallas
Mosaic GPU give their GPU kernels (the names CUPTI reports, as in Nsight Systems):

- `gemm`: cuBLAS/cuBLASLt/CUTLASS matrix products in 16-bit or 8-bit operands
  (`sm90_xmma_gemm_bf16...`, `nvjet_tst_...`, `cutlass3x_sm90_tensorop_gemm_bf16...`,
  XLA's Triton `gemm_fusion_dot...`, `cublasLt::splitKreduce_kernel`);
- `gemm_f32_tf32`: matrix products with float32 operands, which Hopper runs as TF32
  (`..._f32f32_tf32f32_...`, `sgemm`, `nvjet_s...`): a bf16 step should have none;
- `pallas`: Pallas kernels: Mosaic GPU (`<name>_mosaic_gpu_kernel`: JFA, GDPA, the MXFP8 GEMM) and
  Triton-lowered (`mxfp8_quantize_*`, the one-pass quantization; `qk_norm_rope_forward`/`_backward`);
- `cudnn`: cuDNN kernels (the padded peer's flash attention, `cudnn_generated_..._sdpa_...`);
- `collectives`: NCCL (`ncclDevKernel_AllGather_RING_LL`) and XLA's own collective kernels;
- XLA's generated kernels, by the operation that names them: `gather_scatter`
  (`gather`, `scatter`, `dynamic_slice`, `dynamic_update_slice`), `transposes`,
  `reductions` (`reduce`, also `reduce_window`), then every other fusion
  (`loop_*`, `input_*`, `wrapped_*`, `*fusion*`) in `xla_fusions`;
- `other`: sorts, copies, memsets and anything unrecognised.
"""

from __future__ import annotations

import collections
import math
import re

GROUPS = (
    "gemm",
    "gemm_f32_tf32",
    "pallas",
    "cudnn",
    "xla_fusions",
    "reductions",
    "transposes",
    "gather_scatter",
    "collectives",
    "other",
)

LABELS = {
    "gemm": "GEMM (bf16/fp8)",
    "gemm_f32_tf32": "GEMM float32 (TF32)",
    "pallas": "Pallas (Mosaic GPU, Triton)",
    "cudnn": "cuDNN",
    "xla_fusions": "XLA fusions",
    "reductions": "reductions",
    "transposes": "transposes",
    "gather_scatter": "gather/scatter",
    "collectives": "collectives",
    "other": "other",
}

_COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]scatter|all[-_]?to[-_]?all|collective[-_]permute")
_PALLAS = re.compile(r"mosaic|^(gdpa|jfa|jagged_flash|mxfp8|qk_norm_rope|rms_norm)")
_CUDNN = re.compile(r"cudnn|sdpa|fmha")
_GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|^sm\d+_")
# cuBLAS names its float32 GEMMs `..._tf32...` or `sgemm`; nvjet kernels spell the operand types
# in three letters after an optional `sm90_` (`tst`: bf16 in and out; `sss`: float32 in and out).
_F32_GEMM = re.compile(r"tf32|sgemm|nvjet_(?:sm\d+_)?s[a-z]{2}_")
_GATHER_SCATTER = re.compile(r"gather|scatter|dynamic[-_]slice|dynamic[-_]update[-_]slice")
_XLA_FUSION = re.compile(r"^(loop|input|wrapped)_|fusion")


def classify(name: str) -> str:
    """The group (one of `GROUPS`) of a GPU kernel, from its name.

    Library kernels are recognised first (NCCL, Pallas Mosaic GPU, cuDNN, GEMMs), then
    XLA's kernels by the operation in their name (gather/scatter before transpose
    before reduce, so `input_scatter_fusion` counts as scatter).
    """
    lowered = name.lower()
    if _COLLECTIVE.search(lowered):
        return "collectives"
    if _PALLAS.search(lowered):
        return "pallas"
    if _CUDNN.search(lowered):
        return "cudnn"
    if _GEMM.search(lowered):
        return "gemm_f32_tf32" if _F32_GEMM.search(lowered) else "gemm"
    if _GATHER_SCATTER.search(lowered):
        return "gather_scatter"
    if "transpose" in lowered:
        return "transposes"
    if "reduce" in lowered:
        return "reductions"
    if _XLA_FUSION.search(lowered):
        return "xla_fusions"
    return "other"


def breakdown(kernels: list[tuple[str, float]], top: int = 20) -> dict:
    """Groups one step's kernels.

    Args:
      kernels: `(kernel name, milliseconds)` of every kernel the step launched (CUPTI).
      top: how many of the longest kernels to list.

    Returns:
      `{"device_ms": total kernel time, "num_kernels": launches, "groups_ms": {group: ms}
      for every group of GROUPS, "top_kernels": [{"name", "group", "calls", "ms"}]}`; the
      top list sums the launches of one name and is sorted by time, longest first.

    Raises:
      ValueError: a negative or non-finite time (named with its kernel).
    """
    groups = dict.fromkeys(GROUPS, 0.0)
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, ms in kernels:
        if not ms >= 0 or ms == float("inf"):
            raise ValueError(f"kernel {name!r} has time {ms!r} ms; expected a finite time >= 0")
        groups[classify(name)] += ms
        per_name[name].append(ms)
    longest = sorted(per_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "device_ms": sum(groups.values()),
        "num_kernels": len(kernels),
        "groups_ms": groups,
        "top_kernels": [{"name": n, "group": classify(n), "calls": len(t), "ms": sum(t)} for n, t in longest],
    }


def idle_between_kernels(activities: list[tuple[str, float, float]], top: int = 15) -> dict:
    """Where one step's device sits idle: the gaps between its kernels, by what runs after each gap.

    A gap before a kernel is time the device waited for the host to launch it: a kernel outside
    XLA's command buffers (CUDA graphs) is launched one by one, and one after a host
    synchronisation waits for the host's round trip.

    Args:
      activities: `(name, start_us, duration_us)` of every kernel, copy and memset of the step on one
        device, on any stream (a profiler trace's device activities), in any order.
      top: how many of the longest gaps to list.

    Returns:
      `{"span_ms": first start to last end, "busy_ms": time any activity runs (overlaps counted
      once), "idle_ms": span - busy, "gaps": count of gaps, "gaps_over_us": {10, 50, 100: count},
      "idle_by_next_group_ms": {group (`classify`) of the activity after a gap: idle ms},
      "memsets" and "copies": {"count", "ms"} of the activities named `Memset...` and `Memcpy...`
      (their durations summed: part of busy, not of the kernels' time),
      "longest_gaps": [{"us", "before", "after"}]}`, longest first.

    Raises:
      ValueError: no activities, or a negative or non-finite start or duration (named with its activity).
    """
    if not activities:
        raise ValueError("no device activities to measure idle time in")
    for name, start, duration in activities:
        if not (math.isfinite(start) and math.isfinite(duration) and duration >= 0):
            raise ValueError(f"activity {name!r} has start {start!r} us and duration {duration!r} us; expected finite, duration >= 0")
    ordered = sorted(activities, key=lambda a: (a[1], -a[2]))  # at one start, the longest first: it names what follows a gap
    busy, gaps = 0.0, []
    last_name, run_start, run_end = ordered[0][0], ordered[0][1], ordered[0][1] + ordered[0][2]
    for name, start, duration in ordered[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, last_name, name))
            run_start = start
        if start + duration >= run_end:
            run_end, last_name = start + duration, name
    busy += run_end - run_start
    span = run_end - ordered[0][1]
    by_group = dict.fromkeys(GROUPS, 0.0)
    for us, _, after in gaps:
        by_group[classify(after)] += us / 1e3

    def named(prefix: str) -> dict:
        durations = [duration for name, _, duration in activities if name.lower().startswith(prefix)]
        return {"count": len(durations), "ms": sum(durations) / 1e3}

    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "gaps": len(gaps),
        "gaps_over_us": {limit: sum(us > limit for us, _, _ in gaps) for limit in (10, 50, 100)},
        "idle_by_next_group_ms": by_group,
        "memsets": named("memset"),
        "copies": named("memcpy"),
        "longest_gaps": [{"us": us, "before": b, "after": a} for us, b, a in sorted(gaps, key=lambda g: -g[0])[:top]],
    }


def format_idle(result: dict) -> str:
    """A printable summary of `idle_between_kernels`'s result."""
    lines = [
        f"device span {result['span_ms']:.2f} ms: busy {result['busy_ms']:.2f}, idle {result['idle_ms']:.2f} in "
        f"{result['gaps']} gaps ({', '.join(f'{n} over {k} us' for k, n in result['gaps_over_us'].items())})",
        "  idle before: " + ", ".join(f"{LABELS[g]} {ms:.2f} ms" for g, ms in result["idle_by_next_group_ms"].items() if ms),
        f"  memsets {result['memsets']['count']} ({result['memsets']['ms']:.2f} ms), copies {result['copies']['count']} ({result['copies']['ms']:.2f} ms)",
    ]
    lines += [f"    {g['us']:8.1f} us  {g['before'][:60]} -> {g['after'][:60]}" for g in result["longest_gaps"]]
    return "\n".join(lines)


def format_breakdown(result: dict) -> str:
    """A printable table of `breakdown`'s result: groups, then the top kernels."""
    total = result["device_ms"] or 1.0
    lines = [f"device time {result['device_ms']:.2f} ms in {result['num_kernels']} kernels"]
    lines += [f"  {LABELS[g]:<22} {ms:9.2f} ms {100 * ms / total:5.1f}%" for g, ms in result["groups_ms"].items() if ms]
    lines.append("  longest kernels:")
    for k in result["top_kernels"]:
        lines.append(f"    {k['ms']:9.3f} ms x{k['calls']:<4} {k['group']:<14} {k['name'][:100]}")
        lines += [f"{'':36}from {source}" for source in k.get("sources", [])[:2]]
    return "\n".join(lines)
