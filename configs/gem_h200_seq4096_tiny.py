"""configs/gem_h200_tiny.py with 4x longer histories, the CPU variant of configs/gem_h200_seq4096.py."""

import dataclasses
from pathlib import Path

from gem_jax.train.config import TrainConfig, load_config


def get_config() -> TrainConfig:
    config = load_config(Path(__file__).with_name("gem_h200_tiny.py"))
    return dataclasses.replace(config, data=dataclasses.replace(config.data, max_seq_len=4 * config.data.max_seq_len))
