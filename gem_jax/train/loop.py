"""The training loop: sharded state, jitted steps, eval, checkpoints, metrics, MFU."""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from gem_jax.config import TrainConfig
from gem_jax.data.batch import validate_ids
from gem_jax.data.pipeline import Dataset, load_dataset
from gem_jax.data.workload import Workload, load_imbalance, padding_waste, shard_loads
from gem_jax.model.gem import GEMModel
from gem_jax.parallel.batch import BatchPlacement
from gem_jax.parallel.embeddings import check_lookup_stats
from gem_jax.parallel.mesh import make_mesh
from gem_jax.train import flops as flops_lib
from gem_jax.train.baseline import item_mean_label_auc
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.metric_log import MetricLogger
from gem_jax.train.metrics import EvalAccumulator
from gem_jax.train.optimizer import make_optimizer
from gem_jax.train.state import create_train_state
from gem_jax.train.step import make_eval_step, make_train_step


class NonFiniteLossError(FloatingPointError):
    """The training loss or gradient norm became NaN or Inf."""


def evaluate(eval_step, params, dataset: Dataset, placement: BatchPlacement) -> dict[str, float]:
    """Runs the model over every eval example once; per-task AUC, NE and BCE."""
    acc = EvalAccumulator(dataset.task_names)
    for batch in dataset.eval_batches():
        logits = eval_step(params, placement.put(batch))
        acc.add(logits, batch.labels, batch.weights)
    return acc.result()


def train_and_evaluate(config: TrainConfig, workdir: str | Path, *, stop_after_steps: int | None = None) -> dict:
    """Trains `config` in `workdir`, resuming from its latest checkpoint if any.

    Args:
      config: the whole job.
      workdir: checkpoints, `metrics.jsonl` and TensorBoard logs go here.
      stop_after_steps: stop this run after so many steps (a checkpoint is saved),
        as a preemption would; the same call again resumes.

    Returns:
      The final summary record (eval metrics, baseline AUC, throughput).

    Raises:
      NonFiniteLossError: the loss or gradient norm became non-finite (the step
        window is named).
    """
    workdir = Path(workdir)
    dataset = load_dataset(config.data)
    spec = dataset.spec
    mesh = make_mesh(config.topology)
    optimizer = make_optimizer(config.optim)
    state, setup = create_train_state(
        lambda rngs: GEMModel(spec, config.model, rngs=rngs),
        optimizer,
        mesh,
        config.rules,
        config.loop.seed,
        compute_dtype=config.model.compute_dtype,
    )
    flop_model = flops_lib.flop_model(config.model, spec)
    workload = Workload.from_flop_model(flop_model)
    num_shards = mesh.devices.size
    dataset = dataset.resolve_bbs(num_shards=num_shards, workload=workload)
    train_iter = dataset.train_iterator()
    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    start = checkpointer.latest_step() or 0
    if start:
        state = checkpointer.restore(start, setup.abstract, train_iter)

    peak = flops_lib.peak_flops()
    sharding = BatchPlacement(mesh)  # one local jagged batch per device, stacked (gem_jax.parallel.batch)
    train_step = make_train_step(setup, optimizer, sharding)
    eval_step = make_eval_step(setup, sharding)

    num_steps = config.loop.num_steps
    last_step = num_steps if stop_after_steps is None else min(num_steps, start + stop_after_steps)
    trains = start < last_step  # False for a finished run started again: it only re-reports
    logger = MetricLogger(workdir) if trains else None
    window_metrics, window_flops, window_examples, window_imbalance, window_waste = [], 0.0, 0, [], []
    window_start, train_seconds, train_flops, train_examples = time.perf_counter(), 0.0, 0.0, 0
    record: dict = {}
    progress = tqdm(total=num_steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    for step in range(start, last_step):
        batch = next(train_iter)
        validate_ids(batch, spec, where=f"train batch {step}")
        real = np.asarray(batch.weights) > 0
        all_lengths = np.diff(np.asarray(batch.history.offsets))
        lengths = all_lengths[real]
        window_flops += flop_model.train(lengths)
        window_examples += int(real.sum())
        # Balance across the devices' contiguous chunks; padding against the placed token slots.
        window_imbalance.append(load_imbalance(shard_loads(workload(all_lengths) * real, num_shards)))
        placed = sharding.put(batch)
        window_waste.append(padding_waste(lengths, math.prod(placed.history.values.shape[:-1])))
        state, step_metrics = train_step(state, placed)
        window_metrics.append(step_metrics)
        done = step + 1
        if done % config.loop.log_every == 0 or done == last_step:
            fetched = jax.device_get(window_metrics)
            elapsed = time.perf_counter() - window_start
            record = _train_record(fetched, dataset.task_names, elapsed, window_flops, window_examples, peak)
            record.update(
                load_imbalance_mean=float(np.mean(window_imbalance)),
                load_imbalance_max=float(np.max(window_imbalance)),
                padding_waste=float(np.mean(window_waste)),
            )
            if not all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in fetched):
                raise NonFiniteLossError(f"non-finite loss or gradient norm in steps {done - len(fetched) + 1}..{done}")
            for offset, step_metrics in enumerate(fetched):
                check_lookup_stats(step_metrics, setup.plan.tables, where=f"train step {done - len(fetched) + offset + 1}")
            record.update(_lookup_counters(fetched))
            logger.log(done, "train", record)
            progress.set_postfix(loss=f"{record['loss']:.4f}", ne=f"{record[f'ne_{dataset.task_names[0]}']:.3f}")
            tqdm.write(f"step {done}: " + ", ".join(f"{k}={v:.4g}" for k, v in record.items()))
            if done - len(fetched) > start:  # the run's first window holds the compile: not steady state
                train_seconds += elapsed
                train_flops += window_flops
                train_examples += window_examples
            window_metrics, window_flops, window_examples, window_imbalance, window_waste = [], 0.0, 0, [], []
            window_start = time.perf_counter()
        checkpointer.save(done, state, train_iter)
        if config.loop.eval_every and done % config.loop.eval_every == 0 and done != num_steps:
            eval_record = evaluate(eval_step, state.params, dataset, sharding)
            logger.log(done, "eval", eval_record)
            tqdm.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in eval_record.items() if isinstance(v, float)))
            window_start = time.perf_counter()
        progress.update(1)
    progress.close()

    final_step = last_step
    if checkpointer.latest_step() != final_step:
        checkpointer.save(final_step, state, train_iter, force=True)
    checkpointer.close()
    summary = {"step": final_step, "finished": final_step == num_steps}
    if final_step == num_steps:
        summary.update(evaluate(eval_step, state.params, dataset, sharding))
        summary.update(item_mean_label_auc(dataset))
        if trains:
            logger.log(final_step, "eval", summary)
    if train_seconds:  # steady state: every log window after the first
        summary["train_examples_per_s"] = train_examples / train_seconds
        summary["train_tflops_per_s"] = train_flops / train_seconds / 1e12
        if peak:
            summary["mfu"] = train_flops / train_seconds / peak
    summary.update({k: v for k, v in record.items() if k in ("loss",)})
    if trains:
        logger.log(final_step, "summary", summary)
        logger.close()
    print_summary(summary)
    return summary


def _lookup_counters(window: list[dict]) -> dict[str, int]:
    """The embedding lookups' `<table>/overflow` and `<table>/out_of_range` counts, summed over the window."""
    keys = [k for k in window[0] if k.endswith(("/overflow", "/out_of_range"))]
    return {k: int(sum(int(m[k]) for m in window)) for k in keys}


def _train_record(window: list[dict], task_names, elapsed: float, flops: float, examples: int, peak: float | None) -> dict:
    mean = {k: np.mean([np.asarray(m[k]) for m in window], axis=0) for k in ("loss", "grad_norm", "bce", "ne")}
    record = {"loss": float(mean["loss"]), "grad_norm": float(mean["grad_norm"])}
    for k, name in enumerate(task_names):
        record[f"bce_{name}"] = float(mean["bce"][k])
        record[f"ne_{name}"] = float(mean["ne"][k])
    record["examples_per_s"] = examples / elapsed
    record["tflops_per_s"] = flops / elapsed / 1e12
    if peak:
        record["mfu"] = flops / elapsed / peak
    return record


def print_summary(summary: dict) -> None:
    """Prints the summary record as a two-column table."""
    table = Table(title="gem-jax run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
