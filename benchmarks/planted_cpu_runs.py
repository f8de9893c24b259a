"""Tiny models on a small planted log, on the CPU: the runs behind benchmarks/quality.md's "History item features" tables.

    PYTHONPATH=. python3 benchmarks/planted_cpu_runs.py --out benchmarks/results/planted_cpu_history_features.json \
        --run off_d32_seed0= --run on_d32_seed0=data.history_item_features=True ...

Plants the long-range preset shrunk to 300 users, 200 items and 20 categories (`gem_jax.data.planted`,
seed 0; about 48k events, `gem-data plant` has no flags for these sizes), converts it with the `time:0.9`
split, then trains `configs/events_tiny.py` once per `--run NAME=OVERRIDES` (space-separated `--set`
overrides; a name holding `_d<width>`, e.g. `_d32` or `_d128`, takes that width, with 2 sequence layers, 2 pooled queries
and head MLPs of max(64, d); `_seed<k>` sets `loop.seed` and `data.seed`; `noactions` trains on the log
converted without its action column, as every run before 2026-12-06 did, so history rows do not carry
their events' outcomes: `gem_jax.data.planted.event_schema`) under the common recipe: 500
steps of 128, dense AdamW 1e-2 after 10 warm-up steps, row-wise embedding Adagrad from 0 at 1.0. Writes
each run's final eval AUC and NE and its train NE at every log, with the log's item-mean and oracle, to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
from pathlib import Path

from benchmarks.compare_runs import read_run
from gem_jax.data.ingest.convert import ConvertOptions, convert
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.planted import LONG_RANGE, event_schema, generate, read_truth, write_planted
from gem_jax.train.config import load_config
from gem_jax.train.config_tree import apply_overrides
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.oracle import oracle_report

SPLIT = "time:0.9"
PLANTED = dataclasses.replace(LONG_RANGE, num_users=300, num_items=200, num_categories=20)
RECIPE = (
    "loop.num_steps=500", "loop.log_every=100", "data.batch_size=128", "data.capacity_step=2.0", "optim.learning_rate=1e-2",
    "optim.warmup_steps=10", "optim.decay_steps=490", "optim.embedding_learning_rate=1.0", "optim.embedding_initial_accumulator=0",
)


def name_overrides(name: str) -> list[str]:
    """The model and seed overrides a run's name asks for (`_d<width>`, `_seed<k>`)."""
    out = []
    if (width := re.search(r"_d(\d+)", name)) is not None:
        d = int(width[1])
        out += [f"model.embed_dim={d}", "model.num_seq_layers=2", "model.num_pooled_queries=2", f"model.head_hidden={max(64, d)}"]
    if (seed := re.search(r"_seed(\d+)", name)) is not None:
        out += [f"loop.seed={seed[1]}", f"data.seed={seed[1]}"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="NAME=OVERRIDES (space-separated --set overrides)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="planted_cpu_"))
    files = write_planted(generate(PLANTED), root / "log")
    for name, actions in (("converted", True), ("converted_noactions", False)):
        convert([files.events], root / name, event_schema(files, actions=actions), ConvertOptions(split=SplitRule.parse(SPLIT)), log=lambda line: None)
    report = oracle_report(read_truth(files.truth), SplitRule.parse(SPLIT))
    base = load_config(Path(__file__).parents[1] / "configs" / "events_tiny.py")
    results = {}
    for spec in args.run:
        name, _, extra = spec.partition("=")
        converted = root / ("converted_noactions" if "noactions" in name else "converted")
        overrides = [f"data.path={converted}", *RECIPE, *name_overrides(name), *extra.split()]
        summary = train_and_evaluate(apply_overrides(base, overrides), root / name, progress=False)
        results[name] = {"overrides": overrides[1:], "actions": "noactions" not in name, "auc": summary["auc_click"], "ne": summary["ne_click"],
                         # step -> train NE (each log the mean since the last)
                         "train_ne": {r["step"]: None if r["ne_click"] is None else round(r["ne_click"], 4) for r in read_run(root / name)["train"]}}
        print(name, results[name]["auc"], results[name]["ne"], flush=True)
    args.out.write_text(json.dumps({
        "log": "long-range preset, 300 users, 200 items, 20 categories, seed 0; split " + SPLIT,
        "item_mean": {"auc": report.item_mean.auc, "ne": report.item_mean.ne},
        "oracle": {"auc": report.oracle.auc, "ne": report.oracle.ne},
        "runs": results,
    }, indent=1))


if __name__ == "__main__":
    main()
