"""The planted source's known optimum on a split, beside the item-mean baseline, in the trainer's metrics.

`oracle_report(truth, rule)` splits the planted events as `gem-data convert
--split RULE` does (`gem_jax.data.ingest.split`: the same cutoff, the same
flags) and scores the eval events five ways, each measured with the trainer's
AUC and NE (`gem_jax.train.metrics`):

- oracle: the true logit (the best any model can do, up to label noise);
- item_mean: the item-popularity baseline the trainer reports
  (`gem_jax.data.pipeline.item_mean_labels` over the train events: each item's
  mean train label, the overall train rate for items unseen in train); its
  probabilities enter the log loss clipped to [1e-7, 1 - 1e-7], as
  `metrics.binary_entropy` clips, so that an item whose train labels are all
  equal does not make the NE infinite;
- no_history: the true logit with the history terms (`generator.HISTORY_TERMS`)
  replaced by their means over all events (a constant: the ranking is that of
  user + item effects, and the probabilities stay about calibrated);
- no_long_range: the same with the long-range term alone.

The lift shares are in AUC: `history_share = (oracle - no_history) / (oracle -
item_mean)`, the part of the oracle's lead over the baseline that needs the
history, and `long_range_share = (oracle - no_long_range) / (oracle -
no_history)`, the part of the history's lift that needs events >= 256 back.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gem_jax.data.examples import Examples
from gem_jax.data.ingest.split import EVAL, SplitRule, eval_flags, resolve_cutoff
from gem_jax.data.pipeline import item_mean_labels
from gem_jax.data.planted.files import Truth
from gem_jax.data.planted.generator import HISTORY_TERMS, LONG_RANGE_TERMS
from gem_jax.train.metrics import auc, bce_per_example, normalized_entropy

_CLIP = 1e-7  # as metrics.binary_entropy


@dataclasses.dataclass(frozen=True)
class Quality:
    """AUC and NE of one scoring of the eval events."""

    auc: float
    ne: float


@dataclasses.dataclass(frozen=True)
class OracleReport:
    """What `oracle_report` measured (module docstring).

    Attributes:
      split: the split rule, described; cutoff: its resolved cutoff time (None for `last:N`).
      events, train_events, eval_events: event counts.
      eval_positive_rate: mean eval label.
      min_train_item_count: the fewest train events of an item of the log (one with any event).
      eval_items_unseen: eval events whose item has no train event.
      oracle, item_mean, no_history, no_long_range: AUC and NE of each scoring.
      history_share, long_range_share: the lift shares (NaN when the denominator is 0).
    """

    split: str
    cutoff: int | None
    events: int
    train_events: int
    eval_events: int
    eval_positive_rate: float
    min_train_item_count: int
    eval_items_unseen: int
    oracle: Quality
    item_mean: Quality
    no_history: Quality
    no_long_range: Quality
    history_share: float
    long_range_share: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [
            f"split {self.split} (cutoff {self.cutoff}): {self.train_events} train / {self.eval_events} eval events, "
            f"eval positive rate {self.eval_positive_rate:.4f}, fewest train events of an item {self.min_train_item_count}"
        ]
        for name in ("oracle", "item_mean", "no_history", "no_long_range"):
            quality = getattr(self, name)
            lines.append(f"  {name:<14} AUC {quality.auc:.4f}  NE {quality.ne:.4f}")
        lines.append(f"  history share of the oracle's AUC lift over item_mean {self.history_share:.3f}; long-range share of the history's {self.long_range_share:.3f}")
        return "\n".join(lines)


def quality(logit: np.ndarray, labels: np.ndarray) -> Quality:
    """AUC and NE of the float logits `[N]` against the 0/1 labels `[N]`, in the trainer's metrics."""
    return Quality(auc=auc(logit, labels), ne=float(normalized_entropy(bce_per_example(logit, labels).mean(), labels.mean())))


def eval_mask(truth: Truth, rule: SplitRule) -> tuple[np.ndarray, int | None]:
    """`(is_eval, cutoff)`: bool `[N]`, True for the events `rule`'s split holds out (as `gem-data
    convert --split` flags them), and the rule's resolved cutoff time (None for `last:N`).

    Raises:
      ValueError: the split leaves no train or no eval events, or eval events of one label only.
    """
    n = truth.user.size
    cutoff = resolve_cutoff(rule, lambda: iter([truth.time]), n, int(truth.time.min()), int(truth.time.max()))
    is_eval = eval_flags(rule, cutoff, _user_starts(truth), truth.time) == EVAL
    held_out = int(is_eval.sum())
    if held_out == 0 or held_out == n:
        raise ValueError(f"split {rule.describe()}: {n - held_out} train and {held_out} eval events; both must be > 0")
    clicks = int(truth.click[is_eval].sum())
    if clicks in (0, held_out):  # AUC and NE need both labels among the eval events
        raise ValueError(
            f"split {rule.describe()}: all {held_out} eval event(s) are labelled {int(clicks > 0)}, so AUC and NE are undefined; "
            "choose a split that holds out more events"
        )
    return is_eval, cutoff


def _user_starts(truth: Truth) -> np.ndarray:
    """int64 `[U + 2]`: the first event of each user index (events are sorted by user), then the end."""
    return np.searchsorted(truth.user, np.arange(int(truth.user[-1]) + 2))


def _share(lift: float, total: float) -> float:
    return lift / total if total != 0 else float("nan")


def oracle_report(truth: Truth, rule: SplitRule) -> OracleReport:
    """Scores the eval events of `rule`'s split of the planted `truth` (module docstring).

    Args:
      truth: the planted events (`gem_jax.data.planted.files.read_truth`).
      rule: the split, as `gem-data convert --split` takes it.

    Raises:
      ValueError: the split leaves no train or no eval events, or eval events of one label only.
    """
    n = truth.user.size
    is_eval, cutoff = eval_mask(truth, rule)
    train = np.flatnonzero(~is_eval)
    position = np.arange(n) - _user_starts(truth)[truth.user]
    train_examples = Examples(target_event=train, history_length=position[train].astype(np.int32), candidate=truth.item[train], labels=truth.click[train, None])
    item_mean = item_mean_labels(train_examples, truth.num_items)[:, 0].astype(np.float64)

    train_counts = np.bincount(truth.item[train], minlength=truth.num_items)
    labels, item = truth.click[is_eval].astype(np.float64), truth.item[is_eval]
    logit = truth.logit

    def without(names: tuple[str, ...]) -> np.ndarray:
        return (logit - sum(truth.terms[name] - truth.terms[name].mean() for name in names))[is_eval]

    baseline_p = np.clip(item_mean[item], _CLIP, 1 - _CLIP)
    oracle = quality(logit[is_eval], labels)
    baseline = quality(np.log(baseline_p) - np.log1p(-baseline_p), labels)
    no_history = quality(without(HISTORY_TERMS), labels)
    no_long = quality(without(LONG_RANGE_TERMS), labels)
    return OracleReport(
        split=rule.describe(),
        cutoff=cutoff,
        events=n,
        train_events=int(train.size),
        eval_events=int(n - train.size),
        eval_positive_rate=float(labels.mean()),
        min_train_item_count=int(train_counts.min()),
        eval_items_unseen=int((train_counts[item] == 0).sum()),
        oracle=oracle,
        item_mean=baseline,
        no_history=no_history,
        no_long_range=no_long,
        history_share=_share(oracle.auc - no_history.auc, oracle.auc - baseline.auc),
        long_range_share=_share(oracle.auc - no_long.auc, oracle.auc - no_history.auc),
    )
