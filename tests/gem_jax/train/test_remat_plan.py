"""The rematerialization planner on configs/gem_h200_tiny.py (traced on the CPU) and on hand-made costs."""

import dataclasses
import math

import jax
import pytest

from gem_jax.model.remat import RematConfig, RematPolicy
from gem_jax.pytree import path_str
from gem_jax.train import remat_plan
from gem_jax.train.config import load_config
from gem_jax.train.remat_plan import RegionCost, RematBudgetError, choose_policies, plan_remat, recompute_peak_bytes
from gem_jax.train.setup import setup_training

ALL, DOTS, NAMED, NOTHING = RematPolicy.SAVE_ALL, RematPolicy.SAVE_DOTS, RematPolicy.SAVE_NAMED, RematPolicy.SAVE_NOTHING

# configs/gem_h200_tiny.py at budget_gb = 0.0025 (2.5 MB; the state takes 1.82 MB, the activations
# without rematerialization 1.42 MB).
GOLDEN_BUDGET_GB = 0.0025
GOLDEN_PLAN = {
    "history_context": ALL,  # saved whole since the row-wise accumulators left it room
    "seq0/attention": DOTS,
    "seq0/mlp": DOTS,
    "seq1/attention": DOTS,
    "seq1/mlp": DOTS,
    "pooled_attention": DOTS,
    "feature_to_history": ALL,
    "token_attention": ALL,
    "dhen0": DOTS,
    "heads": DOTS,
}


def region(name, points):
    """A `RegionCost` from `{policy: (saved bytes, recompute seconds)}`."""
    return RegionCost(name, {p: b for p, (b, _) in points.items()}, {p: 0.0 for p in points}, {p: t for p, (_, t) in points.items()})


A = region("a", {ALL: (100, 0.0), DOTS: (40, 1.0), NAMED: (40, 2.0), NOTHING: (10, 5.0)})
B = region("b", {ALL: (50, 0.0), DOTS: (30, 4.0), NAMED: (20, 4.5), NOTHING: (20, 6.0)})


def test_pareto_front_drops_dominated_policies_and_keeps_the_later_of_equals():
    assert A.front() == [ALL, DOTS, NOTHING]  # NAMED: as many bytes as DOTS, slower
    assert B.front() == [ALL, DOTS, NAMED]  # NOTHING: as many bytes as NAMED, slower
    tie = region("t", {ALL: (9, 0.0), DOTS: (5, 1.0), NAMED: (2, 3.0), NOTHING: (2, 3.0)})
    assert tie.front() == [ALL, DOTS, NOTHING]


def test_recompute_peak_counts_only_the_regions_saved_before_the_recomputing_one():
    # Backward: b (last) first; while a recomputes (100 - 40 = 60 bytes), b's 50 are released.
    assert recompute_peak_bytes([A, B], {"a": DOTS, "b": ALL}) == 10
    assert recompute_peak_bytes([A, B], {"a": ALL, "b": NAMED}) == 30
    assert recompute_peak_bytes([A, B], {"a": ALL, "b": ALL}) == 0


def test_greedy_takes_the_least_recompute_time_per_byte_first():
    # From 150 bytes, a -> DOTS frees 60 bytes for 1 s (the best ratio): 40 + 50 + (60 - 50) recomputed = 100.
    assert choose_policies([A, B], fixed_bytes=0, budget_bytes=130) == {"a": DOTS, "b": ALL}
    assert choose_policies([A, B], fixed_bytes=0, budget_bytes=100) == {"a": DOTS, "b": ALL}
    # Below 100 the walk goes on, a -> NOTHING (4 s / 30 bytes) then b -> NAMED (4.5 s / 30 bytes),
    # and ends at 10 + 20 + (90 - 20) = 100: no plan.
    assert choose_policies([A, B], fixed_bytes=0, budget_bytes=99) is None
    assert choose_policies([A, B], fixed_bytes=1000, budget_bytes=2000) == {"a": ALL, "b": ALL}
    assert choose_policies([A, B], fixed_bytes=0, budget_bytes=99, start={"a": NOTHING, "b": NAMED}) is None


@pytest.fixture(scope="module")
def tiny(repo_root):
    config = load_config(repo_root / "configs" / "gem_h200_tiny.py")
    training, _ = setup_training(config, init_state=False)
    batch, lengths = remat_plan.planning_batch(training.dataset, training.placement)
    costs = remat_plan.measure_step(config.model, training.dataset.spec, training.state, batch, lengths)
    return config, training, costs


def test_planning_capacity_never_passes_the_largest_bucket(repo_root):
    # movielens_tiny: mean + 4 sigma of a device's rows is more than B x max_seq_len
    config = load_config(repo_root / "configs" / "movielens_tiny.py")
    training, _ = setup_training(config, init_state=False)
    batch, _ = remat_plan.planning_batch(training.dataset, training.placement)
    per = training.dataset.batch_size // training.placement.num_shards
    assert batch.history.values.shape[1] <= training.dataset.token_buckets.capacities(per)[-1]


def test_measured_costs_of_the_tiny_step(tiny):
    config, training, costs = tiny
    d, m = config.model.embed_dim, config.model.mlp_ratio * config.model.embed_dim
    assert costs.tokens == 128 and [r.name for r in costs.regions] == list(config.model.region_names)
    mlp = {r.name: r for r in costs.regions}["seq0/mlp"]
    # SAVE_NOTHING keeps the region's float32 input; its backward reruns the up projection
    # (the down projection's output is not needed).
    assert mlp.saved_bytes[NOTHING] == costs.tokens * d * 4
    assert mlp.recompute_flops[NOTHING] == 2 * costs.tokens * d * m
    assert mlp.recompute_flops[DOTS] == 0
    for r in costs.regions:
        assert r.saved_bytes[ALL] >= r.saved_bytes[DOTS] >= r.saved_bytes[NOTHING] > 0 and r.recompute_s[ALL] == 0, r
    # One device: the state, and a gradient for every parameter but the embedding tables (updated row by row).
    nbytes = lambda x: math.prod(x.shape) * x.dtype.itemsize  # noqa: E731
    grads = sum(nbytes(x) for path, x in jax.tree_util.tree_leaves_with_path(training.state.abstract.params) if path_str(path).split("/")[-1] != "embedding")
    assert costs.state_bytes == sum(map(nbytes, jax.tree.leaves(training.state.abstract))) + grads


def test_golden_plan_fits_its_budget(tiny):
    config, _, costs = tiny
    plan = plan_remat(costs, RematConfig(budget_gb=GOLDEN_BUDGET_GB))
    assert plan.policies == GOLDEN_PLAN
    assert plan.peak_bytes <= GOLDEN_BUDGET_GB * 1e9 < costs.state_bytes + costs.activation_bytes_saved
    assert plan.activation_bytes == costs.activation_bytes(plan.remat_config)
    assert plan.peak_bytes == plan.state_bytes + plan.activation_bytes + recompute_peak_bytes(costs.regions, plan.policies)
    rows = plan.to_json()["regions"]
    assert [r["region"] for r in rows] == list(config.model.region_names) and rows[1]["policy"] == "SAVE_DOTS"
    assert "seq0/attention       SAVE_DOTS" in plan.table() and "budget 2.5 MB" in plan.table()


@pytest.mark.parametrize("budget_gb", [1.0, 0.003])
def test_plans_respect_their_budget(tiny, budget_gb):
    _, _, costs = tiny
    plan = plan_remat(costs, RematConfig(budget_gb=budget_gb))
    assert plan.peak_bytes <= budget_gb * 1e9
    if budget_gb == 1.0:
        assert set(plan.policies.values()) == {ALL} and plan.activation_bytes == costs.activation_bytes_saved


def test_a_budget_below_the_smallest_names_the_smallest_which_then_fits(tiny):
    _, _, costs = tiny
    with pytest.raises(RematBudgetError, match=r"budget_gb = 0.001 GB does not fit.*the smallest budget is budget_gb = ([\d.]+)") as error:
        plan_remat(costs, RematConfig(budget_gb=0.001))
    smallest = float(error.value.args[0].rsplit("= ", 1)[1])
    assert "measured with this process's kernels, self-attention (full): xla" in error.value.args[0]
    assert 0.001 < smallest < GOLDEN_BUDGET_GB
    assert plan_remat(costs, RematConfig(budget_gb=smallest)).peak_bytes <= smallest * 1e9


def test_explicit_policies_are_reported_as_given(tiny):
    _, _, costs = tiny
    plan = plan_remat(costs, RematConfig(policies=(("*", "SAVE_NAMED"), ("heads", "SAVE_ALL"))))
    assert plan.budget_bytes is None and plan.policies["heads"] is ALL and plan.policies["seq1/mlp"] is NAMED
    assert plan.activation_bytes < costs.activation_bytes_saved


def test_setup_training_plans_and_the_step_runs_the_plan(repo_root):
    config = load_config(repo_root / "configs" / "gem_h200_tiny.py")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, remat=RematConfig(budget_gb=GOLDEN_BUDGET_GB)))
    training, _ = setup_training(config, init_state=False)
    assert training.remat_plan.policies == GOLDEN_PLAN
    batch = training.placement.put(training.dataset.train_batch(range(config.data.batch_size)))
    jaxpr = str(jax.make_jaxpr(training.train_step)(training.state.abstract, batch))
    assert "checkpoint[" in jaxpr or "remat" in jaxpr
    assert remat_plan.record(training.remat_plan)["budget_bytes"] == int(GOLDEN_BUDGET_GB * 1e9)
