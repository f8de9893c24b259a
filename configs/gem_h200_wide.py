"""configs/gem_h200.py at width d = 1536: the config where FP8's GEMMs should be large enough to pay.

Width 1536 (12 heads of 128, head MLPs of 1536), everything else as configs/gem_h200.py
(4 sequence layers, 2 DHEN layers, 1024 examples, histories of up to 1024 events). d = 2048
with today's DHEN would hold ~147 GB of parameters, moments and gradients, more than one H200;
at 1536 the DHEN grows 2.25x and the tables 1.5x:

- parameters: 33.8 GB of float32 (8.45B), the optimizer state 21.5 GB with bfloat16 AdamW
  moments (`optim.moments_dtype`, set here) and row-wise Adagrad tables: 55.3 GB of
  arguments, one checkpoint copy (`gem-train --dry-run` on the CPU, from the state's shapes);
- peak device memory, from XLA's own H200 compile of the step on a CPU machine
  (`benchmarks/offline_compile.py`, 2026-12-05, at 9aedc53: the GELU recomputed in the
  backward): 116.4 GB (55.3 GB of arguments, 61.1 GB of temporaries) in bf16, and the same
  with FP8 including the DHEN region, of the 129 GB jax takes of the H200 (90%), without remat
  (as configs/gem_h200.py). Not yet measured on an H200; if it does not fit,
  `--set model.remat.budget_gb=...` lets the remat planner choose what to recompute (its
  estimate needs the Pallas kernels: on a CPU it prices the padded reference attention).
- on an H100: with the weight matrices kept in bfloat16 (`optim.weights_dtype=bfloat16`) and
  512 examples (`train_bench.py --per-device-batch 512`), 71.4 GB in XLA's H200 compile and
  71.7 GB measured; there FP8 ran the step at 1.00x bf16 (0.95x with the DHEN region,
  `benchmarks/step.md`, 2026-12-07).

`configs/gem_h200_wide.py` is the bf16 step; add `--set model.fp8=True model.fp8_block=128`
(and the DHEN region: `model.fp8_regions=SEQ_ATTENTION,SEQ_MLP,POOLED,CROSS`) for the FP8 one.

    PYTHONPATH=. python3 benchmarks/train_bench.py --config configs/gem_h200_wide.py --devices 1 --profile --out step_wide.json
"""

import dataclasses
from pathlib import Path

from gem_jax.train.config import TrainConfig, load_config

WIDTH = 1536


def get_config() -> TrainConfig:
    config = load_config(Path(__file__).with_name("gem_h200.py"))
    model = dataclasses.replace(
        config.model,
        embed_dim=WIDTH,
        num_heads=WIDTH // 128,
        head_hidden=WIDTH,
    )
    return dataclasses.replace(config, model=model, optim=dataclasses.replace(config.optim, moments_dtype="bfloat16"))
