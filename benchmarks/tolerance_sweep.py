"""Runs the low-precision comparison tests under XLA CPU settings that change float summation order,
and tabulates each checked error against its bound (tests/support/tolerances.py `check`).

    .venv/bin/python benchmarks/tolerance_sweep.py [--settings default,eigen1,...] [--logs DIR] [--out FILE] [TEST ...]

Each setting runs `pytest TEST...` once with `GEM_TOLERANCE_LOG=DIR/<setting>.jsonl` (emptied first), so
every `tolerances.check` appends its (test, name, error, bound); the multi-device tests' workers inherit
the setting's `XLA_FLAGS` (their conftest appends the device count). Then prints a markdown table of
every setting logged in DIR (so runs of different settings, or of different tests, add up): one row per
check with the bound, the error under each setting and the smallest headroom (bound / error); written
to `--out` when given. A failed check fails that pytest run (its exit code is listed); the sweep goes on.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SETTINGS = {  # name: (environment, what it changes)
    "default": ({}, "the suite's settings"),
    "eigen1": (
        {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1"},
        "single-threaded Eigen dots and convolutions (another blocking of the sums); one OpenMP thread",
    ),
    "avx2": ({"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}, "code generated for AVX2 only: 256-bit vectors, as on a machine without AVX-512"),
    "fast_math": ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"}, "LLVM may reassociate float sums (and approximate exp, tanh, division)"),
}

TESTS = [  # the FP8 and bf16 comparisons whose bounds rest on the format, a few cases of each (minutes per setting)
    "tests/gem_jax/test_quant_dense.py::test_forward_and_gradients_against_float_reference",
    "tests/gem_jax/test_quant_dense.py::test_fused_prologue_forward_and_gradients[rmsnorm-False-32]",
    "tests/gem_jax/test_quant_dense.py::test_fused_prologue_forward_and_gradients[gelu_bias-True-128]",
    "tests/gem_jax/test_quant_dense.py::test_layer_is_a_drop_in_for_nnx_linear",
    "tests/gem_jax/test_quant_saved_activations.py",
    "tests/pallas_kernels/test_mxfp8_matmul.py::test_xla_reference_path_and_bf16_output",
    "tests/gem_jax/model/test_gem.py::test_fp8_switch_swaps_tower_layers_with_the_same_parameters",
    "tests/gem_jax/model/test_gem.py::test_fp8_hadamard_block_is_within_fp8_rounding_like_the_unrotated_one",
    "tests/gem_jax/parallel/test_parallel_exchange.py::test_fp8_step_is_within_the_fp8_error_of_the_float32_step",
    "tests/gem_jax/parallel/test_parallel_exchange.py::test_fp8_sharded_step_matches_the_unsharded_fp8_step",
]


def run_setting(name: str, tests: list[str], logs: Path) -> str:
    """Runs `tests` under setting `name`, logging to `logs/<name>.jsonl`; returns a status line."""
    env_extra, what = SETTINGS[name]
    log = logs / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, **env_extra, "GEM_TOLERANCE_LOG": str(log), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO, env=env).returncode
    flags = " ".join(f"{k}={v}" for k, v in env_extra.items()) or "no change"
    return f"- `{name}`: {what} (`{flags}`); pytest exit {code}, {time.perf_counter() - start:.0f} s"


def read_logs(logs: Path) -> dict[str, list[dict]]:
    """`{setting: checks}` for each setting with a log in `logs`, in SETTINGS order."""
    return {n: [json.loads(line) for line in (logs / f"{n}.jsonl").read_text().splitlines()] for n in SETTINGS if (logs / f"{n}.jsonl").exists()}


def table(results: dict[str, list[dict]]) -> str:
    """Markdown: one row per (test, check), the bound, each setting's error, the smallest headroom."""
    names = list(results)
    rows: dict[tuple[str, str], dict] = collections.OrderedDict()
    for setting, checks in results.items():
        for c in checks:
            row = rows.setdefault((c["test"], c["name"]), {"bound": c["bound"]})
            row[setting] = max(row.get(setting, 0.0), c["err"])  # a check repeated in a test: its largest error
    lines = ["| test | check | bound | " + " | ".join(names) + " | headroom |", "|---" * (len(names) + 4) + "|"]
    for (test, name), row in rows.items():
        errs = [row.get(s) for s in names]
        worst = max((e for e in errs if e is not None), default=None)
        headroom = "-" if not worst else f"{row['bound'] / worst:.1f}x"
        cells = ["-" if e is None else f"{e:.3g}" for e in errs]
        lines.append(f"| {test.removeprefix('tests/')} | {name} | {row['bound']:.3g} | " + " | ".join(cells) + f" | {headroom} |")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", default=TESTS, help="pytest node ids (default: the FP8/bf16 comparison tests)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}; empty: tabulate --logs only")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "gem-tolerance-sweep", help="where each setting's checks go")
    parser.add_argument("--out", type=Path, help="also write the table (with the machine and settings) here")
    args = parser.parse_args(argv)
    names = [n for n in args.settings.split(",") if n]  # none: only tabulate what --logs holds
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    args.logs.mkdir(parents=True, exist_ok=True)
    status = [run_setting(name, args.tests, args.logs) for name in names]
    results = read_logs(args.logs)
    import jax  # noqa: PLC0415 (only for its version)

    text = "\n".join(
        [
            f"Machine: {cpu_model()}, {os.cpu_count()} CPUs; jax {jax.__version__}; {datetime.date.today().isoformat()}.",
            "",
            "This run's settings:",
            *status,
            "",
            table(results),
            "",
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
