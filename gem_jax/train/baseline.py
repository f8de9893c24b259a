"""A simple baseline on the same split: score each eval example by its candidate item's mean train label.

Item popularity (here: the item's positive rate among train examples) is the usual
first baseline of recommendation papers; the model must beat its AUC.
"""

from __future__ import annotations

import numpy as np

from gem_jax.data.pipeline import Dataset
from gem_jax.train.metrics import auc


def item_mean_label_auc(dataset: Dataset, candidate_item: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """Eval AUC per task of the item-mean-label baseline, as `{"baseline_auc_<task>": value}`.

    Args:
      dataset: gives each item's mean train label (`Dataset.item_mean_label`).
      candidate_item: int `[N]`, the eval examples' candidate items.
      labels: float32 `[N, K]`, K = `len(dataset.task_names)`.
      weights: float32 `[N]`; weight-0 (padding) examples are left out.

    A task whose eval examples are all of one class has None (AUC is undefined).
    """
    items = np.asarray(candidate_item)
    scores = np.stack([dataset.item_mean_label(k)[items] for k in range(len(dataset.task_names))], axis=1)
    values = {f"baseline_auc_{name}": auc(scores[:, k], labels[:, k], weights) for k, name in enumerate(dataset.task_names)}
    return {key: None if np.isnan(value) else value for key, value in values.items()}  # one class: undefined, as the model's AUC
