"""The GEM-width model (configs/gem_h200.py's, unchanged) on the converted planted log, one H200.

    gem-data plant --out data/planted && gem-data convert data/planted/events.parquet --out data/planted-converted ...
    gem-train --config configs/planted_gem.py --workdir runs/planted_gem --set data.path=data/planted-converted

(benchmarks/quality.md, "Training on the planted source", has the whole command list.) The
planted log's oracle and item-mean baseline on the same `time:0.9` eval events are known
(default log: AUC 0.773 / 0.608, NE 0.822 / 0.977), so the eval places the model between them.

Data: every train event of the converted log, histories of up to 1024 events (the long-range
signal sits 256-1000 events back, so a shorter window cannot reach the oracle), 1024 examples a
step; `data.capacity_step` 1.1 (about twice the default's slack bound, under 9.1%): on the default
log, 1500 steps take 4 train capacities (163k and 179k token rows for all but 7 steps) against 6 at
the default 1.04 (`gem-train --dry-run`). The eval runs on every eval event (191,962 on the default
log: 188 batches) at steps 600 and 1200; eval events are each user's latest, with long histories,
and every eval batch is placed at the largest eval capacity, 788,992 rows (770 per example, against
~165 in a train batch): one eval takes about as long as ~290 train steps (188 batches of 4.6x the
rows, forward only at about a third of a step): measured 36.6 s an eval on the H200 (2026-12-04,
the run of benchmarks/results/planted_gem_long_range_h200_20261204.json: 431.7 s from start to
exit, 69.7 s compiling, 231.0 s in 1200 train steps of 0.193 s, 73.2 s in the two evals, 33.3 s
in its one checkpoint, at the end: `checkpoint.every_steps=1200`).

The recipe, and why (the same model at lr 1e-3 ended worse than the constant on MovieLens, NE
1.16, so the defaults of configs/gem_h200.py, a step-time benchmark, are not a training recipe):

- 1200 steps (0.7 epoch of the 1.73M train events): what fits a 10-minute job beside planting,
  start-up (~90 s cold) and the two evals, at the 0.193 s a step measured above.
- dense AdamW peak 3e-4, a third of the MovieLens run's: d = 1024 transformer blocks are usually
  trained at 1e-4 to 5e-4 with batches of this size.
- linear warm-up over 120 steps (10% of the run), then cosine decay to 10% of the peak at the
  last step (`decay_steps` = 1080): a 1-2k-step warm-up would leave no decay in this budget;
  Adam's early moments are noisy, and the clip below caps what they can do.
- gradient-norm clip 1.0 on the dense group (the default).
- weight decay 0.01 on dense weights (decoupled, times the learning rate; 100x the default's
  1e-4, still far below what changes 1200 steps: exp(-1200 * 3e-4 * 0.01) = 0.996).
- history rows carry their items' category (`data.history_item_features`): the planted
  signals are mostly functions of the history's categories (the mid and long-range terms
  wholly, the recent term half, through the items' latent vectors), and without them the
  model must learn each of 10,000 items' category from its id. Without them, every width
  stalled at about a tenth of the oracle's AUC lift over the item-mean baseline on the
  H200 (2026-12-04: this model 0.626 AUC at step 1200, the d = 256 model 0.621, the demo
  model 0.624; the d = 256 model 0.628-0.635 after 2.4 epochs, then overfitting); with
  them a tiny model on a small planted log went from 13% to 34% of the lift on the CPU
  (benchmarks/quality.md, "What mattered").
- embedding tables: row-wise Adagrad from an accumulator of 0
  (`optim.embedding_initial_accumulator`, FBGEMM's and PyTorch's start) at 0.05. From optax's
  0.1 a row's gradient of a batch-mean loss is tiny beside the accumulator, so Adagrad acts as
  SGD at lr / sqrt(0.1) and the rows hardly move (the d = 256 model at 1.0 from 0.1: AUC 0.570,
  below the baseline's 0.608; from 0 at 0.1: 0.621). From 0 a row's first update is about the
  rate in each coordinate, whatever the gradient's scale, so the rate scales with the rows'
  init (sd d^-0.5): 0.1 was best at d = 256 (against 0.3 and 1.0 over 1200 steps; 0.03 about as
  good over 4000), so 0.05 here, where
  the rows start half as large; the run at 0.05 is the 0.626 above. Not swept at this width.
- float32 AdamW moments (the default): a quality run leaves out bf16 moments' rounding.
- a checkpoint at steps 600 and 1200, one kept: 18.6 GB a copy (`gem-train --dry-run`: 6.2 GB of
  parameters, 1.56B of them, 1.45B in the two DHEN layers; 12.4 GB of AdamW moments), written in
  the background; two copies at the peak fit the H200 host's 64 GiB disk.
"""

import dataclasses
from pathlib import Path

from gem_jax.data.config import DataConfig, Source
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.config import LoopConfig, TrainConfig, load_config
from gem_jax.train.optimizer import OptimConfig

NUM_STEPS = 1200
WARMUP_STEPS = 120


def get_config() -> TrainConfig:
    gem = load_config(Path(__file__).with_name("gem_h200.py"))
    return dataclasses.replace(
        gem,
        data=DataConfig(
            source=Source.EVENTS, path="data/planted-converted", max_seq_len=1024, batch_size=gem.data.batch_size, seed=0, capacity_step=1.1,
            history_item_features=True,
        ),
        optim=OptimConfig(
            learning_rate=3e-4, warmup_steps=WARMUP_STEPS, decay_steps=NUM_STEPS - WARMUP_STEPS, weight_decay=0.01, embedding_learning_rate=0.05,
            embedding_initial_accumulator=0.0,
        ),
        checkpoint=CheckpointConfig(every_steps=NUM_STEPS // 2, max_to_keep=1),
        loop=LoopConfig(num_steps=NUM_STEPS, log_every=50, eval_every=NUM_STEPS // 2, compile_in_background=True),
    )
