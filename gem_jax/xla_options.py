"""The XLA flags of a GPU training run, and how a process adds them to `XLA_FLAGS`; nothing here imports jax.

The latency-hiding scheduler overlaps the FSDP all-gathers / reduce-scatters and the
embedding all-to-alls with compute. The combine thresholds let XLA merge the many
small per-parameter collectives of HSDP into few large ones (at least one DHEN
layer's weights; JAX-Toolbox's rule of thumb). Without Triton GEMMs XLA autotunes
only cuBLAS's algorithms for each dot, which is what it picked anyway at GEM width: the
gem_h200 step compiled in 45.5 s instead of 56.0 s and ran 0.181 s against 0.183 s on an H200
(benchmarks/results/xla_flags_h200_triton_gemm_20261203.json). On an H100, with all five flags
against none, the step compiled in 34-41 s instead of 53-72 s, and without them the MLP's bias and
GELU left the cuBLAS epilogue for a pass of their own (benchmarks/step.md). Sources: jax's GPU performance tips
(docs/gpu_performance_tips.md), NVIDIA JAX-Toolbox docs/GPU_performance.md and MaxText's A3
launch scripts. Every flag parses with the pinned jaxlib (0.11.2)
(`tests/gem_jax/parallel/test_parallel_launch.py`).

`gem-train` and `benchmarks/train_bench.py` add them themselves (`add_project_flags`); the launch
scripts export them with the rest of a run's environment (`scripts/xla_flags.py --env`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence

XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_triton_gemm=false",
)


def flag_name(flag: str) -> str:
    """`--name` of `--name=value` (or of a bare `--name`)."""
    return flag.partition("=")[0]


def flag_in_effect(flag: str, environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether the environment's `XLA_FLAGS` (`environ`, default `os.environ`) gives `flag` (`--name=value`)
    exactly that value; False when it names a file of flags (not read here)."""
    names = effective_flags((os.environ if environ is None else environ).get("XLA_FLAGS", ""))
    name, _, value = flag.partition("=")
    return isinstance(names, dict) and name in names and names[name] == (value or None)


def effective_flags(value: str) -> dict[str, str | None] | str:
    """What XLA takes from an `XLA_FLAGS` value: `{"--name": value}` (the last of a repeated flag; None for a
    bare `--name`), whatever their order and spacing, or the value itself when it names a file of flags."""
    value = value.strip()
    if value and not value.startswith("-"):
        return value
    return {name: (text if sep else None) for name, sep, text in (flag.partition("=") for flag in value.split())}


def add_project_flags(environ: MutableMapping[str, str] | None = None, flags: Sequence[str] = XLA_FLAGS) -> list[str]:
    """Puts each of `flags` (default the project's `XLA_FLAGS`) whose name the environment's `XLA_FLAGS`
    does not give ahead of the environment's own flags (its value otherwise untouched: a flag it sets
    keeps its value), and returns the flags it added.

    Adds nothing when `XLA_FLAGS` names a file of flags (a value not starting with "-", as XLA
    reads it), or, for the process's own environment, once jax has started its backends: XLA read
    the variable then, and a flag added later would not apply (nor should the executable cache key
    on it). So call it before the process's first device use. `environ`: the mapping to change
    (default `os.environ`).
    """
    if environ is None:
        if _backends_started():
            return []
        environ = os.environ
    given = environ.get("XLA_FLAGS", "")
    names = effective_flags(given)
    if isinstance(names, str):  # a file of flags
        return []
    added = [flag for flag in flags if flag_name(flag) not in names]
    if added:
        environ["XLA_FLAGS"] = " ".join(added) + (" " + given if given else "")
    return added


def _backends_started() -> bool:
    """Whether this process's jax has created its backends (without importing jax)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))
