"""What a model can reach on a planted log, by what it reads off the history: the oracle and its ceilings.

    PYTHONPATH=. python3 benchmarks/planted_ceilings.py --preset long-range --out benchmarks/results/planted_ceilings_long_range.json

`gem_jax.train.oracle.oracle_report` on the split (`--split`, as `gem-data convert --split` takes it)
scores the oracle, the item-mean baseline, and the oracle without the history or without its long-range
part. Beside them this scores the **categories-only** ceiling: the oracle with its recent term computed
from each item's category mean vector (the mean of its category's items' latent vectors) instead of its
own. That is what a model that knows each history item's category, but not the item's own latent
direction, can reach: the mid and long-range terms are functions of the categories already, and the user
and item effects stay, as a model learns them from the user and item ids. Each row's share of the
oracle's AUC lift over the item-mean baseline is reported beside it. The log is generated in memory
(`gem_jax.data.planted.generate`), as `gem-data plant` writes it for the same preset and seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.planted import PRESETS, PlantedConfig, generate, log_truth, small
from gem_jax.data.planted.generator import recent_affinity
from gem_jax.train.oracle import oracle_report


def category_mean_vectors(vectors: np.ndarray, category: np.ndarray) -> np.ndarray:
    """float64 `[I, latent_dim]`: each item's category mean of `vectors` (float `[I, latent_dim]`; `category` int `[I]`, ids from 0)."""
    sums = np.zeros((int(category.max()) + 1, vectors.shape[1]))
    np.add.at(sums, category, vectors)
    return (sums / np.bincount(category)[:, None])[category]


def ceilings(config: PlantedConfig, rule: SplitRule) -> dict:
    """AUC and NE of the oracle, the categories-only ceiling, no history and the item-mean baseline on `rule`'s
    eval events of the log `config` generates, with each one's share of the oracle's AUC lift (module docstring).

    Raises:
      ValueError: the split leaves no train or no eval events (`oracle_report`).
    """
    log = generate(config)
    truth = log_truth(log)
    position = np.arange(log.num_events) - log.user_offsets[log.user]
    recent = config.recent_weight * recent_affinity(config, category_mean_vectors(log.item_vectors, log.item_category), log.item, position)
    by_category = dataclasses.replace(truth, logit=truth.logit - truth.terms["recent"] + recent, terms={**truth.terms, "recent": recent})
    report = oracle_report(truth, rule)
    rows = {"oracle": report.oracle, "categories_only": oracle_report(by_category, rule).oracle, "no_history": report.no_history, "item_mean": report.item_mean}
    lift = report.oracle.auc - report.item_mean.auc
    return {
        "split": report.split,
        "eval_events": report.eval_events,
        "auc": {name: q.auc for name, q in rows.items()},
        "ne": {name: q.ne for name, q in rows.items()},
        "lift_share": {name: (q.auc - report.item_mean.auc) / lift for name, q in rows.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="long-range")
    parser.add_argument("--small", action="store_true", help="1/10 of the users, items and categories")
    parser.add_argument("--split", default="time:0.9", help="the split, as gem-data convert --split takes it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = small(PRESETS[args.preset]) if args.small else PRESETS[args.preset]
    result = {"preset": args.preset, "small": args.small, **ceilings(config, SplitRule.parse(args.split))}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
