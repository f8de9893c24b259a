"""A finished (or stopped) run's parameters, for evaluation and research code.

`load_params(workdir)` needs nothing but the workdir: the run's config and feature spec
come from its `run.json` (`gem_jax.train.run_record`), the parameters from its newest
(or a chosen) Orbax checkpoint, restored onto the devices of this process. A run
written before the feature schema is read with its tables renamed
(`gem_jax.train.legacy_runs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from gem_jax.batch import FeatureSpec
from gem_jax.data.pipeline import source_tasks
from gem_jax.mesh import Topology, make_mesh
from gem_jax.model.gem import GEMModel
from gem_jax.train import config_tree, legacy_runs, run_record
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.config import TrainConfig
from gem_jax.train.optimizer import make_optimizer
from gem_jax.train.setup import model_factory
from gem_jax.train.state import state_setup


@dataclasses.dataclass(frozen=True)
class RestoredRun:
    """A run's parameters with what built them.

    Attributes:
      config: the run's config, with `topology` set to one node of the restore
        devices (pass it to `setup_training(config, init_state=False)` to evaluate).
      spec: the run's feature spec (vocabularies, features, tasks, `max_seq_len`).
      step: the checkpoint's step.
      params: the model's parameters, a nested dict of arrays (`nnx.to_pure_dict`
        layout), placed as `setup_training(config)` places them.
      record: the whole `run.json` (data identity, code version).
    """

    config: TrainConfig
    spec: FeatureSpec
    step: int
    params: dict
    record: dict

    def model(self) -> GEMModel:
        """A `GEMModel` holding these parameters (unsharded Flax NNX module)."""
        abstract = nnx.eval_shape(lambda: GEMModel(self.spec, self.config.model, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        nnx.replace_by_pure_dict(state, self.params)
        return nnx.merge(graphdef, state)


def load_params(workdir: str | Path, step: int | None = None, *, devices: Sequence[jax.Device] | None = None) -> RestoredRun:
    """Restores the parameters a run saved in `workdir`.

    Args:
      workdir: the run's workdir (holds `run.json` and `checkpoints/`).
      step: the checkpoint to restore (default: the newest).
      devices: where to place them (default: the first device); the mesh is one
        node of these devices, whatever the run was trained on.

    Returns:
      A `RestoredRun`.

    Raises:
      FileNotFoundError: no run record, no checkpoint, or no checkpoint for `step`
        (the steps present are named).
      TypeError: `step` that is not an int.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise TypeError(f"load_params: step must be an int (a checkpoint's step) or None for the newest, got {step!r}")
    workdir = Path(workdir)
    record = run_record.read_record(workdir)
    if record is None:
        raise FileNotFoundError(f"{workdir / run_record.RUN_FILE} not found: {workdir} is not a gem-train workdir")
    devices = list(devices) if devices is not None else jax.devices()[:1]
    config = config_tree.from_tree(TrainConfig, record["config"])
    config = dataclasses.replace(config, topology=Topology(gpus_per_node=len(devices)))
    legacy = legacy_runs.is_legacy_spec(record["spec"])
    if legacy:
        spec = legacy_runs.spec_from_legacy(record["spec"], source_tasks(config.data.source))
    else:
        spec = config_tree.from_tree(FeatureSpec, record["spec"])
    mesh = make_mesh(config.topology, devices)
    setup = state_setup(model_factory(spec, config), make_optimizer(config.optim), mesh, config.rules, compute_dtype=config.model.compute_dtype,
                        weights_dtype=config.optim.weights_dtype)
    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint, read_only=True)
    try:
        steps = checkpointer.all_steps()
        if not steps:
            raise FileNotFoundError(f"{workdir / 'checkpoints'} holds no checkpoint")
        step = max(steps) if step is None else step
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {workdir / 'checkpoints'}; steps: {sorted(steps)}")
        if legacy:
            state = legacy_runs.schema_names(checkpointer.restore_state(step, legacy_runs.legacy_names(setup.abstract)))
        else:
            state = checkpointer.restore_state(step, setup.abstract)
    finally:
        checkpointer.close()
    return RestoredRun(config=config, spec=spec, step=step, params=state.params, record=record)
