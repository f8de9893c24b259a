"""A CPU-sized variant of configs/gem_h200.py: the same layout (one device, data-parallel
rules, synthetic long-tailed histories, float32 on the CPU) at a few seconds per run."""

from gem_jax.data.config import DataConfig, Source, SyntheticConfig
from gem_jax.model.config import ModelConfig
from gem_jax.parallel.rules import DATA_PARALLEL_RULES
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.config import LoopConfig, TrainConfig
from gem_jax.train.optimizer import OptimConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        data=DataConfig(
            source=Source.SYNTHETIC,
            max_seq_len=16,
            batch_size=16,
            seed=0,
            prefetch_batches=0,
            synthetic=SyntheticConfig(num_items=500, num_users=100, num_genres=4, num_train_examples=1_000, num_eval_examples=32),
        ),
        model=ModelConfig(embed_dim=16, num_heads=2, num_seq_layers=2, mlp_ratio=2, num_pooled_queries=2, num_dhen_layers=1, head_hidden=16),
        optim=OptimConfig(learning_rate=1e-2, warmup_steps=2, decay_steps=10),
        checkpoint=CheckpointConfig(every_steps=2, max_to_keep=2),
        loop=LoopConfig(num_steps=2, log_every=1, eval_every=0),
        rules=DATA_PARALLEL_RULES,
    )
