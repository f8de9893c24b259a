"""A seconds-sized variant of configs/events.py for smoke tests: tiny model, few steps.

    gem-train --config configs/events_tiny.py --workdir runs/mylog_tiny --set data.path=data/mylog
"""

from gem_jax.data.config import DataConfig, Source
from gem_jax.model.config import ModelConfig
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.config import LoopConfig, TrainConfig
from gem_jax.train.optimizer import OptimConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        data=DataConfig(source=Source.EVENTS, path=None, max_seq_len=16, batch_size=32, seed=0, prefetch_batches=0),
        model=ModelConfig(embed_dim=8, num_heads=2, num_seq_layers=1, num_pooled_queries=1, head_hidden=8),
        optim=OptimConfig(learning_rate=1e-2, warmup_steps=2, decay_steps=10),
        checkpoint=CheckpointConfig(every_steps=3, max_to_keep=2),
        loop=LoopConfig(num_steps=6, log_every=1, eval_every=0),
    )
