"""The GEM-width model on one H200: the step-efficiency benchmark's config.

Model at GEM width (d = 1024, 8 heads of 128, 4 sequence layers, 2 DHEN layers, head MLPs
of 1024, bf16 activations) on the synthetic long-tailed histories of
configs/gem_sharded.py (max 1024 events), 1024 examples per GPU, one GPU, data-parallel
rules (`DATA_PARALLEL_RULES`: dense weights replicated, tables row-sharded over every
device). configs/gem_sharded.py stays the cluster layout; configs/gem_h200_seq4096.py is
this model on histories of up to 4096 events; configs/gem_h200_tiny.py runs on the CPU.

    PYTHONPATH=. python3 benchmarks/train_bench.py --config configs/gem_h200.py --devices 1 --profile --out step.json
"""

from pathlib import Path

from gem_jax.data.config import DataConfig, Source
from gem_jax.mesh import Topology
from gem_jax.model.config import ModelConfig
from gem_jax.parallel.rules import DATA_PARALLEL_RULES
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.config import LoopConfig, TrainConfig, load_config
from gem_jax.train.optimizer import OptimConfig

EXAMPLES_PER_GPU = 1024


def get_config() -> TrainConfig:
    topology = Topology()
    return TrainConfig(
        data=DataConfig(
            source=Source.SYNTHETIC,
            max_seq_len=1024,
            batch_size=EXAMPLES_PER_GPU * topology.num_devices,
            seed=0,
            synthetic=load_config(Path(__file__).with_name("gem_sharded.py")).data.synthetic,
        ),
        model=ModelConfig(
            embed_dim=1024,
            num_heads=8,
            num_seq_layers=4,
            mlp_ratio=4,
            num_pooled_queries=8,
            num_dhen_layers=2,
            head_hidden=1024,
            compute_dtype="bfloat16",
        ),
        optim=OptimConfig(learning_rate=1e-3, warmup_steps=500, decay_steps=20_000),
        checkpoint=CheckpointConfig(every_steps=1000, max_to_keep=3),
        loop=LoopConfig(num_steps=20_000, log_every=100, eval_every=5000, compile_in_background=True),
        topology=topology,
        rules=DATA_PARALLEL_RULES,
    )
