"""Switches that must not change what a run learns: the train losses of a few steps with each on and off.

- rematerialization (a planned budget, and every region saving nothing): the same float32
  program recomputed in the backward pass;
- the token-capacity step (`data.capacity_step`): the same examples placed in other padded
  shapes, so only float32 summation order over the padded rows may differ.

Base batch shuffling on two devices is checked in test_bbs_logging.py (it needs its own process).
"""

import dataclasses
import json

import numpy as np
import pytest

from gem_jax.model.remat import RematConfig
from gem_jax.train import capacity_plan
from gem_jax.train.config import load_config
from gem_jax.train.config_tree import apply_overrides
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.setup import setup_training
from tolerances import sum_worst

STEPS = ["loop.num_steps=4", "loop.log_every=1", "checkpoint.every_steps=100"]
REMAT_BUDGET_GB = 0.0025  # test_remat_plan.py's golden budget for configs/gem_h200_tiny.py: a plan mixing policies


def losses(config, workdir) -> list[float]:
    train_and_evaluate(config, workdir, progress=False)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def gem_tiny(repo_root):
    return apply_overrides(load_config(repo_root / "configs" / "gem_h200_tiny.py"), STEPS)


@pytest.fixture(scope="module")
def gem_tiny_losses(gem_tiny, tmp_path_factory):
    return losses(gem_tiny, tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("remat", [RematConfig(budget_gb=REMAT_BUDGET_GB), RematConfig(policies=(("*", "SAVE_NOTHING"),))], ids=["budget", "save_nothing"])
def test_rematerialization_leaves_the_losses_unchanged(gem_tiny, gem_tiny_losses, remat, tmp_path):
    config = dataclasses.replace(gem_tiny, model=dataclasses.replace(gem_tiny.model, remat=remat))
    got = losses(config, tmp_path)
    assert len(got) == 4
    # The forward pass is recomputed from the same inputs by the same float32 operations; XLA may fuse the
    # recomputation otherwise, so sums may run in another order: a few float32 roundings per sum, carried
    # through 4 updates (test_remat.py bounds one step's gradients at rtol 1e-5). Measured on the CPU: steps 1 and
    # 3 bit-identical, steps 2 and 4 one or two float32 ulps apart (relative 1.6e-7 at most).
    np.testing.assert_allclose(got, gem_tiny_losses, rtol=1e-5)


def test_the_capacity_step_leaves_the_losses_unchanged(repo_root, tmp_path):
    """ml-latest-small, 16 examples of up to 64 events: steps of 1.05 and 2.0 place the batches at other capacities."""
    base = apply_overrides(load_config(repo_root / "configs" / "movielens_tiny.py"), [*STEPS, "data.max_seq_len=64", "data.batch_size=16"])
    fine, coarse = (apply_overrides(base, [f"data.capacity_step={step}"]) for step in (1.05, 2.0))
    capacities = [capacity_plan.planned_capacities(setup_training(c, init_state=False)[0], range(4), False)[0] for c in (fine, coarse)]
    assert set(capacities[0]) != set(capacities[1])  # the switch does change the shapes
    got, want = losses(coarse, tmp_path / "coarse"), losses(fine, tmp_path / "fine")
    # The same examples and labels with more or fewer slack rows: masked rows add exact zeros, but the
    # attention's sums run over up to the largest capacity's keys in another order (test_programs.py's bound).
    # Measured on the CPU: bit-identical over the 4 steps.
    np.testing.assert_allclose(got, want, rtol=sum_worst(max(max(c) for c in capacities)))
