"""GEM-style model on your own event log, converted by `gem-data convert` (README "Your own data").

    gem-train --config configs/events.py --workdir runs/mylog --set data.path=data/mylog

Tasks and features are the conversion's: one task per `--label`, the user id and the
`--user-feature`s as user tokens, the `--item-feature`s of the candidate item. Every event
of the split's train side is a train example, every eval-side event an eval example,
each with the user's earlier events as history (the latest 128). The eval reports AUC and
NE per task beside the item-mean-label baseline (`baseline_auc_<task>`).

The model and schedule are the MovieLens demo's (`configs/movielens.py`): a CPU-sized
width and 400 steps of 256 examples. Scale them to the log with --set, e.g.
`model.embed_dim=256 loop.num_steps=20000 data.batch_size=1024 optim.decay_steps=19000`.
"""

from gem_jax.data.config import DataConfig, Source
from gem_jax.model.config import ModelConfig
from gem_jax.train.checkpoint import CheckpointConfig
from gem_jax.train.config import LoopConfig, TrainConfig
from gem_jax.train.optimizer import OptimConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        data=DataConfig(source=Source.EVENTS, path=None, max_seq_len=128, batch_size=256, seed=0),
        model=ModelConfig(embed_dim=32, num_heads=2, num_seq_layers=2, num_pooled_queries=2, head_hidden=64),
        optim=OptimConfig(learning_rate=2e-3, warmup_steps=50, decay_steps=350, embedding_learning_rate=0.05),
        checkpoint=CheckpointConfig(every_steps=100, max_to_keep=3),
        loop=LoopConfig(num_steps=400, log_every=25, eval_every=200),
    )
