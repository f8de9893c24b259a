"""Where a whole job's wall time went: one stacked bar per `benchmarks/job_bench.py` record.

Each `LABEL=PATH` is a job_bench JSON; its bar stacks the job's summary split (start-up,
train steps, data waits, eval, checkpoints, restore, the rest) in seconds from process
start, plus the time from the summary to the process's exit (`after_summary_s`, the
runtime's teardown), and is labelled with goodput both ways: train-step seconds over the
summary's wall time and over the process's wall time.

    python benchmarks/plot_job_split.py \
        "cold=benchmarks/results/job_h200_gem_h200_2000_steps_cold_shared_order_20261203.json" \
        "warm=benchmarks/results/job_h200_gem_h200_2000_steps_warm_shared_order_20261203.json" \
        --out benchmarks/figures/job_split.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (label, the summary's `time_*_s` keys it sums); start-up is every `time_startup_*_s`.
PARTS = (
    ("start-up", None),
    ("train steps", ("time_train_step_s",)),
    ("data waits", ("time_data_wait_s",)),
    ("eval", ("time_eval_s",)),
    ("checkpoints", ("time_checkpoint_s",)),
    ("restore", ("time_restore_s",)),
    ("compiles after step 1, logging, other", ("time_compile_after_start_s", "time_logging_s", "time_other_s")),
)


def split(path: Path) -> tuple[dict[str, float], float, float]:
    """Seconds per part (the teardown after the summary last), goodput to the summary and to the exit."""
    job = json.loads(path.read_text())["job"]
    times = job["split"]
    seconds = {
        label: sum(v for k, v in times.items() if k.startswith("time_startup_")) if keys is None else sum(times.get(k, 0.0) for k in keys)
        for label, keys in PARTS
    }
    seconds["process teardown after the summary"] = job["after_summary_s"]
    return seconds, times["goodput"], times["time_train_step_s"] / job["process_wall_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    labels, splits = [], []
    for run in args.runs:
        label, _, path = run.partition("=")
        if not path:
            parser.error(f"expected LABEL=PATH, got {run!r}")
        labels.append(label)
        splits.append(split(Path(path)))

    fig, ax = plt.subplots(figsize=(9, 0.8 * len(labels) + 2.6))
    parts = list(splits[0][0])
    colors = plt.get_cmap("tab10").colors
    left = [0.0] * len(labels)
    for i, part in enumerate(parts):
        widths = [seconds[part] for seconds, _, _ in splits]
        ax.barh(labels, widths, left=left, color=colors[i % len(colors)], label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, (total, (_, to_summary, to_exit)) in enumerate(zip(left, splits, strict=True)):
        ax.text(total + 5, y, f"goodput {to_summary:.1%} (to exit {to_exit:.1%})", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start")
    ax.set_xlim(0, max(left) * 1.35)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False)
    ax.set_title("Whole job: where the wall time went", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
