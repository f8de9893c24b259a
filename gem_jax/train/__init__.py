"""The training system: config, state, steps, loop, checkpoints, metrics, restore.

Names are imported on first use (the loop pulls in grain and Orbax).
"""

from __future__ import annotations

from gem_jax.exports import lazy_exports

_EXPORTS = {
    "TrainConfig": "gem_jax.train.config",
    "LoopConfig": "gem_jax.train.config",
    "load_config": "gem_jax.train.config",
    "ConfigFileError": "gem_jax.train.config",
    "OptimConfig": "gem_jax.train.optimizer",
    "CheckpointConfig": "gem_jax.train.checkpoint",
    "apply_overrides": "gem_jax.train.config_tree",
    "ConfigError": "gem_jax.train.config_tree",
    "TrainState": "gem_jax.train.state",
    "make_train_step": "gem_jax.train.step",
    "make_eval_step": "gem_jax.train.step",
    "Training": "gem_jax.train.setup",
    "setup_training": "gem_jax.train.setup",
    "train_and_evaluate": "gem_jax.train.loop",
    "RestoredRun": "gem_jax.train.restore",
    "load_params": "gem_jax.train.restore",
    "RunMismatchError": "gem_jax.train.run_record",
    "RematPlan": "gem_jax.train.remat_plan",
    "RematBudgetError": "gem_jax.train.remat_plan",
    "measure_step": "gem_jax.train.remat_plan",
    "plan_remat": "gem_jax.train.remat_plan",
    "auc": "gem_jax.train.metrics",
    "normalized_entropy": "gem_jax.train.metrics",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
