"""Quality metrics for binary tasks: normalized entropy (NE), AUC and calibration (the BCE loss is `gem_jax.model.loss`).

NE (He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook", 2014) is
the average log loss divided by the entropy of the base rate `p`:
`NE = BCE / -(p log p + (1-p) log(1-p))`; below 1 means better than predicting `p`.
Calibration (the same paper) is the mean predicted probability over the observed rate:
1 is calibrated, above 1 over-predicts; NE counts a miscalibration that AUC cannot see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from gem_jax.model.loss import bce_per_example, weighted_bce

__all__ = [
    "EvalAccumulator", "auc", "bce_per_example", "binary_entropy", "calibration", "normalized_entropy", "one_class_note",
    "pooled_normalized_entropy", "weighted_bce",
]


def binary_entropy(p):
    """Entropy in nats of a Bernoulli(p); works on numpy and jax arrays."""
    xp = jnp if isinstance(p, jax.Array) else np
    p = xp.clip(p, 1e-7, 1 - 1e-7)
    return -(p * xp.log(p) + (1 - p) * xp.log(1 - p))


def normalized_entropy(mean_bce, base_rate):
    """NE from the mean BCE and the label base rate (per task).

    The rate is clipped to [1e-7, 1 - 1e-7]: a rate of exactly 0 or 1 (one class) gives a huge
    number, not an NE; `pooled_normalized_entropy` says None there instead.
    """
    return mean_bce / binary_entropy(base_rate)


def pooled_normalized_entropy(mean_bce: float | None, positives: float, negatives: float) -> float | None:
    """One task's NE over a set of examples: their mean BCE over the entropy of their pooled base rate
    `positives / (positives + negatives)` (counts or weight sums of the examples labelled 1 and 0),
    `normalized_entropy` of that rate.

    Returns:
      The NE as a float; None when the set holds one class only (no positives or no negatives):
      the base rate's entropy is 0 and NE is undefined.
    """
    if positives <= 0 or negatives <= 0:
        return None
    return float(normalized_entropy(mean_bce, positives / (positives + negatives)))


def one_class_note(record: dict, task_names) -> str | None:
    """The one-line reason an eval record (`EvalAccumulator.result`) holds no AUC and NE for some task, or None.

    E.g. "eval: AUC and NE of task click are undefined: all 40 eval examples are labelled 0 (no positives)".
    """
    notes = []
    for name in task_names:
        classes = record.get(f"eval_positives_{name}"), record.get("eval_examples")
        if record.get(f"auc_{name}") is None and record.get(f"ne_{name}") is None and None not in classes:
            positives, examples = classes
            which = "0 (no positives)" if positives == 0 else "1 (no negatives)"
            notes.append(f"AUC and NE of task {name} are undefined: all {examples} eval examples are labelled {which}")
    return "eval: " + "; ".join(notes) if notes else None


def calibration(logits: np.ndarray, labels: np.ndarray) -> float:
    """Calibration (He et al., 2014): mean predicted probability over the observed positive rate.

    Args:
      logits: `[N]` float, one task's logits (probability = sigmoid(logit)).
      labels: `[N]` in {0, 1}.

    Returns:
      A float64 ratio, 1 when calibrated, above 1 when the model over-predicts; NaN when
      there are no positives (no rate to divide by). Sums in float64.
    """
    rate = float(np.mean(labels, dtype=np.float64)) if len(labels) else 0.0
    if rate == 0.0:
        return float("nan")
    probabilities = special.expit(np.asarray(logits, np.float64))  # no overflow for large negative logits
    return float(np.mean(probabilities) / rate)


def auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties).

    Args:
      scores, labels: `[N]`; labels in {0, 1}.
      weights: optional `[N]`; examples with weight 0 are left out.

    Returns:
      AUC in [0, 1], or NaN when only one class is present.
    """
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
    if weights is not None:
        keep = np.asarray(weights) > 0
        scores, labels = scores[keep], labels[keep]
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg_rank = first + (counts + 1) / 2.0  # 1-based average rank of each tie group
    ranks[order] = np.repeat(avg_rank, counts)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class EvalAccumulator:
    """Collects eval predictions over batches and reports per-task AUC, NE, BCE and calibration."""

    def __init__(self, task_names: list[str]):
        self.task_names = task_names
        self.logits, self.labels, self.weights = [], [], []

    def add(self, logits, labels, weights) -> None:
        self.logits.append(np.asarray(logits))
        self.labels.append(np.asarray(labels))
        self.weights.append(np.asarray(weights))

    def result(self) -> dict[str, float | int | None]:
        """`eval_examples`, and per task `eval_positives_<task>`, `auc_<task>`, `ne_<task>` (pooled over
        the whole eval set), `bce_<task>` and `calibration_<task>`.

        AUC and NE of a task whose eval examples are all of one class are None (undefined:
        `one_class_note` says why); so is its calibration when none is positive.
        """
        logits = np.concatenate(self.logits)
        labels = np.concatenate(self.labels)
        weights = np.concatenate(self.weights)
        keep = weights > 0
        logits, labels = logits[keep], labels[keep]
        out: dict[str, float | int | None] = {"eval_examples": int(keep.sum())}
        bce = bce_per_example(logits, labels)
        for k, name in enumerate(self.task_names):
            positives = int((labels[:, k] > 0.5).sum())
            negatives = len(labels) - positives
            mean_bce = float(bce[:, k].mean()) if len(labels) else None
            out[f"eval_positives_{name}"] = positives
            out[f"auc_{name}"] = auc(logits[:, k], labels[:, k]) if positives and negatives else None
            out[f"ne_{name}"] = pooled_normalized_entropy(mean_bce, positives, negatives)  # None without examples too
            out[f"bce_{name}"] = mean_bce
            out[f"calibration_{name}"] = calibration(logits[:, k], labels[:, k]) if positives else None
        return out
