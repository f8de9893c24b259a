"""configs/movielens.py with the sequence tower's dense layers in FP8 (MXFP8, 32x32 blocks; the default
`ModelConfig.fp8_regions`).

Compare its eval NE with configs/movielens.py (the same run in full precision).
"""

import dataclasses
from pathlib import Path

from gem_jax.train.config import TrainConfig, load_config


def get_config() -> TrainConfig:
    config = load_config(Path(__file__).with_name("movielens.py"))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, fp8=True, fp8_block=32))
