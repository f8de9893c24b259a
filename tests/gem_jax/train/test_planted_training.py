"""A tiny model trained on a planted log beats the item-mean baseline, below the oracle; the planted
configs for the GPU (configs/planted_gem.py, configs/planted_small.py) reuse their models.

The log is the long-range preset shrunk to 300 users, 40 items in 8 categories (about 45k
events): few items, so that 400 steps of 128 examples (about 1.1 epochs) see each item about
1,300 times and the tiny model can learn the item effects and the item-to-history similarity
the planted logit rewards. It is converted by `gem-data convert` and trained with
configs/events_tiny.py (the recipe below), whose eval runs on every eval event of the
`time:0.9` split; the oracle report (`gem_jax.train.oracle`) scores the same events.
"""

import dataclasses

import pytest

from gem_jax.data.ingest.convert import ConvertOptions, convert
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.planted import LONG_RANGE, event_schema, generate, read_truth, write_planted
from gem_jax.train.config import load_config
from gem_jax.train.config_tree import apply_overrides
from gem_jax.train.loop import train_and_evaluate
from gem_jax.train.oracle import oracle_report

SPLIT = SplitRule.parse("time:0.9")
PLANTED = dataclasses.replace(LONG_RANGE, num_users=300, num_items=40, num_categories=8)
RECIPE = [
    "loop.num_steps=400", "loop.log_every=100", "data.batch_size=128", "data.capacity_step=2.0",
    "optim.learning_rate=1e-2", "optim.warmup_steps=10", "optim.decay_steps=400", "optim.embedding_learning_rate=0.1",
]
# Measured on the CPU (2 cores, loaded): model AUC 0.6511, item-mean 0.6304, oracle 0.7804.
# The run is deterministic (fixed seeds, one CPU device); the margin leaves room for another
# XLA version or CPU reordering float sums, which moves the AUC by far less than 0.01.
MARGIN = 0.01


@pytest.fixture(scope="module")
def run(repo_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    files = write_planted(generate(PLANTED), root / "log")
    # Without the action column, as the measurement above was made: at this size (d = 8, 40 items, no history item
    # features) history outcomes moved the AUC by -0.012 to +0.021 over three seeds (benchmarks/quality.md).
    convert([files.events], root / "converted", event_schema(files, actions=False), ConvertOptions(split=SPLIT), log=lambda line: None)
    report = oracle_report(read_truth(files.truth), SPLIT)
    config = apply_overrides(load_config(repo_root / "configs" / "events_tiny.py"), [f"data.path={root / 'converted'}", *RECIPE])
    return report, train_and_evaluate(config, root / "run", progress=False)


def test_the_trainers_baseline_is_the_oracle_reports(run):
    report, summary = run
    assert summary["eval_examples"] == report.eval_events
    assert summary["baseline_auc_click"] == pytest.approx(report.item_mean.auc, abs=1e-6)
    assert report.item_mean.auc < report.oracle.auc - 0.1


def test_a_tiny_model_beats_the_item_mean_baseline_below_the_oracle(run):
    report, summary = run
    assert summary["step"] == 400
    assert report.item_mean.auc + MARGIN < summary["auc_click"] < report.oracle.auc
    assert report.oracle.ne < summary["ne_click"] < 1.0  # measured 0.9523 (item-mean 0.9581)


def test_the_planted_configs_share_their_data_and_reuse_their_models(repo_root):
    """configs/planted_gem.py is gem_h200's model (keys initialised as the queries); configs/planted_small.py the demo's, on the same data and schedule."""
    gem, small = (load_config(repo_root / "configs" / f"planted_{name}.py") for name in ("gem", "small"))
    assert gem.model == dataclasses.replace(load_config(repo_root / "configs" / "gem_h200.py").model, tied_qk_init=True)
    assert small.model == load_config(repo_root / "configs" / "events.py").model
    assert gem.data == small.data and gem.loop == small.loop
    assert gem.data.max_seq_len >= PLANTED.long_window[1]  # the long-range signal is within reach
    for config in (gem, small):
        assert config.optim.warmup_steps + config.optim.decay_steps == config.loop.num_steps
