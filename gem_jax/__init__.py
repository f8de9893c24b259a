"""gem-jax: GEM-style recommendation models over jagged behaviour histories, in JAX.

The names a research script needs, importable from the top level::

    import gem_jax
    training, state = gem_jax.setup_training(gem_jax.load_config("configs/movielens_tiny.py"))
    run = gem_jax.load_params("runs/demo")

Attributes are imported on first use, so `import gem_jax` stays light (grain, orbax and
the trainer load only when a name that needs them is touched).
"""

from __future__ import annotations

from gem_jax.exports import lazy_exports

_EXPORTS = {
    # data layout
    "Jagged": "gem_jax.jagged",
    "Batch": "gem_jax.batch",
    "FeatureSpec": "gem_jax.batch",
    "CategoricalFeature": "gem_jax.batch",
    "Pooling": "gem_jax.batch",
    # model
    "GEMModel": "gem_jax.model",
    "ModelConfig": "gem_jax.model",
    # mesh and data
    "Topology": "gem_jax.mesh",
    "make_mesh": "gem_jax.mesh",
    "DataConfig": "gem_jax.data",
    "Source": "gem_jax.data",
    "SyntheticConfig": "gem_jax.data",
    "load_dataset": "gem_jax.data",
    # training
    "TrainConfig": "gem_jax.train",
    "LoopConfig": "gem_jax.train",
    "OptimConfig": "gem_jax.train",
    "CheckpointConfig": "gem_jax.train",
    "load_config": "gem_jax.train",
    "apply_overrides": "gem_jax.train",
    "setup_training": "gem_jax.train",
    "train_and_evaluate": "gem_jax.train",
    "load_params": "gem_jax.train",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
