"""configs/gem_h200.py with FP8 saved activations (`ModelConfig.fp8_saved_activations`).

The same model, data and step; the sequence tower keeps its MLP pre-activations and the
inputs of its QKV, MLP-up and pooled-KV projections for the backward as FP8 E4M3 with 1x128
block scales. Compare peak memory and step time with configs/gem_h200.py:

    PYTHONPATH=. python3 benchmarks/train_bench.py --config configs/gem_h200_fp8_saved.py --devices 1 --out step.json
"""

import dataclasses
from pathlib import Path

from gem_jax.train.config import TrainConfig, load_config


def get_config() -> TrainConfig:
    config = load_config(Path(__file__).with_name("gem_h200.py"))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, fp8_saved_activations=True))
