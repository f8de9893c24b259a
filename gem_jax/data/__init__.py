"""Data sets, splits, jagged batches, BBS, the grain pipeline and converted own event logs (`ingest`).

Names are imported on first use, so the config classes do not pull in grain.
"""

from __future__ import annotations

from gem_jax.exports import lazy_exports

_EXPORTS = {
    "BBSConfig": "gem_jax.data.config",
    "DataConfig": "gem_jax.data.config",
    "Source": "gem_jax.data.config",
    "SyntheticConfig": "gem_jax.data.config",
    "OnBadRow": "gem_jax.data.rows",
    "Dataset": "gem_jax.data.pipeline",
    "DatasetInfo": "gem_jax.data.pipeline",
    "load_dataset": "gem_jax.data.pipeline",
    "ConvertedLog": "gem_jax.data.ingest.shards",
    "EventSchema": "gem_jax.data.ingest.schema",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
