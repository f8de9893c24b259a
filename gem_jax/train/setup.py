"""Everything a training job builds before its first step, in one place.

`setup_training(config)` loads the data set, makes the mesh, the optimizer and the
sharded train state, the jitted train and eval steps, and the model's training
workload (FLOPs per example, used by MFU accounting and by BBS). The trainer
(`gem_jax.train.loop`), the benchmarks and research scripts all start from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from gem_jax.data.pipeline import Dataset, load_dataset
from gem_jax.jagged import pick_capacity
from gem_jax.mesh import make_mesh
from gem_jax.model.flops import Workload, train_workload
from gem_jax.model.gem import ITEM_FEATURE_TABLES, GEMModel, example_tables
from gem_jax.nn.embeddings import Generation, describe_exchange
from gem_jax.parallel.placement import BatchPlacement
from gem_jax.train.baseline import item_mean_label_auc
from gem_jax.train.config import TrainConfig
from gem_jax.train.metrics import EvalAccumulator
from gem_jax.train.optimizer import make_optimizer
from gem_jax.train.remat_plan import RematPlan, measure_step, model_graphdef, plan_remat, planning_batch
from gem_jax.train.state import StateSetup, TrainState, init_train_state, state_setup
from gem_jax.train.step import make_eval_step, make_train_step


@dataclasses.dataclass(frozen=True)
class Training:
    """The static parts of a training job.

    Attributes:
      config: the whole job.
      dataset: the split data set (BBS resolved for this mesh).
      mesh: the device mesh of `config.topology`.
      optimizer: the optax transformation of `config.optim`.
      state: shapes, shardings and the sharding plan of the train state.
      placement: puts host batches on the mesh (one jagged batch per device);
        `placement.shard` is the part of each global batch this process builds.
      workload: training FLOPs per example as a function of its history length.
      train_step: `(state, placed batch) -> (state, metrics)`, jitted, donates `state`.
      eval_step: `(params, placed batch) -> {"logits", "labels", "weights",
        "candidate_item"}`, jitted, replicated (`gem_jax.train.step.make_eval_step`).
      remat_plan: the regions' rematerialization policies and costs
        (`gem_jax.train.remat_plan`); None when `ModelConfig.remat` asks for none.
    """

    config: TrainConfig
    dataset: Dataset
    mesh: jax.sharding.Mesh
    optimizer: optax.GradientTransformation
    state: StateSetup
    placement: BatchPlacement
    workload: Workload
    train_step: Callable
    eval_step: Callable
    remat_plan: RematPlan | None = None

    def initial_state(self) -> TrainState:
        """The train state freshly initialised from `config.loop.seed`, sharded as `state.shardings`
        (`gem_jax.train.state.init_train_state`): what `setup_training(config)` returns beside the job."""
        return init_train_state(model_factory(self.dataset, self.config), self.optimizer, self.state, self.config.loop.seed)

    @property
    def per_device_batch(self) -> int:
        """Examples of a global batch on each device: `B / D`."""
        return self.dataset.batch_size // self.mesh.devices.size

    def describe_exchanges(self) -> list[str]:
        """One line per sharded embedding table: its exchange buffers for a lookup of a device's expected history rows.

        The rows are `B/D` times the data set's mean history length, in the token
        capacity a batch of that many rows gets (`gem_jax.nn.embeddings.describe_exchange`);
        the history's tables are described for that many ids, the tables of the user's and
        the candidate's features for `B/D` times their values per example
        (`gem_jax.model.gem.example_tables`; the item table's candidate lookup, `B/D` ids
        more, is a lookup of its own), except that an item feature's table that the history
        rows also look up (`FeatureSpec.history_item_features`) is described for theirs,
        the rows times its values (the candidates' is a lookup of its own).
        """
        per_device = self.per_device_batch
        spec = self.dataset.spec
        buckets = self.dataset.token_buckets
        rows = pick_capacity(math.ceil(per_device * buckets.mean_length), buckets.capacities(per_device))
        ids = {name: per_device * values for name, values in example_tables(spec).items()}
        ids |= {ITEM_FEATURE_TABLES + name: rows * (c.stop - c.start) for name, c in spec.history_feature_columns.items()}
        model = self.config.model
        return [
            describe_exchange(placement, ids.get(placement.name, 0) or rows, model.embed_dim, model.compute_dtype)
            for placement in self.state.plan.tables.values()
            if placement.generation is not Generation.REPLICATED
        ]

    def evaluate(self, params, *, baseline: bool = False, eval_step: Callable | None = None, capacity: int | None = None) -> dict[str, float]:
        """Per-task AUC, NE and BCE of `params` over every eval example once.

        Each process builds its part of each eval batch (`Dataset.local_eval_batches`);
        all run the same `num_eval_batches` steps, and the weight-0 padding of the last
        batch is left out of every metric. Every process returns the same record.

        Args:
          params: the sharded parameters.
          baseline: also report the item-mean-label baseline's AUC
            (`baseline_auc_<task>`, `gem_jax.train.baseline`).
          eval_step: the step to run (default `self.eval_step`; the trainer passes its
            ahead-of-time compiled `gem_jax.train.programs.Programs.eval_step`).
          capacity: place every eval batch at this token capacity (`BatchPlacement.put_local`;
            default: each at the smallest that holds it).
        """
        eval_step = self.eval_step if eval_step is None else eval_step
        outs = [
            jax.device_get(eval_step(params, self.placement.put_local(local, capacity)))
            for local in self.dataset.local_eval_batches(self.placement.shard)
        ]
        out = {key: np.concatenate([o[key] for o in outs]) for key in outs[0]}
        acc = EvalAccumulator(self.dataset.task_names)
        acc.add(out["logits"], out["labels"], out["weights"])
        record = acc.result()
        if baseline:
            record |= item_mean_label_auc(self.dataset, out["candidate_item"], out["labels"], out["weights"])
        return record


def model_factory(dataset_or_spec, config: TrainConfig) -> Callable:
    """`rngs -> GEMModel` for the data set's feature spec and the config's model."""
    spec = getattr(dataset_or_spec, "spec", dataset_or_spec)
    return lambda rngs: GEMModel(spec, config.model, rngs=rngs)


def setup_training(
    config: TrainConfig,
    *,
    dataset: Dataset | None = None,
    devices: Sequence[jax.Device] | None = None,
    init_state: bool = True,
) -> tuple[Training, TrainState | None]:
    """Builds a training job and (optionally) its freshly initialised, sharded train state.

    Args:
      config: the whole job.
      dataset: an already loaded data set (default: `load_dataset(config.data)`).
      devices: the mesh's devices (default: all).
      init_state: False returns None for the state (restore it from a checkpoint
        onto `training.state.abstract` instead, which rebuilds the state's compute copy
        (`gem_jax.train.checkpoint.Checkpointer.restore`), or initialise it later with
        `training.initial_state()`, e.g. while programs compile).

    Returns:
      `(training, state)`.

    Raises:
      RematBudgetError: `ModelConfig.remat.budget_gb` is too small (`gem_jax.train.remat_plan`).
      the errors of `load_dataset`, `make_mesh` and the sharding rules.
    """
    dataset = load_dataset(config.data) if dataset is None else dataset
    mesh = make_mesh(config.topology, devices)
    optimizer = make_optimizer(config.optim)
    factory = model_factory(dataset, config)
    dtype = config.model.compute_dtype
    setup = state_setup(factory, optimizer, mesh, config.rules, compute_dtype=dtype, keep_compute_params=config.optim.keep_compute_params,
                        weights_dtype=config.optim.weights_dtype)
    workload = train_workload(config.model, dataset.spec)
    dataset = dataset.resolve_bbs(num_shards=mesh.devices.size, workload=workload)
    placement = BatchPlacement(mesh, dataset.token_buckets)
    plan = None
    if config.model.remat.budget_gb is not None or config.model.remat.policies:
        costs = measure_step(
            config.model, dataset.spec, setup, *planning_batch(dataset, placement), row_wise_tables=config.optim.sparse_embedding_updates
        )
        plan = plan_remat(costs, config.model.remat)
        setup = dataclasses.replace(setup, graphdef=model_graphdef(dataset.spec, dataclasses.replace(config.model, remat=plan.remat_config)))
    training = Training(
        config=config,
        dataset=dataset,
        mesh=mesh,
        optimizer=optimizer,
        state=setup,
        placement=placement,
        workload=workload,
        train_step=make_train_step(setup, optimizer, placement, sparse_embedding_updates=config.optim.sparse_embedding_updates),
        eval_step=make_eval_step(setup, placement),
        remat_plan=plan,
    )
    return training, training.initial_state() if init_state else None
