"""Base batch shuffling in the train pipeline: permutation, balance, worker count, resume."""

import dataclasses
import json

import grain
import chex
import numpy as np
import pytest
from absl import flags

from gem_jax.data.bbs import balance_shards
from gem_jax.data.pipeline import BBSConfig, DataConfig, Source, SyntheticConfig, load_dataset
from gem_jax.model.flops import Workload
from gem_jax.data.balance import load_imbalance, shard_loads
from gem_jax.model.config import ModelConfig
from gem_jax.model.flops import train_workload

D = 8  # devices a global batch is split over
CONFIG = DataConfig(source=Source.ML_LATEST_SMALL, batch_size=256, max_seq_len=128, seed=3, bbs=BBSConfig())
DEMO_MODEL = ModelConfig(embed_dim=32, num_heads=2, num_seq_layers=2, num_pooled_queries=2, head_hidden=64)



def example_rows(batch):
    """`[n, k]` int64: one row per real example (user, candidate, labels, history length, item sum), sorted."""
    real = np.asarray(batch.weights) > 0
    offsets = np.asarray(batch.history.offsets)
    items = np.add.reduceat(np.r_[np.asarray(batch.history.values)[: offsets[-1], 0], 0], offsets[:-1])
    items = np.where(np.diff(offsets) > 0, items, 0)  # reduceat returns the next value for an empty range
    rows = np.column_stack(
        [batch.user["user"][:, 0], batch.candidate_item, batch.labels.astype(np.int64), np.diff(offsets), items]
    )[real].astype(np.int64)
    return rows[np.lexsort(rows.T[::-1])]


@pytest.fixture(scope="module")
def loaded():
    return load_dataset(CONFIG)


@pytest.fixture(scope="module")
def workload(loaded):
    return train_workload(DEMO_MODEL, loaded.spec)


@pytest.fixture(scope="module")
def bbs(loaded, workload):
    return loaded.resolve_bbs(num_shards=D, workload=workload)


@pytest.fixture(scope="module")
def plain(loaded):
    return dataclasses.replace(loaded, bbs=None)


def test_bbs_batches_are_permutations_of_the_plain_batches(bbs, plain, workload):
    steps = bbs.steps_per_epoch
    balanced, unbalanced = bbs.train_indices(), plain.train_indices()
    for i in (0, 1, steps - 2, steps, 2 * steps + 7):
        got, want = balanced[i], unbalanced[i]
        np.testing.assert_array_equal(np.sort(got), np.sort(want))
        assert not np.array_equal(got, want)
        lengths = bbs.train_lengths(want)
        np.testing.assert_array_equal(got, want[balance_shards(workload(lengths), D, seed=(CONFIG.seed, i))])
    np.testing.assert_array_equal(balanced[steps - 1], unbalanced[steps - 1])  # the short last batch keeps its order
    one_epoch = np.concatenate(list(bbs.train_indices(num_epochs=1)))
    np.testing.assert_array_equal(np.sort(one_epoch), np.arange(bbs.info.num_train_examples))
    # Through the real iterator: the same examples as the plain batch, in another order.
    it_bbs, it_plain = bbs.train_iterator(), plain.train_iterator()
    for _ in range(3):
        a, b = next(it_bbs), next(it_plain)
        np.testing.assert_array_equal(example_rows(a), example_rows(b))
        assert not np.array_equal(a.candidate_item, b.candidate_item)
        assert a.history.capacity == b.history.capacity


def test_lengths_are_what_the_batch_builder_packs(bbs):
    indices = bbs.train_indices()[4]
    batch = bbs.train_batch(indices)
    np.testing.assert_array_equal(np.diff(batch.history.offsets), bbs.train_lengths(indices))
    synthetic = load_dataset(
        DataConfig(
            source=Source.SYNTHETIC,
            batch_size=32,
            max_seq_len=64,
            synthetic=SyntheticConfig(num_items=100, num_users=20, num_train_examples=200, num_eval_examples=10),
            bbs=BBSConfig(num_shards=4, minibatch_size=8),
        )
    ).resolve_bbs(num_shards=4, workload=Workload(per_token=10.0, per_token_pair=1.0))
    indices = synthetic.train_indices()[2]
    batch = synthetic.train_batch(indices)
    lengths = synthetic.train_lengths(indices)
    np.testing.assert_array_equal(np.diff(batch.history.offsets), lengths)
    loads = shard_loads(Workload(per_token=10.0, per_token_pair=1.0)(lengths), 4)
    assert load_imbalance(loads) < load_imbalance(shard_loads(Workload(10.0, 1.0)(np.sort(lengths)), 4))


def test_per_device_imbalance_is_lower_with_bbs(bbs, plain, workload):
    def imbalance(dataset):
        it = dataset.train_iterator()
        out = []
        for _ in range(30):
            batch = next(it)
            lengths = np.diff(batch.history.offsets)
            out.append(load_imbalance(shard_loads(workload(lengths) * (batch.weights > 0), D)))
        return np.array(out)

    with_bbs, without = imbalance(bbs), imbalance(plain)
    assert with_bbs.mean() < 0.002 and without.mean() > 0.05
    assert with_bbs.max() < without.min()


def _parse_absl_flags():
    """mp_prefetch reads grain's absl flags; a training entry point parses them, pytest does not."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def test_same_stream_for_any_worker_count(bbs):
    _parse_absl_flags()
    n = 6
    it = bbs.train_iterator()  # one prefetch thread in this process
    reference = [next(it) for _ in range(n)]
    for workers in (2,):
        options = grain.MultiprocessingOptions(num_workers=workers)
        ds = bbs.train_dataset().to_iter_dataset(grain.ReadOptions(num_threads=0)).mp_prefetch(options)
        it = iter(ds)
        for want in reference:
            chex.assert_trees_all_equal(next(it), want)
        it.close()


@pytest.mark.parametrize("start", [5, "epoch_end"])
def test_resume_mid_epoch_gives_the_same_stream(bbs, workload, start):
    it = bbs.train_iterator()
    if start == "epoch_end":
        it.set_state({"next_index": bbs.steps_per_epoch - 2})  # through the short batch into epoch 1
    else:
        for _ in range(start):
            next(it)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    expected = [next(it) for _ in range(4)]
    resumed = load_dataset(CONFIG).resolve_bbs(num_shards=D, workload=workload).train_iterator()
    resumed.set_state(state)
    for want in expected:
        chex.assert_trees_all_equal(next(resumed), want)


def test_unresolved_or_mismatched_settings_are_named(loaded, workload):
    with pytest.raises(ValueError, match=r"DataConfig.bbs.num_shards is None: call Dataset.resolve_bbs"):
        loaded.train_indices()
    explicit = dataclasses.replace(loaded, bbs=BBSConfig(num_shards=4))
    with pytest.raises(ValueError, match="DataConfig.bbs.num_shards is 4 but batches are split over 8 devices"):
        explicit.resolve_bbs(num_shards=8, workload=workload)
    with pytest.raises(ValueError, match="DataConfig.bbs.workload is None"):
        explicit.train_indices()
    with pytest.raises(ValueError, match="DataConfig.bbs: a batch of 256 samples does not split into 3 equal shards"):
        loaded.resolve_bbs(num_shards=3, workload=workload)
    with pytest.raises(ValueError, match="DataConfig.bbs: the shard size 256 / 256 = 1 is odd"):
        DataConfig(batch_size=256, bbs=BBSConfig(num_shards=256))
    with pytest.raises(ValueError, match="minibatch_size must be a positive even int"):
        BBSConfig(minibatch_size=3)
    with pytest.raises(ValueError, match="num_shards must be a positive int or None"):
        BBSConfig(num_shards=0)
    with pytest.raises(TypeError, match="BBSConfig.workload must be a callable"):
        BBSConfig(workload="flops")
    own = Workload(per_token=1.0, per_token_pair=0.0)
    kept = dataclasses.replace(loaded, bbs=BBSConfig(workload=own)).resolve_bbs(num_shards=8, workload=workload)
    assert kept.bbs == BBSConfig(num_shards=8, workload=own)
    single = loaded.resolve_bbs(num_shards=1, workload=workload)
    np.testing.assert_array_equal(single.train_indices()[3], dataclasses.replace(loaded, bbs=None).train_indices()[3])
    assert dataclasses.replace(loaded, bbs=None).resolve_bbs(num_shards=8, workload=workload).bbs is None
