"""configs/gem_sharded.py's model (d = 256) on the converted planted log, one H200: the switch table's config.

    gem-train --config configs/planted_sharded.py --workdir runs/planted_sharded --set data.path=data/planted-converted

`benchmarks/switch_table.py` trains it once per numerics switch (FP8 variants, sliding-window
and block-local attention, bf16 AdamW moments) and per seed, several runs at once on one GPU, and
`benchmarks/compare_runs.py --switch-table` tabulates their final eval NE and AUC against the
bf16 full-attention runs' seed spread (benchmarks/quality.md, "The switch table").

Model: gem_sharded's, unchanged (d = 256, 2 heads of 128, 2 sequence layers, MLP ratio 4,
8 pooled queries, 2 DHEN layers, head MLPs of 512, bf16 activations, full causal attention),
on one GPU with the data-parallel rules (configs/planted_gem.py's layout; gem_sharded's cluster
table sharding has nothing to split on one device and the planted tables are small: 10k items,
12k users).

Data: every train event of the converted log, histories of up to 1024 events (the long-range
signal sits 256-1000 events back), 1024 examples a step, `data.seed` 0 (the per-epoch shuffle;
a seed of the switch table sets it and `loop.seed` together). `data.capacity_step` 1.2: every
train batch takes one of two capacities, the fewest the capacity schedule allows
(`gem_jax.jagged.TokenBuckets`: the capacities are E times powers of the step around a batch's
expected rows E, so batches below E take E and those above take the next one; one capacity for
all would need a schedule without that split). `gem-train --dry-run` on the converted default
log (long-range or short-range: same item draws, same history lengths) plans the 1200 steps at
163,072 rows (610 steps) and 195,712 (590), the eval at 782,464; data seeds 1 and 2 take the same
two (621/579 and 640/560 steps): three programs a run, against planted_gem's five at 1.1
(148k-197k; the largest train capacity is 197,248 there, so 1.2 costs no memory, and a step
above E leaves under 1 - 1/1.2 = 17% of its rows as slack). Every run of one switch compiles the same three
shapes, on either preset, so a common compilation cache (`GEM_COMPILE_CACHE_DIR`) shares them.

The recipe (configs/planted_gem.py's structure, scaled to the width), and why:

- 1200 steps (0.7 epoch of the 1.73M train events), evals on every eval event (191,962,
  188 batches) at steps 600 and 1200: the step count and eval cadence of planted_gem, so the
  two widths compare at equal data; short enough that five runs share one GPU within a
  10-minute job (below).
- dense AdamW peak 1e-3 (gem_sharded's own; planted_gem's 3e-4 at d = 1024 scaled by the
  usual inverse-width rule gives 1.2e-3), linear warm-up over 240 steps (20%), cosine decay
  to 10% of the peak over the other 960; gradient-norm clip 1.0 (the default). The warm-up
  was 120 steps (10%) before: its three seeds ended 3.4% of NE apart, each starting to use the
  history at a different step; with 240 they end 1.1% apart, at a mean NE 0.35% lower
  (H200, 2026-12-04; benchmarks/results/planted_sharded_warmup_long_range_h200_20261204.json),
  as the longer warm-up had done for small models on the CPU (benchmarks/quality.md, "The turn
  on the CPU").
- weight decay 0.01 on dense weights (planted_gem's; exp(-1200 * 1e-3 * 0.01) = 0.988).
- history rows carry their items' category (`data.history_item_features`; configs/planted_gem.py
  gives the reason).
- embedding tables: row-wise Adagrad from an accumulator of 0 at 0.1, the best of a sweep of
  this model on the default log (H200, 2026-12-04, 1200 steps, eval AUC: 0.621 at 0.1, 0.619
  at 0.3, 0.617 at 1.0 from 0, and 0.570 at 1.0 from optax's 0.1, the item-mean baseline
  0.608; benchmarks/results/planted_sharded_recipe_sweep_long_range_h200_20261204.json), made
  before history rows carried item features. The rows start at sd d^-0.5 = 0.0625. Not
  tuned further: the table compares switches at one recipe, it does not rank recipes.
- independent query and key projections (the default). On a small planted log on the CPU,
  this width and these heads and rates with tied ones (`model.tied_qk_init=True`) ended at
  0.688 mean AUC against 0.636 over 3 seeds, with a third of the seed spread
  (benchmarks/quality.md, "Tied query and key projections"); on this log (one H100, 2026-12-05,
  seeds 0-2) tied ended at 0.7215 mean AUC, NE 0.8898, against these seeds' 0.7184 / 0.8932
  (benchmarks/results/planted_sharded_tied_qk_long_range_h100_20261205.json). The switch table's
  reference stays independent, as measured.
- float32 AdamW moments (the default): no moments' rounding on top of the switch under test.
- one checkpoint, at the end (a quality run is not resumed; `max_to_keep` 1).
- `compile_in_background`: training starts once the largest train program is built.

Measured on one H200 (2026-12-04, five bf16 runs of this model at once, each with
`GEM_MEM_FRACTION` 0.15, 21 GB; benchmarks/switch_table.py gives the call): 308 s a run from
start to exit, 14 s lowering and 112 s compiling (five processes compiling at once), 132 s in
1200 train steps sharing the GPU (36k examples/s at the end, when the others had finished), 33 s
in the two evals, 4 s in the final checkpoint. Memory: parameters 404 MB and AdamW moments
762 MB (`--dry-run`: 101M float32 parameters), activations of a 196k-row step a few GB
(gem_sharded's model peaked at 12.5 GB with its 1M-row synthetic tables, benchmarks/step.md):
five runs at 0.15 each fit.

With history item features and the 120-step warm-up (H200, 2026-12-04, four runs at once): eval
AUC 0.7261 / 0.7183 / 0.7013 and NE 0.8830 / 0.8928 / 0.9133 at step 1200 for seeds 0 / 1 / 2, a
seed spread of 3.4% of NE (step-600 AUCs 0.680, 0.658, 0.603). With this config's 240 (three runs
at once beside configs/movielens_gem.py): AUC 0.7217 / 0.7205 / 0.7129, NE 0.8895 / 0.8909 /
0.8994, a spread of 1.1% (benchmarks/quality.md, "The switch table", "Long-range, first pass").
"""

import dataclasses
from pathlib import Path

from gem_jax.data.config import DataConfig, Source
from gem_jax.mesh import Topology
from gem_jax.parallel.rules import DATA_PARALLEL_RULES
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.config import LoopConfig, TrainConfig, load_config
from gem_jax.train.optimizer import OptimConfig

NUM_STEPS = 1200
WARMUP_STEPS = 240


def get_config() -> TrainConfig:
    sharded = load_config(Path(__file__).with_name("gem_sharded.py"))
    return TrainConfig(
        data=DataConfig(
            source=Source.EVENTS, path="data/planted-converted", max_seq_len=1024, batch_size=1024, seed=0,
            capacity_step=1.2, history_item_features=True,
        ),
        model=dataclasses.replace(sharded.model, compute_dtype="bfloat16"),
        optim=OptimConfig(
            learning_rate=1e-3, warmup_steps=WARMUP_STEPS, decay_steps=NUM_STEPS - WARMUP_STEPS, weight_decay=0.01, embedding_learning_rate=0.1,
            embedding_initial_accumulator=0.0,
        ),
        checkpoint=CheckpointConfig(every_steps=NUM_STEPS, max_to_keep=1),
        loop=LoopConfig(num_steps=NUM_STEPS, log_every=50, eval_every=NUM_STEPS // 2, seed=0, compile_in_background=True),
        topology=Topology(),
        rules=DATA_PARALLEL_RULES,
    )
