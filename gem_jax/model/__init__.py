"""The GEM-style model: towers, interaction, heads, its loss and its FLOP/workload model."""

from gem_jax.model.config import ModelConfig
from gem_jax.model.flops import Workload, flop_model, peak_flops, train_workload
from gem_jax.model.gem import GEMModel
from gem_jax.model.loss import bce_per_example, weighted_bce
from gem_jax.model.remat import RematConfig, RematPolicy

__all__ = [
    "GEMModel", "ModelConfig", "RematConfig", "RematPolicy", "Workload", "bce_per_example", "flop_model", "peak_flops", "train_workload",
    "weighted_bce",
]
