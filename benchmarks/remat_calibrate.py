"""Calibrates the remat planner's cost model and checks its memory estimate against train_bench runs.

Takes `benchmarks/train_bench.py` records of one config: a baseline without
rematerialization (first) and runs with remat policies or budgets (`--set
model.remat...`), each in its own process (`peak_bytes_in_use_device0` is the process's
peak). For each remat run it compares

- the step time added over the baseline with the planner's estimate, and fits the two
  constants of `gem_jax.train.remat_plan.CostModel` by least squares over the runs:
  added seconds = recompute FLOPs / matmul_flops_per_s + 2 x freed bytes / bytes_per_s;
- the measured peak with the planner's estimated peak (`remat_plan.peak_bytes_estimate`).

    PYTHONPATH=. python3 benchmarks/remat_calibrate.py base.json save_dots.json save_nothing.json --out calibration.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def first_run(path: Path) -> dict:
    record = json.loads(path.read_text())
    if not record.get("runs"):
        raise SystemExit(f"{path}: no run recorded (errors: {record.get('errors')})")
    return record["runs"][0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="train_bench record without rematerialization")
    parser.add_argument("runs", type=Path, nargs="+", help="train_bench records with model.remat set")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    base = first_run(args.baseline)
    rows, features, added = [], [], []
    for path in args.runs:
        run = first_run(path)
        plan = run.get("remat_plan")
        if plan is None:
            raise SystemExit(f"{path}: the run has no remat plan (set model.remat.policies or model.remat.budget_gb)")
        flops = sum(r["recompute_flops"] for r in plan["regions"])
        freed = sum(r["freed_bytes"] for r in plan["regions"])
        seconds = run["median_step_s"] - base["median_step_s"]
        features.append([flops, 2.0 * freed])
        added.append(seconds)
        rows.append({
            "record": str(path),
            "added_step_ms": 1e3 * seconds,
            "estimated_recompute_ms": plan["recompute_ms"],
            "peak_bytes": run["peak_bytes_in_use_device0"],
            "estimated_peak_bytes": plan["peak_bytes_estimate"],
            "peak_over_estimate": None if run["peak_bytes_in_use_device0"] is None else run["peak_bytes_in_use_device0"] / plan["peak_bytes_estimate"],
        })
    (inv_flops, inv_bandwidth), *_ = np.linalg.lstsq(np.asarray(features), np.asarray(added), rcond=None)
    result = {
        "baseline": str(args.baseline),
        "baseline_step_ms": 1e3 * base["median_step_s"],
        "baseline_peak_bytes": base["peak_bytes_in_use_device0"],
        "runs": rows,
        # Non-positive fitted rates mean the runs do not follow the model (noise larger than the recompute, say).
        "fitted_matmul_flops_per_s": 1.0 / inv_flops if inv_flops > 0 else None,
        "fitted_bytes_per_s": 1.0 / inv_bandwidth if inv_bandwidth > 0 else None,
        "fit_coefficients": {"seconds_per_flop": float(inv_flops), "seconds_per_byte": float(inv_bandwidth)},
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
