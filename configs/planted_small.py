"""The MovieLens demo's model and recipe (configs/events.py's) on configs/planted_gem.py's data and schedule.

    gem-train --config configs/planted_small.py --workdir runs/planted_small --set data.path=data/planted-converted

The comparison run for configs/planted_gem.py: the same converted planted log, histories of
up to 1024 events, 1024 examples a step, 1800 steps, evals at 900 and 1800; the model
(width 32, 2 sequence layers) and optimizer settings are configs/events.py's (dense AdamW peak
2e-3 after 50 warm-up steps, weight decay 1e-4, embedding Adagrad 0.05), with the cosine decay
stretched to the longer run; its data is planted_gem's, history item features included. With
smaller batches and windows it also runs on the CPU (benchmarks/quality.md has such a run).

Memory: the demo model computes in float32, so its attention takes the jnp reference (the
kernels take bfloat16), whose padded scores of 1024-event histories are large: beside another
run, with 42 GB of the H200 (`GEM_MEM_FRACTION` 0.3), it ran out of memory at its first step
(a 27.8 GiB allocation; 2026-12-04). Run it alone on the GPU.
"""

import dataclasses
from pathlib import Path

from gem_jax.train.config import TrainConfig, load_config


def get_config() -> TrainConfig:
    here = Path(__file__).parent
    demo, gem = load_config(here / "events.py"), load_config(here / "planted_gem.py")
    return dataclasses.replace(
        gem,
        model=demo.model,
        optim=dataclasses.replace(demo.optim, decay_steps=gem.loop.num_steps - demo.optim.warmup_steps),
    )
