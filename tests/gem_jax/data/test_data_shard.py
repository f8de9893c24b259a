"""Per-process input: each process's local batches are exactly its chunks of the global batches, and together
the processes build every example once; the local batches place like the global ones. The synthetic source and
a converted own event log (`Source.EVENTS`) of the same example counts."""

import dataclasses
import pickle

import chex
import jax
import numpy as np
import pytest

from event_logs import convert_event_log, write_event_log
from gem_jax.batch import BatchShard, LocalBatch
from gem_jax.data.pipeline import BBSConfig, DataConfig, Source, SyntheticConfig, load_dataset
from gem_jax.data.ingest.shards import RecordReader
from gem_jax.data.ingest.split import EVAL, TRAIN
from gem_jax.data.shard import LocalBatchBuilder
from gem_jax.data.sources.converted import ConvertedBatchBuilder
from gem_jax.mesh import Topology, make_mesh
from gem_jax.parallel.placement import BatchPlacement, stack_batch

D, B = 4, 32
CONFIG = DataConfig(
    source=Source.SYNTHETIC,
    batch_size=B,
    max_seq_len=16,
    prefetch_batches=0,
    synthetic=SyntheticConfig(num_items=200, num_users=40, num_genres=3, num_train_examples=70, num_eval_examples=52),
    bbs=BBSConfig(minibatch_size=8),
)
SHARDS = {"halves": [(0, 1), (2, 3)], "interleaved": [(0, 2), (1, 3)]}


class Recorder:
    """Wraps a batch builder and records the example indices of every call."""

    def __init__(self, build):
        self.build, self.calls = build, []

    def __call__(self, indices, batch_size=None):
        self.calls.append(np.asarray(indices, np.int64).copy())
        return self.build(indices, batch_size=batch_size)


@pytest.fixture(scope="module", params=["synthetic", "events"])
def dataset(request, tmp_path_factory):
    """The synthetic source, or an own event log of 70 train and 52 eval events converted into 3 shard files."""
    config = CONFIG
    if request.param == "events":
        root = tmp_path_factory.mktemp("events")
        write_event_log(root / "events", num_train=70, num_eval=52)
        config = dataclasses.replace(CONFIG, source=Source.EVENTS, path=str(convert_event_log(root / "events", root / "converted").out))
    dataset = load_dataset(config).resolve_bbs(num_shards=D, workload=lambda lengths: (1.0 + lengths) ** 2)
    assert (dataset.info.num_train_examples, dataset.info.num_eval_examples) == (70, 52)
    return dataset


def recording(dataset):
    return dataclasses.replace(dataset, train_batch=Recorder(dataset.train_batch), eval_batch=Recorder(dataset.eval_batch))



def assert_local_is_global_chunks(local: LocalBatch, global_batch, buckets):
    """The local batch is the global batch's chunks `local.shard.chunks`, at the global batch's token capacity."""
    np.testing.assert_array_equal(local.lengths, np.diff(np.asarray(global_batch.history.offsets)))
    assert local.num_real == int(np.count_nonzero(global_batch.weights))  # the log's weights are all > 0
    np.testing.assert_array_equal(local.real, np.asarray(global_batch.weights) > 0)
    whole = stack_batch(global_batch, D, buckets)
    part = stack_batch(local.batch, len(local.shard.chunks), buckets, fullest_rows=int(local.chunk_rows().max()))
    chunks = np.asarray(local.shard.chunks)
    chex.assert_trees_all_equal(part, jax.tree.map(lambda x: x[chunks], whole))


@pytest.mark.parametrize("layout", SHARDS)
def test_processes_build_disjoint_shares_of_the_global_batches(dataset, layout):
    """Two processes' shards over one epoch (70 = 32 + 32 + 6 examples, eval 52 = 32 + 20): each local batch
    is its chunks of the global batch; every example is built once; each process runs every step."""
    global_train = list(dataset.train_iterator(num_epochs=1))
    global_eval = list(dataset.eval_batches())
    train_seen, eval_seen = [], []
    for chunks in SHARDS[layout]:
        ds = recording(dataset)
        shard = BatchShard(D, chunks)
        train = list(ds.local_train_iterator(shard, num_epochs=1))
        evals = list(ds.local_eval_batches(shard))
        assert len(train) == dataset.steps_per_epoch == 3 and len(evals) == dataset.num_eval_batches == 2
        for local, want in zip(train + evals, global_train + global_eval):
            assert local.shard == shard and local.batch.batch_size == len(chunks) * B // D
            assert_local_is_global_chunks(local, want, dataset.token_buckets)
        train_seen.append(np.concatenate(ds.train_batch.calls))
        eval_seen.append(np.concatenate(ds.eval_batch.calls))
        if chunks == (2, 3):  # the epoch's last batch has 6 real examples, all in chunk 0: padding only here
            assert train[-1].num_real == 6 and train[-1].batch.weights.sum() == 0
    for seen, total in ((train_seen, 70), (eval_seen, 52)):
        assert not set(seen[0]) & set(seen[1])  # disjoint shares
        np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(total))  # together: every example once


def test_an_event_log_process_reads_only_its_examples_records(tmp_path, monkeypatch):
    """An own event log: loading it reads no record (the examples and lengths come from the conversion's index);
    each process's local batch reads, in one batched read, exactly the records (users) of its chunks' examples,
    and a process opens only the shard files that hold them."""
    write_event_log(tmp_path / "events", num_train=70, num_eval=52)
    path = convert_event_log(tmp_path / "events", tmp_path / "converted", shards=12).out
    reads = []
    read = RecordReader.read
    monkeypatch.setattr(RecordReader, "read", lambda self, records: reads.append(np.asarray(records).tolist()) or read(self, records))
    dataset = load_dataset(dataclasses.replace(CONFIG, source=Source.EVENTS, path=str(path)))
    dataset = dataset.resolve_bbs(num_shards=D, workload=lambda lengths: (1.0 + lengths) ** 2)
    assert reads == [] and dataset.train_batch.index.reader.opened() == ()
    for chunks in SHARDS["interleaved"]:
        index = dataclasses.replace(dataset.train_batch.index, reader=pickle.loads(pickle.dumps(dataset.train_batch.index.reader)))  # a process's own
        builders = {}
        for split, build in ((TRAIN, dataset.train_batch), (EVAL, dataset.eval_batch)):
            builders[split] = Recorder(ConvertedBatchBuilder(index, build.examples, build.spec, build.batch_size, split))
        ds = dataclasses.replace(dataset, train_batch=builders[TRAIN], eval_batch=builders[EVAL])
        reads.clear()
        train = ds.local_train_iterator(BatchShard(D, chunks), num_epochs=1)
        next(train)
        first = sorted(set((np.searchsorted(index.reader.first, reads[0], side="right") - 1).tolist()))
        assert index.reader.opened() == tuple(index.reader.files[f] for f in first) and len(first) < len(index.reader.files)
        list(train)
        list(ds.local_eval_batches(BatchShard(D, chunks)))
        calls = [(builders[TRAIN].build.examples, c) for c in builders[TRAIN].calls] + [(builders[EVAL].build.examples, c) for c in builders[EVAL].calls]
        users = [sorted(set((np.searchsorted(index.starts, examples.target_event[c], side="right") - 1).tolist())) for examples, c in calls]
        assert reads == [u for u in users if u]  # a batch of padding only reads nothing


def test_the_whole_shard_is_the_global_batch(dataset):
    whole = BatchShard.whole(D)
    for local, want in zip(dataset.local_train_iterator(whole, num_epochs=1), dataset.train_iterator(num_epochs=1)):
        chex.assert_trees_all_equal(local.batch, want)


def test_local_iterator_resumes_exactly(dataset):
    shard = BatchShard(D, (2, 3))
    it = dataset.local_train_iterator(shard)
    for _ in range(2):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    resumed = dataset.local_train_iterator(shard)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        chex.assert_trees_all_equal(got.batch, want.batch)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        assert got.num_real == want.num_real


def test_put_local_places_like_put():
    """One device: the local batch of the whole shard places exactly as the global batch; a wrong part is refused."""
    dataset = load_dataset(dataclasses.replace(CONFIG, bbs=None))
    placement = BatchPlacement(make_mesh(Topology(1, 1, 1), jax.devices()[:1]), dataset.token_buckets)
    assert placement.shard == BatchShard.whole(1)
    local = next(dataset.local_train_iterator(placement.shard))
    chex.assert_trees_all_equal(placement.put_local(local), placement.put(next(dataset.train_iterator())))
    with pytest.raises(ValueError, match=r"chunks BatchShard\(num_chunks=2"):
        placement.put_local(dataclasses.replace(local, shard=BatchShard(2, (0,))))
    wrong = dataclasses.replace(local, lengths=local.lengths + 1)
    with pytest.raises(ValueError, match="the global batch's lengths give"):
        placement.put_local(wrong)


def test_bad_shards_and_sizes_are_refused(dataset):
    for chunks in [(), (1, 0), (0, 0), (4,), (-1,)]:
        with pytest.raises(ValueError, match="distinct ascending indices in"):
            BatchShard(D, chunks)
    with pytest.raises(ValueError, match="positive int"):
        BatchShard(0, (0,))
    with pytest.raises(ValueError, match="does not split into 5 equal chunks"):
        LocalBatchBuilder(dataset.train_batch, dataset.train_lengths, B, BatchShard(5, (0,)))
    with pytest.raises(ValueError, match="at most 32 examples, got 33"):
        LocalBatchBuilder(dataset.train_batch, dataset.train_lengths, B, BatchShard(D, (0,)))(np.arange(33))
