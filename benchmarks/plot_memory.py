"""Peak device memory and step time per rematerialization / saved-activation setting: one figure from train_bench JSONs.

Each `LABEL=PATH` is a `benchmarks/train_bench.py` result; the figure shows, per run, the
measured peak (`peak_bytes_in_use_device0`) split into the compiled step's arguments
(parameters, optimizer state, the batch) and the rest (activations, gradients, workspace),
and the median step time per 1024 examples.

    python benchmarks/plot_memory.py "none, 1024=benchmarks/results/step_h200_gem_h200_bf16_same_build.json" \
        "remat 90 GB, 2048=benchmarks/results/memory_h200_gem_h200_2048_remat_budget90.json" \
        --out benchmarks/figures/memory.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def point(path: Path) -> dict[str, float]:
    """Peak GB, arguments GB and ms per 1024 examples of the first run in a train_bench JSON."""
    run = json.loads(path.read_text())["runs"][0]
    examples = run["global_batch"] / run["num_devices"]
    return {
        "peak_gb": run["peak_bytes_in_use_device0"] / 1e9,
        "arguments_gb": run["compiled_memory_bytes"]["argument"] / 1e9,
        "ms_per_1024": run["median_step_s"] * 1e3 * 1024 / examples,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device-gb", type=float, default=143.8, help="the device's memory, drawn as a line (H200: 143.8 GB)")
    args = parser.parse_args(argv)
    labels, points = zip(*((label, point(Path(path))) for label, path in (r.split("=", 1) for r in args.runs)))
    fig, (mem, time) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(labels))
    mem.bar(x, [p["arguments_gb"] for p in points], label="arguments (params, optimizer state, batch)")
    mem.bar(x, [p["peak_gb"] - p["arguments_gb"] for p in points], bottom=[p["arguments_gb"] for p in points], label="activations, gradients, workspace")
    mem.axhline(args.device_gb, color="k", linestyle="--", linewidth=1, label="device memory")
    mem.set_ylabel("peak memory (GB)")
    time.bar(x, [p["ms_per_1024"] for p in points], color="tab:green")
    time.set_ylabel("step time per 1024 examples (ms)")
    for ax in (mem, time):
        ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
    mem.legend(fontsize=7)
    fig.suptitle("gem_h200 on one H200: memory settings")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    for label, p in zip(labels, points):
        print(f"{label:40s} peak {p['peak_gb']:6.1f} GB  arguments {p['arguments_gb']:5.1f} GB  {p['ms_per_1024']:6.1f} ms / 1024 examples")


if __name__ == "__main__":
    main()
