"""A CPU-sized variant of configs/gem_sharded.py: the same sharding plan on 8 (fake) devices.

Topology 2 zones x 2 nodes x 2 GPUs with 2 expert slots per node, so every mechanism
runs: HSDP across zones, expert parallelism inside a node, gen-3 / gen-2 / replicated
tables. Run it with `XLA_FLAGS=--xla_force_host_platform_device_count=8`.
"""

from pathlib import Path

from gem_jax.train.config import LoopConfig, TrainConfig, load_config
from gem_jax.data.config import DataConfig, Source, SyntheticConfig
from gem_jax.model.config import ModelConfig
from gem_jax.mesh import Topology
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.optimizer import OptimConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        data=DataConfig(
            source=Source.SYNTHETIC,
            max_seq_len=16,
            batch_size=32,
            seed=0,
            prefetch_batches=0,
            synthetic=SyntheticConfig(num_items=500, num_users=100, num_genres=4, num_train_examples=2_000, num_eval_examples=64),
        ),
        model=ModelConfig(embed_dim=16, num_heads=2, num_seq_layers=1, mlp_ratio=2, num_pooled_queries=2, num_dhen_layers=1, head_hidden=16),
        optim=OptimConfig(learning_rate=1e-2, warmup_steps=2, decay_steps=10),
        checkpoint=CheckpointConfig(every_steps=2, max_to_keep=2),
        loop=LoopConfig(num_steps=4, log_every=1, eval_every=0),
        topology=Topology(zones=2, nodes_per_zone=2, gpus_per_node=2, experts_per_node=2),
        rules=load_config(Path(__file__).with_name("gem_sharded.py")).rules,
    )

