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
alike, falling), to the summary (`planted`) and prints them as a Markdown table, under the
reference predictors the report holds (item-mean, no history, no long-range term, oracle:
`planted_levels`), whose eval NE the figure draws as horizontal lines.

`--switch-table` (with `--planted`) tabulates numerics switches against a reference trained
with several seeds (benchmarks/quality.md, "The switch table"; `benchmarks/switch_table.py`
trains them). Runs are named `<switch>_seed<k>` (`bf16_seed0`, `fp8_32_seed0`, ...; a run whose
`run.json` holds its config must have `loop.seed` and `data.seed` k). Per switch it gives
the final eval NE and AUC of the first task (each seed's, and their mean), their change against
the reference's mean in %, the mean change against the reference run of the same seed (paired),
the lift fractions of the mean between the planted log's item-mean baseline and oracle, and two
flags: within two spreads (|NE - reference mean NE| <= 2 x the reference seeds' NE spread,
max - min) and within 0.5% (|NE / reference mean NE - 1| <= 0.005). The reference's spread is
given as max - min and as the sample standard deviation (ddof 1). `needs_more_seeds` lists the
switches within two spreads that have fewer than 3 seeds. Runs without a final eval are named
and left out. Runs whose folders are gone join from a runs record (`--record FILE`, a
`benchmarks/results/switch_table_*_runs_*.json`: each run's eval records; `record_evals`); a run
may be a folder or a record's, not both, unless it is named with `--rerun NAME`: a run trained
again whose folder, with its final eval, replaces its entry in one record (a run named so must be
both).

    python benchmarks/compare_runs.py --switch-table --planted runs/planted/short-range/log \
        --run bf16_seed0=DIR --run bf16_seed1=DIR --run bf16_seed2=DIR --run fp8_32_seed0=DIR ... \
        --title "switch table, short-range" --out table.json --figure table.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
from pathlib import Path

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gem_jax.train.metric_log import format_metric  # noqa: E402


LEGACY_TASKS = ("primary", "secondary")  # the metric keys of runs before named tasks: their first two tasks
SWITCH_RUN = re.compile(r"(?P<switch>\w+?)_seed(?P<seed>\d+)")  # a switch table's run name: `<switch>_seed<k>`
NE_TOLERANCE = 0.005  # the switch table's bound on |NE / reference NE - 1|
SEEDS_WHEN_CLOSE = 3  # seeds a switch within two spreads of the reference needs


def run_paths(specs: list[str]) -> dict[str, Path]:
    """`--run name=workdir` options as {name: workdir}, in order; SystemExit names a malformed or repeated one."""
    paths: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise SystemExit(f"compare_runs: --run {spec!r}: expected name=workdir")
        if name in paths:
            raise SystemExit(f"compare_runs: --run names {name!r} twice ({paths[name]} and {path})")
        paths[name] = Path(path)
    return paths


def read_run(workdir: Path) -> dict[str, list[dict]]:
    if not (workdir / "metrics.jsonl").is_file():
        raise SystemExit(f"compare_runs: {workdir} holds no metrics.jsonl (a gem-train workdir writes one)")
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


def final_eval(run: dict[str, list[dict]]) -> dict | None:
    """A run's final eval record (`read_run`'s): the eval of its last train step; None without one
    (an earlier eval is not a final one: the run stopped before its last)."""
    if run["eval"] and run["train"] and run["eval"][-1]["step"] == run["train"][-1]["step"]:
        return run["eval"][-1]
    return None


def lift_fraction(value: float | None, baseline: float, oracle: float) -> float | None:
    """Where `value` sits from `baseline` (0) to `oracle` (1); NaN when they are equal; None when `value` is
    (an eval whose examples are of one class has no AUC or NE)."""
    if value is None:
        return None
    if oracle == baseline:
        return float("nan")
    return (value - baseline) / (oracle - baseline) + 0.0  # + 0.0: the baseline of a falling metric reads 0, not -0


def placed(auc: float, ne: float, oracle: dict) -> dict:
    """`{auc, ne, auc_lift_fraction, ne_lift_fraction}`: an eval's AUC and NE with their lift fractions between
    `oracle`'s (an `oracle.json`: `oracle_report(...).to_json()`) item-mean baseline and oracle."""
    base, best = oracle["item_mean"], oracle["oracle"]
    return {
        "auc": auc, "ne": ne,
        "auc_lift_fraction": lift_fraction(auc, base["auc"], best["auc"]),
        "ne_lift_fraction": lift_fraction(ne, base["ne"], best["ne"]),
    }


def planted_rows(oracle: dict, evals: dict[str, list[dict]], task: dict[str, str]) -> list[dict]:
    """Per run and eval record: run, step, and `placed` of the run's `task[name]` AUC and NE."""
    return [
        {"run": name, "step": record["step"], **placed(record[f"auc_{task[name]}"], record[f"ne_{task[name]}"], oracle)}
        for name, records in evals.items()
        for record in records
    ]


# The reference predictors of an oracle.json, worst first: the item-mean baseline, the optimum
# without history and without the long-range term (`gem_jax.train.oracle.oracle_report`; reports
# without them skip their rows), the oracle.
PLANTED_LEVELS = (("item-mean", "item_mean"), ("no history", "no_history"), ("no long-range", "no_long_range"), ("oracle", "oracle"))


def planted_levels(oracle: dict) -> list[dict]:
    """`{name, auc, ne, auc_lift_fraction, ne_lift_fraction}` of each of `PLANTED_LEVELS` that `oracle` holds."""
    return [{"name": name, **placed(oracle[key]["auc"], oracle[key]["ne"], oracle)} for name, key in PLANTED_LEVELS if key in oracle]


def planted_table(oracle: dict, rows: list[dict]) -> str:
    """`planted_rows` as a Markdown table, under the rows of `planted_levels`."""
    lines = [f"split {oracle['split']}, {oracle['eval_events']} eval events", "", "| run | step | AUC | NE | AUC lift fraction | NE lift fraction |", "|---|---|---|---|---|---|"]
    lines += [f"| {v['name']} | | {v['auc']:.4f} | {v['ne']:.4f} | {v['auc_lift_fraction']:.3g} | {v['ne_lift_fraction']:.3g} |" for v in planted_levels(oracle)]
    lines += [
        f"| {r['run']} | {r['step']} | {format_metric(r['auc'], '.4f')} | {format_metric(r['ne'], '.4f')} | {format_metric(r['auc_lift_fraction'], '.3f')} | "
        f"{format_metric(r['ne_lift_fraction'], '.3f')} |"
        for r in rows
    ]
    return "\n".join(lines)


def _ratio_change(value: float | None, reference: float | None) -> float | None:
    """`value / reference - 1`; None when either is None (undefined: one class)."""
    return None if value is None or reference is None else value / reference - 1


def mean_train_ne(name: str, records: list[dict], key: str) -> float | None:
    """The mean of `key` (a train NE) over `records`, leaving out the windows that logged it as None (all their
    examples of one class: `gem_jax.train.window.pooled_task_metrics`), which it says; None when all did."""
    values = [r[key] for r in records if r[key] is not None]
    if len(values) < len(records):
        print(f"compare_runs: run {name!r}: {key} is undefined (null: one class) in {len(records) - len(values)} of the last {len(records)} train records; "
              + ("the mean is over the others" if values else "no mean"))
    return float(np.mean(values)) if values else None


def read_oracle(planted: Path) -> dict:
    """`planted`'s `oracle.json` (the report `gem-data plant` writes for its `--split`)."""
    report = planted / "oracle.json"
    if not report.is_file():
        raise SystemExit(f"compare_runs: --planted {planted} holds no oracle.json (gem-data plant writes it for its --split)")
    return json.loads(report.read_text())


def check_oracle_fits(oracle: dict, planted: Path, name: str, evals: list[dict], task: str, where: Path) -> None:
    """Refuses (SystemExit) a run whose eval set is not the one `oracle` scored: its eval records' example and
    positive counts must be the oracle's eval events and their clicks (another log, seed or split differs)."""
    events, positives = oracle["eval_events"], round(oracle["eval_positive_rate"] * oracle["eval_events"])
    for record in evals:
        got = (record.get("eval_examples"), record.get(f"eval_positives_{task}"))
        if got != (events, positives):
            raise SystemExit(
                f"compare_runs: run {name!r} evaluated {got[0]} examples, {got[1]} positive, at step {record['step']} ({where}); "
                f"the oracle of --planted {planted} scored {events} eval events, {positives} clicks ({oracle['split']}): "
                "another planted log, seed or split"
            )


def _spread(values: list[float]) -> tuple[float, float]:
    """max - min and the sample standard deviation (ddof 1) of `values`; NaN for both below two values."""
    if len(values) < 2:
        return float("nan"), float("nan")
    return float(np.max(values) - np.min(values)), float(np.std(values, ddof=1))


def switch_table(evals: dict[str, dict[int, dict[str, float]]], reference: str, oracle: dict) -> dict:
    """The switch table (module docstring) from final evals.

    Args:
      evals: switch -> seed -> `{"ne": eval NE, "auc": eval AUC}` of that run's final eval;
        `reference` among the switches.
      reference: the switch every other is compared with (its seeds give the spread).
      oracle: the planted log's `oracle.json` (`item_mean` and `oracle`, each with `auc`, `ne`).

    Returns:
      `{"reference": {...seeds, ne, auc, ne_mean, auc_mean, ne_spread, ne_std, ne_spread_pct,
      auc_spread, auc_std}, "switches": [one row per switch, the reference first], "needs_more_seeds"}`;
      NE and AUC changes in % of the reference mean; the flags are None when the reference has
      fewer than two seeds (no spread).
    """
    if reference not in evals:
        raise SystemExit(f"compare_runs: no run of the reference switch {reference!r} with a final eval (runs of {sorted(evals)})")
    ref = evals[reference]
    ref_ne, ref_auc = [ref[k]["ne"] for k in sorted(ref)], [ref[k]["auc"] for k in sorted(ref)]
    ne_mean, auc_mean = float(np.mean(ref_ne)), float(np.mean(ref_auc))
    (ne_spread, ne_std), (auc_spread, auc_std) = _spread(ref_ne), _spread(ref_auc)
    rows = []
    for switch in [reference] + sorted(set(evals) - {reference}):
        seeds = sorted(evals[switch])
        ne, auc = [evals[switch][k]["ne"] for k in seeds], [evals[switch][k]["auc"] for k in seeds]
        mean_ne, mean_auc = float(np.mean(ne)), float(np.mean(auc))
        paired = [evals[switch][k]["ne"] / ref[k]["ne"] - 1 for k in seeds if k in ref]
        close = None if np.isnan(ne_spread) else bool(abs(mean_ne - ne_mean) <= 2 * ne_spread)
        rows.append({
            "switch": switch, "seeds": seeds, "ne": ne, "auc": auc, "ne_mean": mean_ne, "auc_mean": mean_auc,
            "ne_change_pct": 100 * (mean_ne / ne_mean - 1), "auc_change_pct": 100 * (mean_auc / auc_mean - 1),
            "ne_paired_change_pct": 100 * float(np.mean(paired)) if paired else None,
            "ne_lift_fraction": lift_fraction(mean_ne, oracle["item_mean"]["ne"], oracle["oracle"]["ne"]),
            "auc_lift_fraction": lift_fraction(mean_auc, oracle["item_mean"]["auc"], oracle["oracle"]["auc"]),
            "within_two_spreads": close,
            "ne_within_tolerance": bool(abs(mean_ne / ne_mean - 1) <= NE_TOLERANCE),
        })
    return {
        "reference": {
            "switch": reference, "seeds": sorted(ref), "ne": ref_ne, "auc": ref_auc, "ne_mean": ne_mean, "auc_mean": auc_mean,
            "ne_spread": ne_spread, "ne_std": ne_std, "ne_spread_pct": 100 * ne_spread / ne_mean,
            "auc_spread": auc_spread, "auc_std": auc_std,
        },
        "ne_tolerance": NE_TOLERANCE,
        "switches": rows,
        "needs_more_seeds": [r["switch"] for r in rows[1:] if r["within_two_spreads"] and len(r["seeds"]) < SEEDS_WHEN_CLOSE],
    }


def switch_markdown(table: dict, oracle: dict) -> str:
    """`switch_table`'s result as a Markdown table under a line on the reference's spread."""
    ref = table["reference"]

    def flag(value):
        return "n/a" if value is None else ("yes" if value else "**no**")

    lines = [
        f"reference {ref['switch']} (seeds {', '.join(map(str, ref['seeds']))}): eval NE {ref['ne_mean']:.4f}, spread (max - min) "
        f"{ref['ne_spread']:.4f} ({ref['ne_spread_pct']:.2f}%), std {ref['ne_std']:.4f}; eval AUC {ref['auc_mean']:.4f}, "
        f"spread {ref['auc_spread']:.4f}, std {ref['auc_std']:.4f}; item-mean AUC / NE {oracle['item_mean']['auc']:.4f} / "
        f"{oracle['item_mean']['ne']:.4f}, oracle {oracle['oracle']['auc']:.4f} / {oracle['oracle']['ne']:.4f}",
        "",
        "| switch | seeds | eval NE | NE vs reference | paired | eval AUC | AUC vs reference | NE lift fraction | within 2 spreads | NE within 0.5% |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["switches"]:
        paired = "" if r["ne_paired_change_pct"] is None else f"{r['ne_paired_change_pct']:+.2f}%"
        lines.append(
            f"| {r['switch']} | {', '.join(map(str, r['seeds']))} | {r['ne_mean']:.4f} | {r['ne_change_pct']:+.2f}% | {paired} | "
            f"{r['auc_mean']:.4f} | {r['auc_change_pct']:+.2f}% | {r['ne_lift_fraction']:.3f} | {flag(r['within_two_spreads'])} | "
            f"{flag(r['ne_within_tolerance'])} |"
        )
    if table["needs_more_seeds"]:
        lines += ["", f"within two spreads with fewer than {SEEDS_WHEN_CLOSE} seeds: {', '.join(table['needs_more_seeds'])}"]
    return "\n".join(lines)


def switch_figure(table: dict, title: str, path: Path) -> None:
    """Bars of each switch's NE change against the reference mean (%), its seeds as points, the
    reference's spread (max - min) as a band around 0 and twice it lighter, the 0.5% bound dashed."""
    ref, rows = table["reference"], table["switches"][1:]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows) + 2), 4))
    x = np.arange(len(rows))
    if not np.isnan(ref["ne_spread_pct"]):
        half = ref["ne_spread_pct"] / 2
        ax.axhspan(-4 * half, 4 * half, color="tab:gray", alpha=0.15, label="within two spreads: +-2 x (max - min)")
        ax.axhspan(-half, half, color="tab:gray", alpha=0.35, label="reference spread (max - min), centred on 0")
    for bound in (-100 * NE_TOLERANCE, 100 * NE_TOLERANCE):
        ax.axhline(bound, color="tab:red", linestyle="--", linewidth=1, label=f"+-{100 * NE_TOLERANCE:g}%" if bound > 0 else None)
    ax.bar(x, [r["ne_change_pct"] for r in rows], color="tab:blue", label="NE change of the seeds' mean")
    for i, r in enumerate(rows):
        ax.plot([i] * len(r["ne"]), [100 * (v / ref["ne_mean"] - 1) for v in r["ne"]], "k.", markersize=5)
    ax.set_xticks(x, [r["switch"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel(f"eval NE vs {ref['switch']} mean (%)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _switch_seed(name: str, where: Path) -> tuple[str, int]:
    match = SWITCH_RUN.fullmatch(name)
    if match is None:
        raise SystemExit(f"compare_runs: --switch-table run {name!r} is not named <switch>_seed<k> ({where})")
    return match["switch"], int(match["seed"])


def record_evals(record_file: Path) -> tuple[dict[str, dict[str, float]], list[str]]:
    """The final evals of the runs in a runs record, for runs whose folders are not on this machine.

    A runs record is a `benchmarks/results` file whose `runs` maps `<switch>_seed<k>` to
    `{"evals": [{"step", "auc_<task>", "ne_<task>", ...}, ...]}` (each run's eval records, in
    order, as its metrics.jsonl logged them; `switch_table_*_runs_*.json`). The runs of a switch
    table all train the same steps, so the record's final step is the largest step any of its runs
    evaluated at; a run's final eval is its last one if it is at that step. A run whose last eval
    is earlier stopped before its final eval (as `final_eval` says of a run's folder).

    Returns:
      `(evals, without_eval)`: run name -> `{"ne", "auc"}` of its one task at the final step, and
      the names of the runs without a final eval.

    Raises:
      SystemExit: naming the file (and the run, where one is at fault) for a file that cannot be read
        or is not JSON, a record without `runs`, a run without a list of evals, or a final eval
        without one task's NE and AUC or with either missing (null).
    """
    where = f"compare_runs: --record {record_file}"
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"{where}: cannot be read as JSON ({error})") from None
    runs = record.get("runs") if isinstance(record, dict) else None
    if not isinstance(runs, dict) or not runs:
        raise SystemExit(f"{where} holds no `runs` (run name -> {{\"evals\": [...]}})")
    last = {}
    for name, run in runs.items():
        listed = run.get("evals") if isinstance(run, dict) else None
        if not isinstance(listed, list) or not listed or not all(isinstance(e, dict) for e in listed):
            raise SystemExit(f"{where}, run {name!r}: no list of eval records under `evals`")
        last[name] = listed[-1]
    final_step = max(e.get("step", -1) for e in last.values())
    evals, without_eval = {}, []
    for name, final in last.items():
        if final.get("step") != final_step:
            without_eval.append(name)
            continue
        tasks = sorted(k[len("ne_"):] for k in final if k.startswith("ne_") and f"auc_{k[len('ne_'):]}" in final)
        if len(tasks) != 1:
            raise SystemExit(f"{where}, run {name!r}, eval of step {final_step}: want the NE and AUC of one task, found tasks {tasks}")
        result = {"ne": final[f"ne_{tasks[0]}"], "auc": final[f"auc_{tasks[0]}"]}
        missing = [f"{key}_{tasks[0]}" for key, value in result.items() if value is None]
        if missing:
            raise SystemExit(f"{where}, run {name!r}, eval of step {final_step} lacks {missing}")
        evals[name] = result
    return evals, without_eval


def switch_table_main(args: argparse.Namespace, paths: dict[str, Path], runs: dict[str, dict[str, list[dict]]]) -> None:
    """`--switch-table`: reads each run's final eval (from its folder, or from a `--record`), writes the
    table's JSON and figure, prints the Markdown."""
    if args.planted is None:
        raise SystemExit("compare_runs: --switch-table needs --planted DIR (the planted log's oracle.json)")
    oracle = read_oracle(args.planted)
    evals: dict[str, dict[int, dict[str, float]]] = {}
    without_eval = []
    sources = {name: str(path) for name, path in paths.items()}
    source_of: dict[tuple[str, int], Path] = {}  # (switch, seed) -> where its eval was read

    def add(switch: str, seed: int, result: dict[str, float], where: Path) -> None:
        if (switch, seed) in source_of:
            raise SystemExit(f"compare_runs: two runs of switch {switch!r} with seed {seed} ({source_of[switch, seed]} and {where})")
        source_of[switch, seed] = where
        evals.setdefault(switch, {})[seed] = result

    for name, run in runs.items():
        where = paths[name] / "metrics.jsonl"
        switch, seed = _switch_seed(name, where)
        record_file = paths[name] / "run.json"
        config = json.loads(record_file.read_text()).get("config", {}) if record_file.exists() else {}
        for part in ("loop", "data"):
            logged = config.get(part, {}).get("seed", seed)
            if logged != seed:
                raise SystemExit(f"compare_runs: run {name!r} was trained with {part}.seed={logged}, not {seed} ({record_file})")
        if not run["train"]:
            raise SystemExit(f"compare_runs: run {name!r} logged no train step ({where})")
        record = final_eval(run)
        if record is None:
            without_eval.append(name)
            continue
        task = run_tasks(paths[name], run["train"])[0]
        missing = [key for key in (f"ne_{task}", f"auc_{task}") if record.get(key) is None]
        if missing:
            raise SystemExit(f"compare_runs: run {name!r}, eval record of step {record['step']} lacks {missing} ({where})")
        add(switch, seed, {"ne": record[f"ne_{task}"], "auc": record[f"auc_{task}"]}, where)
    reruns = set(args.rerun)
    not_folders = sorted(reruns - set(paths))
    if not_folders:
        raise SystemExit(f"compare_runs: --rerun {', '.join(not_folders)}: no --run folder of that name (a rerun's folder replaces its record's entry)")
    unfinished = sorted(reruns & set(without_eval))
    if unfinished:  # the record's finished run would be dropped for a folder that has none
        raise SystemExit(f"compare_runs: --rerun {', '.join(unfinished)}: the folder has no final eval ({', '.join(str(paths[n]) for n in unfinished)})")
    replaced: dict[str, Path] = {}  # rerun name -> the record whose entry it replaces
    for record_file in args.record:
        recorded, stopped = record_evals(record_file)
        for name in sorted(reruns & {*recorded, *stopped}):
            if name in replaced:
                raise SystemExit(f"compare_runs: --rerun {name}: in two records ({replaced[name]} and {record_file}); a rerun replaces one")
            replaced[name] = record_file
            recorded.pop(name, None)
            stopped = [n for n in stopped if n != name]
        for name in [*recorded, *stopped]:
            if name in sources:
                raise SystemExit(f"compare_runs: run {name!r} is both {sources[name]} and in --record {record_file}")
            sources[name] = f"{record_file} (runs record)"
        without_eval += stopped
        for name, result in recorded.items():
            switch, seed = _switch_seed(name, record_file)
            add(switch, seed, result, record_file)
    not_recorded = sorted(reruns - set(replaced))
    if not_recorded:
        raise SystemExit(f"compare_runs: --rerun {', '.join(not_recorded)}: in no --record (a rerun replaces a recorded run)")
    if without_eval:
        print(f"compare_runs: no final eval record in {', '.join(without_eval)}: left out of the table")
    table = switch_table(evals, args.reference_switch, oracle)
    summary = {
        "date": datetime.date.today().isoformat(),
        "device": f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()})",
        "jax": jax.__version__,
        "title": args.title,
        "runs": sources,
        "runs_without_eval": without_eval,
        "oracle_report": oracle,
        **table,
    }
    args.out.write_text(json.dumps(summary, indent=1))
    switch_figure(table, args.title, args.figure)
    print(switch_markdown(table, oracle))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", default=[], help="name=workdir; the first is the reference")
    parser.add_argument("--record", action="append", type=Path, default=[], help="with --switch-table: a runs record's runs, for runs whose folders are gone (`record_evals`)")
    parser.add_argument("--rerun", action="append", default=[], metavar="NAME", help="with --record: a run both a --run folder and a record's; the folder replaces the record's entry")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--figure", type=Path, required=True)
    parser.add_argument("--title", help="the figure's title (default: eval and train NE per run; with --switch-table: switch table)")
    parser.add_argument("--planted", type=Path, help="a gem-data plant directory: place every eval against its oracle.json (module docstring)")
    parser.add_argument("--loss-window", type=int, default=5, help="last logged train steps averaged for the final loss (>= 1)")
    parser.add_argument("--switch-table", action="store_true", help="runs named <switch>_seed<k>: the switch table (module docstring); needs --planted")
    parser.add_argument("--reference-switch", default="bf16", help="with --switch-table: the switch the others are compared with")
    args = parser.parse_args()
    if args.record and not args.switch_table:
        raise SystemExit("compare_runs: --record is read only with --switch-table")
    if args.rerun and not args.record:
        raise SystemExit("compare_runs: --rerun names a run of a --record that a folder replaces: give the --record")
    if not args.run and not (args.switch_table and args.record):
        raise SystemExit("compare_runs: name the runs to compare with --run name=workdir (with --switch-table, or --record FILE)")
    if args.loss_window < 1:
        raise SystemExit(f"compare_runs: --loss-window must be >= 1, got {args.loss_window}")
    paths = run_paths(args.run)
    for where in (args.out, args.figure):
        if not where.parent.is_dir():
            raise SystemExit(f"compare_runs: {where}: its folder {where.parent} does not exist")
    runs = {name: read_run(path) for name, path in paths.items()}
    if args.switch_table:
        args.title = args.title or "switch table"
        switch_table_main(args, paths, runs)
        return
    args.title = args.title or "eval and train NE per run"
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
    train_ne = {name: {task: mean_train_ne(name, records, f"ne_{names[name][task]}") for task in tasks} for name, records in window.items()}
    # A final eval is the eval of the run's last train step; an earlier one is not compared.
    final = {name: record for name, run in runs.items() if (record := final_eval(run)) is not None}
    without_eval = [name for name in runs if name not in final]
    if without_eval:
        print(f"compare_runs: no final eval record in {', '.join(without_eval)}: compared on train loss and train NE only")
    if reference not in final:
        print(f"compare_runs: the reference run {reference!r} has no final eval: no eval comparison")
    compared = final if reference in final else {}

    def eval_change(metric: str) -> dict:
        return {
            name: {task: _ratio_change(record[f"{metric}_{names[name][task]}"], compared[reference][f"{metric}_{task}"]) for task in tasks}
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
            name: {task: _ratio_change(train_ne[name][task], train_ne[reference][task]) for task in tasks} for name in runs
        },
        "curves": {name: {"train": run["train"], "eval": run["eval"]} for name, run in runs.items()},
    }
    if args.planted is not None:
        oracle = read_oracle(args.planted)
        for name, run in runs.items():
            missing = [r["step"] for r in run["eval"] if f"auc_{names[name][tasks[0]]}" not in r]
            if missing:
                raise SystemExit(f"compare_runs: run {name!r}, eval records of steps {missing} lack auc_{names[name][tasks[0]]} ({paths[name] / 'metrics.jsonl'})")
        for name, run in runs.items():
            check_oracle_fits(oracle, args.planted, name, run["eval"], names[name][tasks[0]], paths[name] / "metrics.jsonl")
        rows = planted_rows(oracle, {name: run["eval"] for name, run in runs.items()}, {name: names[name][tasks[0]] for name in runs})
        summary["planted"] = {"oracle_report": oracle, "task": tasks[0], "evals": rows}
        print(planted_table(oracle, rows))
    args.out.write_text(json.dumps(summary, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4))
    if args.planted is not None:  # the reference predictors' eval NE, for the eval points to sit between
        for level, style in zip(planted_levels(oracle), (":", "-.", "--", "-")):
            ax.axhline(level["ne"], color="grey", linestyle=style, linewidth=1, label=f"{level['name']} eval NE")
    for name, run in runs.items():
        key = f"ne_{names[name][tasks[0]]}"
        def curve(records: list[dict]) -> list[float]:
            return [np.nan if r[key] is None else r[key] for r in records]  # undefined (one class): a gap

        line = ax.plot([r["step"] for r in run["train"]], curve(run["train"]), label=f"{name} train NE")[0]
        ax.plot([r["step"] for r in run["eval"]], curve(run["eval"]), "o--", color=line.get_color(), label=f"{name} eval NE")
    ax.set_xlabel("step")
    ax.set_ylabel(f"NE, {tasks[0]} task")
    ax.set_title(args.title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.figure, dpi=120)
    print(json.dumps({k: v for k, v in summary.items() if k.endswith("_vs_reference")}, indent=1))


if __name__ == "__main__":
    main()
