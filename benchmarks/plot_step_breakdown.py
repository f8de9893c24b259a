"""Stacked bars of the train step's kernel breakdown, before and after, from result JSONs.

Reads `benchmarks/results/step_h200_baseline.json` (the earlier measurement, `cases`) and
`benchmarks/train_bench.py --profile` results (`runs` and `peers.*.runs`); draws one panel
per config (the model sets the scale), one bar per measured step: device milliseconds per
kernel group (`benchmarks/_profile.py`), the step's wall time and Local MFU beside it.

    PYTHONPATH=. python3 benchmarks/plot_step_breakdown.py \\
        benchmarks/results/step_h200_baseline.json benchmarks/results/train_step_h200_*.json \\
        --out benchmarks/figures/step_breakdown.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import _profile  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COLORS = dict(zip(_profile.GROUPS, plt.get_cmap("tab10").colors))


def _bar(config: str, label: str, measured: dict) -> dict:
    """One bar from a measured step (`profile.groups_ms`, `median_step_s`, optional `mfu_per_device`)."""
    return {
        "panel": Path(config).stem,
        "label": label,
        "groups_ms": measured["profile"]["groups_ms"],
        "step_ms": 1e3 * measured["median_step_s"],
        "mfu": measured.get("mfu_per_device"),
    }


def bars(record: dict, path: str, name: str | None = None) -> list[dict]:
    """`[{panel, label, groups_ms, step_ms, mfu}]` of one result file's profiled steps.

    `name` replaces the file's commit at the head of its bars' labels.

    Raises:
      ValueError: the file is neither a baseline (`cases`) nor a train_bench result (`runs`).
    """
    commit = name or str(record.get("git_commit", "?"))[:7]
    if "cases" in record:
        found = [
            _bar(c["config"], f"before {commit}: {c.get('attention', '')}{' fp8' if c.get('fp8') else ''}", c)
            for c in record["cases"]
            if "profile" in c
        ]
    elif "runs" in record:
        sections = [record] + list(record.get("peers", {}).values())
        fp8 = " fp8" if (record.get("model") or {}).get("fp8") else ""
        found = [
            _bar(record["config"], f"{commit}: {section['attention']}{fp8}, {run['num_devices']} GPU", run)
            for section in sections
            for run in section.get("runs", [])
            if "groups_ms" in (run.get("profile") or {})
        ]
    else:
        raise ValueError(f"{path}: neither a step baseline ('cases') nor a train_bench result ('runs')")
    for bar in found:
        unknown = set(bar["groups_ms"]) - set(_profile.GROUPS)
        if unknown:
            raise ValueError(f"{path}: unknown kernel groups {sorted(unknown)} in {bar['label']!r}")
    return found


def plot(all_bars: list[dict], out: Path) -> None:
    """One horizontal stacked-bar panel per config; null groups (not separated) count as 0."""
    panels = list(dict.fromkeys(b["panel"] for b in all_bars))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.55 * len(all_bars) + 0.6 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        rows = [b for b in all_bars if b["panel"] == panel]
        for y, bar in enumerate(rows):
            left = 0.0
            for group in _profile.GROUPS:
                ms = bar["groups_ms"].get(group) or 0.0
                ax.barh(y, ms, left=left, color=COLORS[group], label=_profile.LABELS[group] if ms else None)
                left += ms
            mfu = f", MFU {100 * bar['mfu']:.1f}%" if bar["mfu"] else ""
            ax.text(left, y, f"  step {bar['step_ms']:.1f} ms{mfu}", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [b["label"] for b in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("device time of one step (ms, CUPTI)")
        ax.margins(x=0.3)  # room for the step label right of the longest bar
    handles = {}
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    order = [_profile.LABELS[g] for g in _profile.GROUPS if _profile.LABELS[g] in handles]
    fig.legend([handles[k] for k in order], order, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="baseline and train_bench --profile result JSONs")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "figures" / "step_breakdown.png"))
    parser.add_argument("--names", nargs="+", help="one label head per results file, in order (default: each file's commit)")
    args = parser.parse_args(argv)
    if args.names and len(args.names) != len(args.results):
        parser.error(f"--names: {len(args.names)} names for {len(args.results)} results files")
    names = args.names or [None] * len(args.results)
    all_bars = [bar for path, name in zip(args.results, names) for bar in bars(json.loads(Path(path).read_text()), path, name)]
    if not all_bars:
        parser.error("no profiled steps in these files (train_bench needs --profile on a GPU)")
    plot(all_bars, Path(args.out))


if __name__ == "__main__":
    main()
