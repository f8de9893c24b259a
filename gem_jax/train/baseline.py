"""A simple baseline on the same split: score each eval example by its candidate item's mean train label.

Item popularity (here: the item's positive rate among train examples) is the usual
first baseline of recommendation papers; the model must beat its AUC.
"""

from __future__ import annotations

import numpy as np

from gem_jax.batch import Task
from gem_jax.data.pipeline import Dataset
from gem_jax.train.metrics import auc


def item_mean_label_auc(dataset: Dataset) -> dict[str, float]:
    """Eval AUC per task of the item-mean-label baseline, as `{"baseline_auc_<task>": value}`."""
    scores, labels, weights = [], [], []
    for batch in dataset.eval_batches():
        items = np.asarray(batch.candidate_item)
        scores.append(np.stack([dataset.item_mean_label(task)[items] for task in Task], axis=1))
        labels.append(np.asarray(batch.labels))
        weights.append(np.asarray(batch.weights))
    scores, labels, weights = np.concatenate(scores), np.concatenate(labels), np.concatenate(weights)
    return {f"baseline_auc_{name}": auc(scores[:, k], labels[:, k], weights) for k, name in enumerate(dataset.task_names)}
