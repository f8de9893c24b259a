"""What reaches how much of the planted oracle's lift: the ceilings and fits of `planted_ceilings.py` beside trained runs.

Two panels, one bar per row: the share of the oracle's eval AUC lift over the item-mean baseline
(`(AUC - AUC_item_mean) / (AUC_oracle - AUC_item_mean)`) and the eval NE above the oracle's, in percent,
with the GEM-width targets (90% of the lift, NE within 2%) drawn across. The first argument is a
`planted_ceilings.py` record; its rows are drawn in `ROWS` order where present. Each `LABEL=PATH` after
it is a `compare_runs.py` record whose `final_eval` holds one run (the first is taken where there are
several), scored against the same oracle: the record's `planted.oracle_report` must name the same eval
event count as the ceilings' record, or it is refused.

    python benchmarks/plot_planted_ceilings.py benchmarks/results/planted_ceilings_long_range.json \\
        "GEM width, 1800 steps=benchmarks/results/planted_gem_tied_qk_long_range_h200_20261205.json" \\
        --out benchmarks/figures/planted_ceilings_long_range.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (ceilings row, its label): from what knows most to what learns from the job's data alone
ROWS = (
    ("fitted_item_vectors", "fit, given the item vectors"),
    ("categories_only", "true effects, category vectors"),
    ("fitted", "fit, given the category vectors"),
    ("fitted_online_1.067", "the same, one job's data"),
    ("learned_category_vectors_1024_1.067", "category vectors learned, 1024 wide, one job's data"),
    ("learned_item_vectors_1024_1.067", "item vectors learned, 1024 wide, one job's data"),
    ("learned_category_vectors_16_4.000", "category vectors learned, 16 wide, 4 passes"),
    ("learned_category_vectors_16_1.067", "category vectors learned, 16 wide, one job's data"),
    ("learned_item_vectors_16_1.067", "item vectors learned, 16 wide, one job's data"),
    ("learned_item_vectors_16_4.000", "item vectors learned, 16 wide, 4 passes"),
    ("no_history", "oracle without the history"),
)
LIFT_TARGET, NE_TARGET = 90.0, 2.0  # percent: the GEM-width targets


def bars(ceilings: dict, runs: dict[str, dict]) -> list[tuple[str, float, float]]:
    """`[(label, % of the oracle's AUC lift, % NE above the oracle's)]`: `ROWS` present in `ceilings` (a
    planted_ceilings record), then each of `runs` (`{label: compare_runs record}`).

    Raises:
      ValueError: a run's record holds no final eval, or was scored on another eval set than `ceilings`.
    """
    auc, ne = ceilings["auc"], ceilings["ne"]

    def bar(label, run_auc, run_ne):
        lift = (run_auc - auc["item_mean"]) / (auc["oracle"] - auc["item_mean"])
        return label, 100.0 * lift, 100.0 * (run_ne / ne["oracle"] - 1.0)

    out = [bar(label, auc[row], ne[row]) for row, label in ROWS if row in auc]
    for label, record in runs.items():
        if not record.get("final_eval"):
            raise ValueError(f"plot_planted_ceilings: run {label!r}: its record holds no final_eval")
        events = record.get("planted", {}).get("oracle_report", {}).get("eval_events")
        if events != ceilings["eval_events"]:
            raise ValueError(f"plot_planted_ceilings: run {label!r} was scored on {events} eval events, the ceilings on {ceilings['eval_events']}")
        final = next(iter(record["final_eval"].values()))
        out.append(bar(label, final["auc_click"], final["ne_click"]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ceilings", type=Path, help="a planted_ceilings.py record")
    parser.add_argument("runs", nargs="*", metavar="LABEL=PATH", help="compare_runs.py records of trained runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            parser.error(f"a run is LABEL=PATH, got {spec!r}")
        runs[label] = json.loads(Path(path).read_text())
    ceilings = json.loads(args.ceilings.read_text())
    rows = bars(ceilings, runs)
    labels, lift, ne = zip(*rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    positions = range(len(rows))
    colors = ["tab:blue"] * (len(rows) - len(runs)) + ["tab:orange"] * len(runs)
    left.barh(positions, lift, color=colors)
    left.axvline(LIFT_TARGET, color="k", linestyle="--", linewidth=1)
    left.set_xlabel("share of the oracle's AUC lift over the item-mean baseline (%)")
    right.barh(positions, ne, color=colors)
    right.axvline(NE_TARGET, color="k", linestyle="--", linewidth=1)
    right.set_xlabel("eval NE above the oracle's (%)")
    left.set_yticks(list(positions), labels)
    left.invert_yaxis()
    fig.suptitle(f"Planted {ceilings['preset']} log, {ceilings['split']}: ceilings and fits (blue), trained runs (orange); dashed: the GEM-width targets")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
