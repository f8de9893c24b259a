"""Model quality of runs that differ in one setting: final eval NE/BCE and train loss against a reference run.

Reads the `metrics.jsonl` of finished `gem-train` runs (same config and seed, one setting
changed, e.g. `ModelConfig.fp8` or `ModelConfig.fp8_saved_activations`), writes a JSON
summary (the final eval record of each run; per task the relative change of its NE and BCE,
and of the mean train loss of the last `--loss-window` logged steps, against the first run)
and a figure of the NE curves. A run without a final eval (an eval record at its last train
step; killed while checkpointing, say) is still compared on train loss and train NE; the summary
names it under `runs_without_eval` and leaves it out of the eval comparisons, which need the
reference run's final eval. A record that lacks a metric the reference logs is refused, naming
the run, the step and the file. Tasks are compared by position: task k of a run (its
`run.json`'s `spec.tasks`) against task k of the reference, under the reference's name; runs
logged before tasks were named by their data set log "primary" and "secondary", their first two
tasks.

    gem-train --config configs/movielens.py --workdir runs/f32
    gem-train --config configs/movielens_fp8.py --workdir runs/fp8
    python benchmarks/compare_runs.py --run full=runs/f32 --run fp8_32=runs/fp8 \
        --title "MovieLens latest-small: FP8 towers vs full precision" \
        --out benchmarks/results/fp8_movielens_cpu.json --figure benchmarks/figures/fp8_movielens_ne.png

Runs on a planted log (`gem-data plant`, benchmarks/quality.md "The planted source") are also
placed between its item-mean baseline and its oracle: `--planted DIR` (the planted directory;
its `oracle.json` is the report for the split the log was converted with) adds, per run and
eval record, the AUC and NE of the reference's first task and their lift fractions, e.g.
`(AUC - AUC_item_mean) / (AUC_oracle - AUC_item_mean)` (0: the baseline, 1: the oracle; NE
alike, falling), to the summary (`planted`) and prints them as a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


LEGACY_TASKS = ("primary", "secondary")  # the metric keys of runs before named tasks: their first two tasks


def read_run(workdir: Path) -> dict[str, list[dict]]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {kind: [r for r in records if r["kind"] == kind] for kind in ("train", "eval")}


def run_tasks(workdir: Path, train: list[dict]) -> list[str]:
    """A run's task names in label order: its run.json's `spec.tasks`; without them ("primary",
    "secondary") when its last train record logs only those, else the names it logs, sorted."""
    record = workdir / "run.json"
    if record.exists():
        tasks = json.loads(record.read_text()).get("spec", {}).get("tasks")
        if tasks:
            return list(tasks)
    logged = sorted(k[len("ne_"):] for k in (train or [{}])[-1] if k.startswith("ne_"))
    return list(LEGACY_TASKS) if set(logged) <= set(LEGACY_TASKS) else logged


def lift_fraction(value: float, baseline: float, oracle: float) -> float:
    """Where `value` sits from `baseline` (0) to `oracle` (1); NaN when they are equal."""
    return (value - baseline) / (oracle - baseline) if oracle != baseline else float("nan")


def planted_rows(oracle: dict, evals: dict[str, list[dict]], task: dict[str, str]) -> list[dict]:
    """Per run and eval record: step, AUC and NE of the run's `task[name]`, and their lift fractions
    between `oracle`'s (an `oracle.json`: `oracle_report(...).to_json()`) item-mean baseline and oracle."""
    base, best = oracle["item_mean"], oracle["oracle"]
    rows = []
    for name, records in evals.items():
        for record in records:
            auc, ne = record[f"auc_{task[name]}"], record[f"ne_{task[name]}"]
            rows.append({
                "run": name, "step": record["step"], "auc": auc, "ne": ne,
                "auc_lift_fraction": lift_fraction(auc, base["auc"], best["auc"]),
                "ne_lift_fraction": lift_fraction(ne, base["ne"], best["ne"]),
            })
    return rows


def planted_table(oracle: dict, rows: list[dict]) -> str:
    """`planted_rows` as a Markdown table, under the item-mean and oracle rows."""
    lines = [f"split {oracle['split']}, {oracle['eval_events']} eval events", "", "| run | step | AUC | NE | AUC lift fraction | NE lift fraction |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | | {oracle[key]['auc']:.4f} | {oracle[key]['ne']:.4f} | {lift:g} | {lift:g} |" for name, key, lift in (("item-mean", "item_mean", 0), ("oracle", "oracle", 1))]
    lines += [f"| {r['run']} | {r['step']} | {r['auc']:.4f} | {r['ne']:.4f} | {r['auc_lift_fraction']:.3f} | {r['ne_lift_fraction']:.3f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="name=workdir; the first is the reference")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--figure", type=Path, required=True)
    parser.add_argument("--title", default="eval and train NE per run")
    parser.add_argument("--planted", type=Path, help="a gem-data plant directory: place every eval against its oracle.json (module docstring)")
    parser.add_argument("--loss-window", type=int, default=5, help="last logged train steps averaged for the final loss (>= 1)")
    args = parser.parse_args()
    if args.loss_window < 1:
        raise SystemExit(f"compare_runs: --loss-window must be >= 1, got {args.loss_window}")
    paths = {name: Path(path) for name, path in (r.split("=", 1) for r in args.run)}
    runs = {name: read_run(path) for name, path in paths.items()}
    reference = next(iter(runs))
    ref_tasks = run_tasks(paths[reference], runs[reference]["train"])
    logged = (runs[reference]["train"] or [{}])[-1]
    positions = [k for k, task in enumerate(ref_tasks) if f"ne_{task}" in logged]
    tasks = [ref_tasks[k] for k in positions]  # the summary's names: the reference's
    names = {}  # per run: reference task name -> the run's own name for that position
    for name, run in runs.items():
        where = paths[name] / "metrics.jsonl"
        if not run["train"]:
            raise SystemExit(f"compare_runs: run {name!r} logged no train step ({where})")
        own = run_tasks(paths[name], run["train"])
        if positions and len(own) <= positions[-1]:
            raise SystemExit(f"compare_runs: run {name!r} has tasks {own}, fewer than the reference's {ref_tasks} ({where})")
        names[name] = {ref_tasks[k]: own[k] for k in positions}
        for record in run["train"] + run["eval"]:
            missing = [key for task in tasks for key in (f"ne_{names[name][task]}", f"bce_{names[name][task]}") if key not in record]
            if missing or (record["kind"] == "train" and "loss" not in record):
                raise SystemExit(f"compare_runs: run {name!r}, {record['kind']} record of step {record['step']} lacks {missing or ['loss']} ({where})")
    if not tasks:
        raise SystemExit(f"compare_runs: the reference run {reference!r} logs no NE (no ne_<task> key in {paths[reference] / 'metrics.jsonl'})")
    window = {name: run["train"][-args.loss_window:] for name, run in runs.items()}
    loss = {name: float(np.mean([r["loss"] for r in records])) for name, records in window.items()}
    train_ne = {name: {task: float(np.mean([r[f"ne_{names[name][task]}"] for r in records])) for task in tasks} for name, records in window.items()}
    # A final eval is the eval of the run's last train step; an earlier one is not compared.
    final = {name: run["eval"][-1] for name, run in runs.items() if run["eval"] and run["eval"][-1]["step"] == run["train"][-1]["step"]}
    without_eval = [name for name in runs if name not in final]
    if without_eval:
        print(f"compare_runs: no final eval record in {', '.join(without_eval)}: compared on train loss and train NE only")
    if reference not in final:
        print(f"compare_runs: the reference run {reference!r} has no final eval: no eval comparison")
    compared = final if reference in final else {}

    def eval_change(metric: str) -> dict:
        return {
            name: {task: record[f"{metric}_{names[name][task]}"] / compared[reference][f"{metric}_{task}"] - 1 for task in tasks}
            for name, record in compared.items()
        }

    summary = {
        "date": datetime.date.today().isoformat(),
        "device": f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()})",
        "jax": jax.__version__,
        "reference": reference,
        "final_eval": final,
        "runs_without_eval": without_eval,
        "ne_relative_change_vs_reference": eval_change("ne"),
        "eval_bce_relative_change_vs_reference": eval_change("bce"),
        "loss_window": args.loss_window,
        "final_train_loss": loss,
        "train_loss_relative_change_vs_reference": {name: loss[name] / loss[reference] - 1 for name in runs},
        "final_train_ne": train_ne,
        "train_ne_relative_change_vs_reference": {
            name: {task: train_ne[name][task] / train_ne[reference][task] - 1 for task in tasks} for name in runs
        },
        "curves": {name: {"train": run["train"], "eval": run["eval"]} for name, run in runs.items()},
    }
    if args.planted is not None:
        report = args.planted / "oracle.json"
        if not report.is_file():
            raise SystemExit(f"compare_runs: --planted {args.planted} holds no oracle.json (gem-data plant writes it for its --split)")
        oracle = json.loads(report.read_text())
        for name, run in runs.items():
            missing = [r["step"] for r in run["eval"] if f"auc_{names[name][tasks[0]]}" not in r]
            if missing:
                raise SystemExit(f"compare_runs: run {name!r}, eval records of steps {missing} lack auc_{names[name][tasks[0]]} ({paths[name] / 'metrics.jsonl'})")
        rows = planted_rows(oracle, {name: run["eval"] for name, run in runs.items()}, {name: names[name][tasks[0]] for name in runs})
        summary["planted"] = {"oracle_report": oracle, "task": tasks[0], "evals": rows}
        print(planted_table(oracle, rows))
    args.out.write_text(json.dumps(summary, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        key = f"ne_{names[name][tasks[0]]}"
        line = ax.plot([r["step"] for r in run["train"]], [r[key] for r in run["train"]], label=f"{name} train NE")[0]
        ax.plot([r["step"] for r in run["eval"]], [r[key] for r in run["eval"]], "o--", color=line.get_color(), label=f"{name} eval NE")
    ax.set_xlabel("step")
    ax.set_ylabel(f"NE, {tasks[0]} task")
    ax.set_title(args.title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.figure, dpi=120)
    print(json.dumps({k: v for k, v in summary.items() if k.endswith("_vs_reference")}, indent=1))


if __name__ == "__main__":
    main()
