"""configs/gem_h200.py with the sequence tower's per-token layers in FP8: the FP8 step-efficiency config.

FP8 regions are the default `ModelConfig.fp8_regions` (self-attention qkv/out, the MLPs, the
pooled key/value projection); the interaction, the cross-feature tower and the heads stay in
bf16. 128-wide K blocks (1x128 activations, 128x128 weights): the FP8 GEMM that is faster than
bf16 on Hopper (benchmarks/mxfp8.md); `fp8_block=32` here runs MXFP8 32x32 blocks.

    PYTHONPATH=. python3 benchmarks/train_bench.py --config configs/gem_h200_fp8.py --devices 1 --profile --out step_fp8.json
"""

import dataclasses
from pathlib import Path

from gem_jax.train.config import TrainConfig, load_config


def get_config() -> TrainConfig:
    config = load_config(Path(__file__).with_name("gem_h200.py"))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, fp8=True, fp8_block=128))
