"""Data: event-log readers, the per-user time split, examples, batches and grain iterators.

Entry point: `gem_jax.data.pipeline.load_dataset(DataConfig(...))` (`DataConfig`, `Source`,
`OnBadRow` are importable from `gem_jax.data.pipeline` too).

Modules (each one job):
  batch.py            the `Batch` structure, `FeatureSpec`, id validation
  rows.py             malformed-row policy (`OnBadRow`) and errors
  events.py           the common `EventLog` (dense ids, sorted events)
  movielens_small.py  MovieLens latest-small reader
  movielens_100k.py   MovieLens 100K reader
  amazon_beauty.py    Amazon Beauty (S3-Rec one-line-per-user) reader
  features.py         half-star actions, log-scaled time buckets
  split.py            per-user time split, train / eval targets
  examples.py         examples as index arrays; rating and sampled next-item labels
  collate.py          static-shape batches with bucketed token capacity
  sampling.py         grain source of per-epoch shuffled example batches
  synthetic.py        synthetic long-tailed batches for benchmarks
  bbs.py              base batch shuffling: balanced per-device chunks of a global batch
  workload.py         the attention-aware per-example workload model and balance metrics
  config.py           `DataConfig`, `Source`, `SyntheticConfig`
  paths.py            default data folders (`GEM_SHARED_DATA`)
  pipeline.py         `load_dataset` and `Dataset`: the grain train / eval iterators

This package's `__init__` imports nothing, so importing `gem_jax.data.batch`
does not load grain.
"""
