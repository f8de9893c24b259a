"""GEM-style model on the embedded MovieLens latest-small (data/ml-latest-small), CPU-sized.

Tasks: PRIMARY = rating >= 4 ("like"), SECONDARY = rating >= 4.5 ("love").
400 steps at B=256 (about one epoch of the ~91k train examples); 5 to 10 minutes on 2 CPU cores.
"""

from gem_jax.train.config import LoopConfig, TrainConfig
from gem_jax.data.config import DataConfig, Source
from gem_jax.model.config import ModelConfig
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.optimizer import OptimConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        data=DataConfig(source=Source.ML_LATEST_SMALL, max_seq_len=128, batch_size=256, seed=0),
        model=ModelConfig(embed_dim=32, num_heads=2, num_seq_layers=2, num_pooled_queries=2, head_hidden=64),
        optim=OptimConfig(learning_rate=2e-3, warmup_steps=50, decay_steps=350, embedding_learning_rate=0.05),
        checkpoint=CheckpointConfig(every_steps=100, max_to_keep=3),
        loop=LoopConfig(num_steps=400, log_every=25, eval_every=200),
    )
