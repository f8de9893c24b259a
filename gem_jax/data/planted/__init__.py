"""The planted source: a synthetic event log with known click probabilities (`generate` documents it).

    log = generate(PRESETS["long-range"])      # or small(LONG_RANGE), SHORT_RANGE, ...
    files = write_planted(log, "data/planted")  # events + items (as a user's log), truth, planted.json

`gem_jax.train.oracle.oracle_report(read_truth(files.truth), rule)` measures the
oracle and the item-mean baseline on a split; `gem-data plant` does all three.
"""

from __future__ import annotations

from gem_jax.data.planted.config import LONG_RANGE, PRESETS, SHORT_RANGE, PlantedConfig, small
from gem_jax.data.planted.files import TRUTH, PlantedFiles, Truth, convert_command, event_schema, read_truth, write_planted
from gem_jax.data.planted.generate import Draw, PlantedLog, generate

__all__ = [
    "LONG_RANGE", "PRESETS", "SHORT_RANGE", "TRUTH", "Draw", "PlantedConfig", "PlantedFiles", "PlantedLog", "Truth",
    "convert_command", "event_schema", "generate", "read_truth", "small", "write_planted",
]
