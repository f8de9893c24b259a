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


def _step(bce, examples, positives, negatives):
    """A train step's metrics as `TrainWindow` fetches them (float32, as the step returns them)."""
    return {"bce": np.float32(bce), "examples": np.float32(examples), "positives": np.float32(positives), "negatives": np.float32(negatives)}


def test_window_ne_is_the_windows_bce_over_its_pooled_base_rate():
    """A step whose batch has no positive (its clipped base rate's entropy ~1.7e-6) no longer blows the window's NE up:
    NE = the window's mean BCE over the entropy of the window's positives over its examples."""
    from gem_jax.train.window import pooled_task_metrics

    # task a: 0 positives of 4, then 2 of 4; task b: no positive in the window; task c: all positive
    window = [
        _step([0.5, 0.1, 0.2], 4, [0, 0, 4], [4, 4, 0]),
        _step([0.7, 0.2, 0.4], 4, [2, 0, 4], [2, 4, 0]),
    ]
    record = pooled_task_metrics(window, ["a", "b", "c"])
    rate = 2 / 8
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))  # 0.5623 nats
    assert record["bce_a"] == pytest.approx(0.6, rel=1e-7)
    assert record["ne_a"] == pytest.approx(0.6 / entropy, rel=1e-7)  # 1.0670; the mean of per-step NEs was ~1.5e5
    assert record["bce_b"] == pytest.approx(0.15, rel=1e-7) and record["ne_b"] is None
    assert record["bce_c"] == pytest.approx(0.3, rel=1e-7) and record["ne_c"] is None
    # steps weigh by their examples' weight (event weights, a part-real batch): (0.5 * 1 + 0.9 * 3) / 4
    uneven = pooled_task_metrics([_step([0.5], 1, [1], [0]), _step([0.9], 3, [0], [3])], ["a"])
    assert uneven["bce_a"] == pytest.approx(0.8, rel=1e-7)
    assert uneven["ne_a"] == pytest.approx(0.8 / -(0.25 * np.log(0.25) + 0.75 * np.log(0.75)), rel=1e-7)
    assert metrics.pooled_normalized_entropy(0.5, 0.0, 3.0) is None and metrics.pooled_normalized_entropy(0.5, 2.0, 0.0) is None


def test_an_eval_task_of_one_class_has_no_auc_or_ne_and_says_why():
    labels = np.array([[1, 0], [0, 0], [1, 0], [0, 0]], np.float32)
    logits = np.array([[2.0, -1.0], [-1.0, -2.0], [0.5, -3.0], [0.0, 0.0]], np.float32)
    acc = metrics.EvalAccumulator(["click", "buy"])
    acc.add(logits, labels, np.ones(4, np.float32))
    acc.add(np.zeros((2, 2), np.float32), np.ones((2, 2), np.float32), np.zeros(2, np.float32))  # padding: left out
    record = acc.result()
    bce = metrics.bce_per_example(logits, labels).mean(0)
    assert record["eval_examples"] == 4 and record["eval_positives_click"] == 2 and record["eval_positives_buy"] == 0
    assert record["auc_click"] == 1.0
    assert record["ne_click"] == pytest.approx(bce[0] / np.log(2), rel=1e-6)  # pooled over the eval set: rate 1/2
    assert record["bce_buy"] == pytest.approx(bce[1], rel=1e-6)
    assert record["auc_buy"] is None and record["ne_buy"] is None and record["calibration_buy"] is None  # not nan, not 1e5
    assert metrics.one_class_note(record, ["click", "buy"]) == (
        "eval: AUC and NE of task buy are undefined: all 4 eval examples are labelled 0 (no positives)"
    )
    everyone = metrics.EvalAccumulator(["like"])
    everyone.add(np.zeros((3, 1), np.float32), np.ones((3, 1), np.float32), np.ones(3, np.float32))
    liked = everyone.result()
    assert liked["auc_like"] is None and liked["ne_like"] is None and liked["calibration_like"] == pytest.approx(0.5)
    assert metrics.one_class_note(liked, ["like"]).endswith("all 3 eval examples are labelled 1 (no negatives)")
    assert metrics.one_class_note(record, ["click"]) is None
