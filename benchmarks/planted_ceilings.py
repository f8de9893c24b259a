"""What a model can reach on a planted log, by what it reads off the history: the oracle and its ceilings.

    PYTHONPATH=. python3 benchmarks/planted_ceilings.py --preset long-range --out benchmarks/results/planted_ceilings_long_range.json

On the eval events of the `time:Q` split (the trainer's and `gem-data oracle`'s), the AUC of:

- oracle: the true logit;
- categories only: the true logit with the recent term computed from each item's category mean vector
  (the mean of its category's items' latent vectors) instead of its own: what a model that knows each
  history item's category, but not the item's own latent direction, can reach (the mid and long terms
  are functions of the categories already; the user and item effects are kept, as a model learns them
  from the user and item ids);
- no history: the history terms replaced by their means (`gem_jax.train.oracle`'s no_history);
- item-mean: each item's mean train label (the trainer's baseline).

and each one's share of the oracle's lift over the item-mean. The log is generated in memory
(`gem_jax.data.planted.generate`), as `gem-data plant` would write it for the same preset and seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from gem_jax.data.planted import LONG_RANGE, SHORT_RANGE, generate, small
from gem_jax.data.planted.generator import recent_affinity
from gem_jax.train.metrics import auc as roc_auc

PRESETS = {"long-range": LONG_RANGE, "short-range": SHORT_RANGE}


def category_mean_vectors(vectors: np.ndarray, category: np.ndarray) -> np.ndarray:
    """float64 `[I, latent_dim]`: each item's category mean of the unit vectors `vectors` (`category` int `[I]`)."""
    sums = np.zeros((int(category.max()) + 1, vectors.shape[1]))
    np.add.at(sums, category, vectors)
    return (sums / np.bincount(category)[:, None])[category]


def ceilings(config, quantile: float) -> dict:
    log = generate(config)
    position = np.arange(log.num_events) - log.user_offsets[log.user]
    terms = log.terms
    by_category = config.recent_weight * recent_affinity(config, category_mean_vectors(log.item_vectors, log.item_category), log.item, position)
    cutoff = np.sort(log.time)[int(quantile * log.num_events)]
    evals, train = log.time >= cutoff, log.time < cutoff
    labels = log.click[evals].astype(np.float64)
    counts = np.bincount(log.item[train], minlength=config.num_items)
    means = np.bincount(log.item[train], weights=log.click[train], minlength=config.num_items) / np.maximum(counts, 1)
    item_mean = np.where(counts > 0, means, log.click[train].mean())
    history_means = sum(terms[name].mean() for name in ("recent", "mid", "long"))
    scores = {
        "oracle": log.logit,
        "categories_only": config.base_logit + terms["user"] + terms["item"] + by_category + terms["mid"] + terms["long"],
        "no_history": config.base_logit + terms["user"] + terms["item"] + history_means,
        "item_mean": item_mean[log.item],
    }
    auc = {name: float(roc_auc(score[evals], labels)) for name, score in scores.items()}
    lift = auc["oracle"] - auc["item_mean"]
    return {"auc": auc, "lift_share": {name: (a - auc["item_mean"]) / lift for name, a in auc.items()}, "eval_events": int(evals.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="long-range")
    parser.add_argument("--small", action="store_true", help="1/10 of the users, items and categories")
    parser.add_argument("--split", type=float, default=0.9, help="the time quantile of the split (time:Q)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = small(PRESETS[args.preset]) if args.small else PRESETS[args.preset]
    result = {"preset": args.preset, "small": args.small, "split": f"time:{args.split}", **ceilings(config, args.split)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
