"""GEM-like sharded training on synthetic long-tailed histories, for a cluster of Hopper GPUs.

Topology: 2 zones x 2 nodes x 8 GPUs (32 GPUs), 2 expert slots per node. Dense weights
HSDP (FSDP over a zone's 16 GPUs, replicated across the 2 zones); the DHEN MLP experts
spread over the expert slots of each node; the item table node-split (gen 3), the user
table model-parallel inside a zone (gen 2), the small feature tables replicated. The
sharded tables exchange ids and rows in bounded buffers, 1.25x what uniform ids need
(`TableSharding.capacity_factor`; `gem-train` prints their size at start-up).
Embedding ids outside a vocabulary are an error; the user ids are hashed instead. Base batch
shuffling balances the devices' work (and their token counts, so one capacity fits all).
`benchmarks/train_bench.py` runs this model on 1 and 2 GPUs of one host.
"""

from gem_jax.train.config import LoopConfig, TrainConfig
from gem_jax.data.config import BBSConfig, DataConfig, Source, SyntheticConfig
from gem_jax.model.config import ModelConfig
from gem_jax.nn.embeddings import Generation, OutOfRange, TableSharding
from gem_jax.mesh import Topology
from gem_jax.parallel.rules import HSDP_RULES, ShardingRules
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.optimizer import OptimConfig

EXCHANGE_CAPACITY = 1.25  # bounded exchange buffers; None would size them for the worst case (every id to one owner)
SMALL_TABLES = ("embed/action", "embed/time_bucket", "embed/user/age", "embed/user/gender", "embed/user/occupation")

RULES = ShardingRules(
    logical=HSDP_RULES.logical,
    tables=(
        ("embed/item", TableSharding(Generation.NODE_SPLIT, capacity_factor=EXCHANGE_CAPACITY)),
        ("embed/user/user", TableSharding(Generation.GROUP, OutOfRange.HASH, capacity_factor=EXCHANGE_CAPACITY)),
    )
    + tuple((name, TableSharding(Generation.REPLICATED)) for name in SMALL_TABLES),
    default_table=TableSharding(Generation.GROUP),
)


def get_config() -> TrainConfig:
    return TrainConfig(
        data=DataConfig(
            source=Source.SYNTHETIC,
            max_seq_len=1024,
            batch_size=1024 * 32,  # 1024 examples per GPU
            seed=0,
            synthetic=SyntheticConfig(num_items=1_000_000, num_users=1_000_000, num_genres=32, num_train_examples=100_000_000),
            bbs=BBSConfig(),  # balanced devices also share one token capacity with little slack
        ),
        model=ModelConfig(
            embed_dim=256,
            num_heads=2,
            num_seq_layers=2,
            mlp_ratio=4,
            num_pooled_queries=8,
            num_dhen_layers=2,
            head_hidden=512,
            compute_dtype="bfloat16",
        ),
        optim=OptimConfig(learning_rate=1e-3, warmup_steps=500, decay_steps=20_000),
        checkpoint=CheckpointConfig(every_steps=1000, max_to_keep=3),
        loop=LoopConfig(num_steps=20_000, log_every=100, eval_every=5000),
        topology=Topology(zones=2, nodes_per_zone=2, gpus_per_node=8, experts_per_node=2),
        rules=RULES,
    )

