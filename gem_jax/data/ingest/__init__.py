"""Your own event log -> converted per-user sequences (`gem-data`).

- `schema`: `EventSchema`, which column is what (ids, time, action, labels, weight, side features).
- `readers`: streaming CSV/TSV and Parquet readers with per-row checks.
- `vocab`: id <-> row vocabularies (row 0 padding, row 1 OOV), saved as `row,id,count` CSV.
- `split`: time-cutoff, time-quantile and last-N splits.
- `records`: the byte layout of one user's record.
- `convert`: the two-pass, bounded-memory conversion to sharded ArrayRecord files.
- `manifest`: the converted directory's `manifest.json` and input identity.
- `shards`: `ConvertedLog`, a process's share of the shards as a random-access source.
- `stats`, `batch_layout`, `inspect`: sequence-length statistics, padding and balance estimates, `gem-data inspect`.
"""
