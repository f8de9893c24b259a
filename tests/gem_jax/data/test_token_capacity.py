"""Token capacities on real batches: slack within 5% of the placed rows, few distinct shapes, every batch fits.

The batches come from the builders and are placed with `stack_batch` on the host (no model):
GEM-like synthetic histories (configs/gem_sharded.py's data at 1024 examples per device) and
ml-latest-small (configs/movielens.py).
"""

import dataclasses

import numpy as np

from gem_jax.data.config import DataConfig, Source, SyntheticConfig
from gem_jax.data.pipeline import describe_capacities, load_dataset
from gem_jax.jagged import TokenBuckets
from gem_jax.parallel.placement import stack_batch
from gem_jax.train.config import load_config


def placed_slack(dataset, batches, num_shards=1):
    """(slack fractions, capacities) of `batches` placed over `num_shards` devices."""
    slack, capacities = [], []
    for batch in batches:
        placed = stack_batch(batch, num_shards, dataset.token_buckets)
        rows = placed.history.values.shape[0] * placed.history.values.shape[1]
        slack.append(1.0 - int(batch.history.offsets[-1]) / rows)
        capacities.append(placed.history.values.shape[1])
    return np.array(slack), capacities


def test_gem_like_synthetic_batches_have_under_5_percent_slack(repo_root):
    data = dataclasses.replace(load_config(repo_root / "configs" / "gem_sharded.py").data, batch_size=1024)
    dataset = load_dataset(data)
    b = data.batch_size
    batches = [dataset.train_batch(range(i * b, (i + 1) * b)) for i in range(40)]  # synthetic examples are i.i.d.
    slack, capacities = placed_slack(dataset, batches)
    assert slack.max() <= 0.05 and slack.mean() < 0.03, slack
    assert len(set(capacities)) <= 8, sorted(set(capacities))
    # With the old buckets (fractions of B x max_seq_len) these batches took 262,144 rows: ~37% slack.
    assert max(capacities) < 0.2 * b * data.max_seq_len


def test_ml_latest_small_batches_have_under_5_percent_slack(repo_root):
    dataset = load_dataset(load_config(repo_root / "configs" / "movielens.py").data)
    full = dataset.steps_per_epoch - 1  # the last batch of an epoch is short
    batches = [dataset.train_dataset()[i] for i in range(min(200, full))]
    slack, capacities = placed_slack(dataset, batches)
    assert slack.max() <= 0.05 and slack.mean() < 0.03, slack
    assert len(set(capacities)) <= 8, sorted(set(capacities))
    eval_slack, _ = placed_slack(dataset, dataset.eval_batches())
    assert np.all(eval_slack < 0.5), eval_slack  # eval histories are longer than train ones: coarser, but they fit


def test_every_batch_fits_and_short_batches_take_small_capacities():
    # Buckets from a short-history data set; a batch of max_seq_len histories takes the last, full capacity.
    short = load_dataset(DataConfig(source=Source.SYNTHETIC, max_seq_len=64, batch_size=16, prefetch_batches=0))
    full = load_dataset(
        DataConfig(
            source=Source.SYNTHETIC,
            max_seq_len=64,
            batch_size=16,
            prefetch_batches=0,
            synthetic=SyntheticConfig(median_length_fraction=1.0, length_sigma=0.0),
        )
    )
    batch = full.train_batch(range(16))
    assert int(batch.history.offsets[-1]) == 16 * 64
    placed = stack_batch(batch, 2, short.token_buckets)
    assert placed.history.values.shape[:2] == (2, 8 * 64)
    np.testing.assert_array_equal(placed.history.offsets[:, -1], [8 * 64, 8 * 64])
    one = stack_batch(short.train_batch([3]), 1, short.token_buckets)  # a short last batch of an epoch
    assert one.history.values.shape[1] == 128


def test_the_capacities_batches_take_are_the_fine_ones_the_start_up_line_names(repo_root):
    data = dataclasses.replace(load_config(repo_root / "configs" / "gem_sharded.py").data, batch_size=512, capacity_step=1.25)
    dataset = load_dataset(data)
    batches = [dataset.train_batch(range(i * 512, (i + 1) * 512)) for i in range(20)]
    _, capacities = placed_slack(dataset, batches)
    fine = dataset.token_buckets.fine_capacities(512)
    assert set(capacities) <= set(fine) and len(fine) == 3, (sorted(set(capacities)), fine)
    line = describe_capacities(dataset.token_buckets, 512)
    expected = 512 * dataset.token_buckets.mean_length
    assert line.startswith(f"3 token capacities of {fine[0]:,} to {fine[-1]:,} rows per device hold a batch within 4 standard deviations of its expected {expected:,.0f} rows")
    assert "DataConfig.capacity_step=1.25" in line
    assert describe_capacities(TokenBuckets(2.0, 1.0, 16), 8).startswith("1 token capacity of 128 rows per device hold a batch")
