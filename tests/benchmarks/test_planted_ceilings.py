"""benchmarks/planted_ceilings.py: the oracle, no-history and item-mean ceilings are the oracle report's, and the
categories-only ceiling lies between the oracle and no history."""

import numpy as np
import pytest

from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.planted import LONG_RANGE, generate, read_truth, small, write_planted
from gem_jax.train.oracle import oracle_report


def test_the_ceilings_agree_with_the_oracle_report(load_benchmark, tmp_path):
    ceilings = load_benchmark("planted_ceilings")
    config = small(LONG_RANGE)
    result = ceilings.ceilings(config, 0.9)
    report = oracle_report(read_truth(write_planted(generate(config), tmp_path / "log").truth), SplitRule.parse("time:0.9"))
    assert result["eval_events"] == report.eval_events
    auc = result["auc"]
    for name, reported in (("oracle", report.oracle), ("no_history", report.no_history), ("item_mean", report.item_mean)):
        assert auc[name] == pytest.approx(reported.auc, abs=1e-6), name  # up to the rounding of the history terms' means
    assert auc["no_history"] < auc["categories_only"] < auc["oracle"]
    assert result["lift_share"]["oracle"] == 1.0 and result["lift_share"]["item_mean"] == 0.0


def test_category_mean_vectors_average_each_category(load_benchmark):
    ceilings = load_benchmark("planted_ceilings")
    vectors = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    np.testing.assert_allclose(ceilings.category_mean_vectors(vectors, np.array([0, 0, 1])), [[0.5, 0.5], [0.5, 0.5], [1.0, 1.0]])
