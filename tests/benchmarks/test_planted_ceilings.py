"""benchmarks/planted_ceilings.py: the oracle, no-history and item-mean rows are `gem-data oracle`'s on the written
log, and the categories-only ceiling lies between the oracle and no history."""

import numpy as np

from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.planted import LONG_RANGE, generate, log_truth, read_truth, small, write_planted
from gem_jax.train.oracle import oracle_report

SPLIT = SplitRule.parse("time:0.9")


def test_the_ceilings_agree_with_the_report_of_the_written_log(load_benchmark, tmp_path, monkeypatch):
    ceilings = load_benchmark("planted_ceilings")
    monkeypatch.setattr(ceilings, "EFFECT_RATES", (0.1, 0.3))  # the online rows' rate grids, cut to what the small log picks from
    monkeypatch.setattr(ceilings, "WEIGHT_RATES", (1e-2, 3e-2))
    monkeypatch.setattr(ceilings, "VECTOR_EFFECT_RATES", (0.1,))  # and the learned-vector rows' grids
    monkeypatch.setattr(ceilings, "VECTOR_WEIGHT_RATES", (1e-2, 3e-2))
    config = small(LONG_RANGE)
    result = ceilings.ceilings(config, SPLIT, online_passes=(1.0, 8.0), vector_runs=[(form, None, 1.0, (0.1,)) for form in ("category_vectors", "item_vectors")])
    report = oracle_report(read_truth(write_planted(generate(config), tmp_path / "log").truth), SPLIT)
    assert result["eval_events"] == report.eval_events
    for name in ("oracle", "no_history", "item_mean"):
        assert (result["auc"][name], result["ne"][name]) == (getattr(report, name).auc, getattr(report, name).ne), name
    auc = result["auc"]
    assert auc["no_history"] < auc["categories_only"] < auc["oracle"]
    # learned from the train events, the planted form comes close to the ceiling with the true effects, and its weights to the true ones
    assert auc["no_history"] < auc["fitted"] < auc["categories_only"]
    fitted = result["fitted"]
    for name, weight in fitted["weights"].items():
        assert abs(weight / fitted["true_weights"][name] - 1) < 0.1, (name, weight)
    assert fitted["l2"] in ceilings.L2_GRID and set(fitted["validation_ne"]) == {str(v) for v in ceilings.L2_GRID}
    # with the items' own latent vectors in the recent signal, the fit passes the categories' ceiling, short of the oracle
    assert auc["fitted"] < auc["fitted_item_vectors"] < auc["oracle"] and auc["categories_only"] < auc["fitted_item_vectors"]
    assert result["fitted_item_vectors"]["l2"] in ceilings.L2_GRID
    # without user effects the form loses lift; the user's past click rate gives part of it back
    assert auc["no_history"] < auc["fitted_no_user"] < auc["fitted_past_outcomes"] < auc["fitted"]
    assert result["lift_share"]["oracle"] == 1.0 and result["lift_share"]["item_mean"] == 0.0
    # trained online, the form learns from the history in one pass and, after eight, comes within 0.01 AUC of the converged fit
    assert auc["no_history"] < auc["fitted_online_1.000"] < auc["fitted_online_8.000"] and abs(auc["fitted_online_8.000"] - auc["fitted"]) < 0.01
    online = result["online"]
    assert online["1.000"]["steps"] < online["8.000"]["steps"] and len(online["8.000"]["validation_ne"]) == 4
    assert all(row["rates"][0] in (0.1, 0.3) and row["rates"][1] in (1e-2, 3e-2) for row in online.values())
    # learning the vectors from ids in one pass, the form learns from the history but stays short of the fit given them
    for form in ("category_vectors", "item_vectors"):
        assert auc["no_history"] < auc[f"learned_{form}_16_1.000"] < auc["fitted_item_vectors"], form
        row = result["vectors"][f"{form}_16_1.000"]
        assert row["steps"] == online["1.000"]["steps"] and row["setting"][1] in (1e-2, 3e-2) and len(row["validation_ne"]) == 2
        assert set(row["weights"]) == {"bias", "recent", "mid", "long"}


def test_log_truth_is_the_written_truth_read_back(tmp_path):
    """The same users' event sequences (time, label, logit, terms, and which events share an item), numbered otherwise."""
    log = generate(small(LONG_RANGE))
    truths = [log_truth(log), read_truth(write_planted(log, tmp_path / "log").truth)]
    assert truths[0].num_items == truths[1].num_items

    def sequences(truth):
        events = list(zip(truth.time.tolist(), truth.logit.tolist()))
        name = {}  # each item's earliest (time, logit): a name that does not depend on the numbering
        for item, event in zip(truth.item.tolist(), events):
            name[item] = min(name.get(item, event), event)
        rows = zip(truth.user.tolist(), truth.time.tolist(), truth.click.tolist(), truth.logit.tolist(), truth.terms["recent"].tolist(),
                   (name[i] for i in truth.item.tolist()))
        by_user = {}
        for user, *event in rows:
            by_user.setdefault(user, []).append(tuple(event))
        return sorted(by_user.values())

    assert sequences(truths[0]) == sequences(truths[1])


def test_recent_items_are_the_events_before_in_the_users_sequence(load_benchmark):
    ceilings = load_benchmark("planted_ceilings")
    item, position = np.array([7, 8, 9, 4, 5]), np.array([0, 1, 2, 0, 1])  # two users: items 7, 8, 9 and 4, 5
    recent, mask = ceilings.recent_items(item, position, 2)
    np.testing.assert_array_equal(mask, [[0, 0], [1, 0], [1, 1], [0, 0], [1, 0]])
    np.testing.assert_array_equal(np.where(mask > 0, recent, -1), [[-1, -1], [7, -1], [8, 7], [-1, -1], [4, -1]])
    assert recent.dtype == np.int32 and mask.dtype == np.float32


def test_category_mean_vectors_average_each_category(load_benchmark):
    ceilings = load_benchmark("planted_ceilings")
    vectors = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    np.testing.assert_allclose(ceilings.category_mean_vectors(vectors, np.array([0, 0, 1])), [[0.5, 0.5], [0.5, 0.5], [1.0, 1.0]])


def test_the_logistic_fit_recovers_known_parameters(load_benchmark):
    ceilings = load_benchmark("planted_ceilings")
    rng = np.random.default_rng(0)
    n, users, items = 200_000, 5, 4
    user, item, signals = rng.integers(0, users, n), rng.integers(0, items, n), rng.normal(size=(n, 2))
    truth = np.concatenate([[-0.5, 1.5, -0.7], [0.3, -0.3, 0.2, 0.0, -0.2], [0.5, 0.0, -0.5, 0.25]])  # bias, weights, users, items
    labels = (rng.random(n) < 1 / (1 + np.exp(-ceilings.fitted_logit(truth, user, item, signals, users)))).astype(np.float64)
    params = ceilings.fit_logistic(user, item, signals, labels, users, items, l2=0.0)
    # Standard errors at p(1 - p) ~ 0.2: a weight's ~ 1 / sqrt(0.2 n) = 0.005, an effect's ~ 1 / sqrt(0.2 n / 5) = 0.011.
    # Effects are known up to a constant shared with the bias: compare their differences (SE ~ 0.016), at 4 SE.
    assert np.abs(params[1:3] - truth[1:3]).max() < 0.02
    for first, count in ((3, users), (3 + users, items)):
        fitted, planted = params[first:first + count], truth[first:first + count]
        assert np.abs((fitted - fitted[0]) - (planted - planted[0])).max() < 0.064
    # a penalty pulls the effects towards 0
    shrunk = ceilings.fit_logistic(user, item, signals, labels, users, items, l2=1.0)
    assert np.abs(shrunk[3:]).sum() < 0.2 * np.abs(params[3:]).sum()


def test_past_click_logit_by_hand(load_benchmark):
    ceilings = load_benchmark("planted_ceilings")
    click, offsets, user = np.array([1, 0, 1, 0, 0]), np.array([0, 3, 5]), np.array([0, 0, 0, 1, 1])
    rates = np.array([2.5 / 5, 3.5 / 6, 3.5 / 7, 2.5 / 5, 2.5 / 6])  # (clicks before + 5 x 0.5) / (events before + 5), per user
    np.testing.assert_allclose(ceilings.past_click_logit(click, offsets, user, 0.5), np.log(rates / (1 - rates)), atol=1e-12)
