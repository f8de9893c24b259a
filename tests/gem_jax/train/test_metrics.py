import numpy as np
import jax.numpy as jnp
import pytest

from gem_jax.train import metrics


def brute_force_auc(scores, labels):
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng()
    scores = rng.integers(0, 20, 300).astype(float)  # many ties
    labels = (rng.random(300) < 0.3).astype(int)
    assert metrics.auc(scores, labels) == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


def test_auc_ignores_zero_weight_examples_and_single_class_is_nan():
    scores = np.array([0.1, 0.9, 0.5, 100.0])
    labels = np.array([0, 1, 0, 0])
    assert metrics.auc(scores, labels, weights=np.array([1, 1, 1, 0])) == 1.0
    assert np.isnan(metrics.auc(scores, np.zeros(4)))


def test_weighted_bce_and_ne_of_base_rate_predictor_is_one():
    rng = np.random.default_rng()
    labels = (rng.random((512, 2)) < np.array([0.3, 0.1])).astype(np.float32)
    p = labels.mean(0)
    logits = np.broadcast_to(np.log(p / (1 - p)), labels.shape).astype(np.float32)
    weights = np.ones(512, np.float32)
    bce = metrics.weighted_bce(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(weights))
    np.testing.assert_allclose(metrics.normalized_entropy(np.asarray(bce), p), [1.0, 1.0], rtol=1e-5)  # float32 BCE, 512-term sums


def test_weighted_bce_ignores_padding_examples():
    logits = jnp.array([[2.0], [np.nan]])
    labels = jnp.array([[1.0], [0.0]])
    bce = metrics.weighted_bce(jnp.where(jnp.isnan(logits), 0.0, logits), labels, jnp.array([1.0, 0.0]))
    np.testing.assert_allclose(bce, [np.log1p(np.exp(-2.0))], rtol=1e-6)  # one float32 log1p(exp): a few u


def test_calibration_is_mean_prediction_over_the_observed_rate_in_the_eval_record():
    rng = np.random.default_rng()
    labels = (rng.random((400, 1)) < 0.25).astype(np.float32)
    logits = rng.normal(size=(400, 1)).astype(np.float32)
    acc = metrics.EvalAccumulator(["click"])
    acc.add(logits[:250], labels[:250], np.ones(250, np.float32))
    acc.add(np.full((3, 1), 50.0, np.float32), np.zeros((3, 1), np.float32), np.zeros(3, np.float32))  # padding: left out
    acc.add(logits[250:], labels[250:], np.ones(150, np.float32))
    want = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).mean() / labels.astype(np.float64).mean()
    assert acc.result()["calibration_click"] == pytest.approx(want, rel=1e-12)  # float64 sums of 400 terms
    base = labels.astype(np.float64).mean()
    assert metrics.calibration(np.full(400, np.log(base / (1 - base))), labels[:, 0]) == pytest.approx(1.0, rel=1e-12)
    assert metrics.calibration(np.array([-1000.0, 1000.0]), np.array([0.0, 1.0])) == 1.0  # no overflow: mean(0, 1) / 0.5
    assert np.isnan(metrics.calibration(logits[:, 0], np.zeros(400)))
