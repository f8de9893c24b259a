"""The planted source: a synthetic event log with known click probabilities (`generator` documents it).

    log = generate(PRESETS["long-range"])      # or small(LONG_RANGE), SHORT_RANGE, ...
    files = write_planted(log, "data/planted")  # events + items (as a user's log), truth, planted.json

`gem_jax.train.oracle.oracle_report(read_truth(files.truth), rule)` measures the
oracle and the item-mean baseline on a split; `gem-data plant` does all three.
Names are imported on first use, so the config does not pull in pyarrow.
"""

from __future__ import annotations

from gem_jax.exports import lazy_exports

_EXPORTS = {
    "LONG_RANGE": "gem_jax.data.planted.config",
    "PRESETS": "gem_jax.data.planted.config",
    "SHORT_RANGE": "gem_jax.data.planted.config",
    "PlantedConfig": "gem_jax.data.planted.config",
    "small": "gem_jax.data.planted.config",
    "Draw": "gem_jax.data.planted.generator",
    "PlantedLog": "gem_jax.data.planted.generator",
    "generate": "gem_jax.data.planted.generator",
    "TRUTH": "gem_jax.data.planted.files",
    "PlantedFiles": "gem_jax.data.planted.files",
    "Truth": "gem_jax.data.planted.files",
    "convert_command": "gem_jax.data.planted.files",
    "event_schema": "gem_jax.data.planted.files",
    "log_truth": "gem_jax.data.planted.files",
    "read_truth": "gem_jax.data.planted.files",
    "write_planted": "gem_jax.data.planted.files",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
