"""configs/gem_h200.py with histories of up to 4096 events (same lengths' shape, 4x longer)."""

import dataclasses
from pathlib import Path

from gem_jax.train.config import TrainConfig, load_config


def get_config() -> TrainConfig:
    config = load_config(Path(__file__).with_name("gem_h200.py"))
    return dataclasses.replace(config, data=dataclasses.replace(config.data, max_seq_len=4096))
