"""The training loop: sharded state, jitted steps, eval, checkpoints, metrics, MFU."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from gem_jax.batch import validate_ids
from gem_jax.data.balance import load_imbalance, padding_waste, shard_loads
from gem_jax.data.pipeline import describe_capacities, load_dataset
from gem_jax.model import flops as flops_lib
from gem_jax.nn.embeddings import check_lookup_stats
from gem_jax.parallel.distributed import check_processes_agree, wait_for_processes
from gem_jax.train import run_record
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.config import TrainConfig
from gem_jax.train.divergence import FiniteTracker
from gem_jax.train.metric_log import MetricLogger, train_line
from gem_jax.train.optimizer import learning_rate_schedule
from gem_jax.train.preemption import Preempted, StopSignals
from gem_jax.train.setup import setup_training
from gem_jax.train.workdir_lock import WorkdirLock


def train_and_evaluate(
    config: TrainConfig,
    workdir: str | Path,
    *,
    stop_after_steps: int | None = None,
    force_new: bool = False,
    progress: bool | None = None,
    fallback: bool = True,
) -> dict:
    """Trains `config` in `workdir`, resuming from its latest intact checkpoint if any.

    While it runs, SIGTERM, SIGINT and SIGUSR1 stop it after the current step with a
    synchronous checkpoint (`gem_jax.train.preemption`); a second signal aborts.

    Args:
      config: the whole job.
      workdir: checkpoints, `metrics.jsonl`, TensorBoard logs and the run record
        (`run.json`: resolved config, data identity, code version) go here.
      stop_after_steps: stop this run after so many steps (a checkpoint is saved),
        as a preemption would; the same call again resumes.
      force_new: start a new run even if `workdir` holds one with another config
        (its files are moved to `workdir/previous_runs/<time>/`, by process 0 alone;
        the other processes wait for it).
      progress: show a progress bar (default: when stdout is a terminal).
      fallback: when the newest checkpoint is corrupt, move it to
        `workdir/corrupt_checkpoints/` and resume from the newest intact one
        (False: refuse).

    Returns:
      The final summary record (eval metrics, baseline AUC, throughput).

    In a multi-process run every process calls it with the same arguments; each
    builds only its devices' part of every batch (`gem_jax.data.shard`), and process
    0 writes the run record and the metrics.

    Raises:
      ProcessMismatchError: the processes of a multi-process run loaded different
        data sets (each differing process and field named); nothing is trained.
      WorkdirLockedError: another run holds `workdir` (host and pid named).
      RunMismatchError: `workdir` holds a run whose config or data set differ (the
        fields are named), or `loop.num_steps` is below its newest checkpoint;
        nothing in the workdir is changed.
      CorruptCheckpointError: the newest checkpoint is corrupt and `fallback` is
        False, or no checkpoint is intact (paths named).
      NonFiniteLossError: the loss or gradient norm became non-finite (the step and
        the last good checkpoint are named; no later checkpoint is written).
      Preempted: a stop signal arrived; the checkpoint of the last finished step is saved.
    """
    workdir = Path(workdir)
    with WorkdirLock(workdir, jax.process_index()), StopSignals() as signals:
        return _train(config, workdir, signals, stop_after_steps, force_new, progress, fallback)


def _train(config, workdir, signals, stop_after_steps, force_new, progress, fallback) -> dict:
    if force_new:
        # The workdir is shared: process 0 moves the earlier run, the others wait until it has.
        moved = run_record.start_new_run(workdir) if jax.process_index() == 0 else None
        wait_for_processes("gem-train --force-new")
        if moved:
            print(f"gem-train: the earlier run in {workdir} was moved to {moved}")
    dataset = load_dataset(config.data)
    print(dataset.info.summary(), flush=True)
    identity = dataset.info.identity()
    # Before any step: processes with different data would build different global batches or run
    # out at different steps. The path may differ between hosts; the fingerprint compares content.
    check_processes_agree({k: v for k, v in identity.items() if k != "path"}, "data set")
    checkpoint_dir = workdir / "checkpoints"
    has_checkpoints = checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir())
    primary = jax.process_index() == 0  # writes the run record and the metrics of the shared workdir
    run_record.check_run(workdir, run_record.make_record(config, identity, dataset.spec), has_checkpoints=has_checkpoints, write=primary)
    checkpointer = Checkpointer(checkpoint_dir, config.checkpoint)
    logger, progress_bar = None, None
    try:
        run_record.check_num_steps(config.loop.num_steps, checkpointer.latest_step(), checkpoint_dir)
        training, state = setup_training(config, dataset=dataset)
        if training.remat_plan is not None:
            print(f"gem-train: rematerialization plan\n{training.remat_plan.table()}", flush=True)
        dataset, setup, workload, sharding = training.dataset, training.state, training.workload, training.placement
        for line in training.describe_exchanges():
            print(f"gem-train: {line}", flush=True)
        spec = dataset.spec
        num_shards = training.mesh.devices.size
        print(f"gem-train: {describe_capacities(dataset.token_buckets, training.per_device_batch)}", flush=True)
        train_iter = dataset.local_train_iterator(sharding.shard)
        restored = checkpointer.restore_latest(setup.abstract, train_iter, quarantine_dir=workdir / "corrupt_checkpoints", fallback=fallback)
        start = 0
        if restored:
            start, state = restored
            if start >= config.loop.num_steps:
                print(f"gem-train: the run finished at step {start} ({checkpointer.step_path(start)}); reporting its summary", flush=True)
            else:
                print(f"gem-train: resuming from step {start} ({checkpointer.step_path(start)})", flush=True)

        peak = flops_lib.peak_flops()
        train_step = training.train_step
        learning_rate = learning_rate_schedule(config.optim)
        finite = FiniteTracker()

        def last_good() -> str:
            step = checkpointer.latest_step()
            return f"step {step} ({checkpointer.step_path(step)})" if step is not None else "none (no checkpoint was written)"

        num_steps = config.loop.num_steps
        last_step = num_steps if stop_after_steps is None else min(num_steps, start + stop_after_steps)
        trains = start < last_step  # False for a finished run started again: it only re-reports
        logger = MetricLogger(workdir, resume_step=start, write=primary) if trains else None
        window_metrics, window_flops, window_examples, window_imbalance, window_slack = [], 0.0, 0, [], []
        window_start, train_seconds, train_flops, train_examples = time.perf_counter(), 0.0, 0.0, 0
        record: dict = {}
        progress_bar = tqdm(total=num_steps, initial=start, desc="train", unit="step", dynamic_ncols=True, disable=not (sys.stdout.isatty() if progress is None else progress))
        done, stopped = start, False
        for step in range(start, last_step):
            if signals.stop_requested():
                stopped = True
                break
            local = next(train_iter)  # this process's part of the global batch
            validate_ids(local.batch, spec, where=f"train batch {step}")
            real, all_lengths = local.real, local.lengths  # of the global batch
            lengths = all_lengths[real]
            window_flops += workload.total(lengths)
            window_examples += local.num_real
            # Balance across the devices' contiguous chunks; slack: 1 - real rows / placed rows (D x T_local).
            window_imbalance.append(load_imbalance(shard_loads(workload(all_lengths) * real, num_shards)))
            placed = sharding.put_local(local)
            window_slack.append(padding_waste(lengths, math.prod(placed.history.values.shape[:-1])))
            state, step_metrics = train_step(state, placed)
            window_metrics.append(step_metrics)
            done = step + 1
            finite.update(done, step_metrics)
            if done % config.loop.log_every == 0 or done == last_step:
                finite.check(last_good())
                fetched = jax.device_get(window_metrics)
                elapsed = time.perf_counter() - window_start
                record = _train_record(fetched, dataset.task_names, elapsed, window_flops, window_examples, peak)
                record.update(
                    learning_rate=float(learning_rate(done - 1)),
                    load_imbalance_mean=float(np.mean(window_imbalance)),
                    load_imbalance_max=float(np.max(window_imbalance)),
                    slack_fraction=float(np.mean(window_slack)),
                )
                for offset, step_metrics in enumerate(fetched):
                    check_lookup_stats(step_metrics, setup.plan.tables, where=f"train step {done - len(fetched) + offset + 1}")
                record.update(_lookup_counters(fetched))
                logger.log(done, "train", record)
                progress_bar.set_postfix(loss=f"{record['loss']:.4f}", ne=f"{record[f'ne_{dataset.task_names[0]}']:.3f}")
                tqdm.write(train_line(done, record, dataset.task_names))
                if done - len(fetched) > start:  # the run's first window holds the compile: not steady state
                    train_seconds += elapsed
                    train_flops += window_flops
                    train_examples += window_examples
                window_metrics, window_flops, window_examples, window_imbalance, window_slack = [], 0.0, 0, [], []
                window_start = time.perf_counter()
            if checkpointer.should_save(done):
                finite.check(last_good())
                checkpointer.save(done, state, train_iter)
            if config.loop.eval_every and done % config.loop.eval_every == 0 and done != num_steps:
                eval_record = training.evaluate(state.params)
                logger.log(done, "eval", eval_record)
                tqdm.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in eval_record.items() if isinstance(v, float)))
                window_start = time.perf_counter()
            progress_bar.update(1)

        final_step = done
        if final_step and checkpointer.latest_step() != final_step:
            finite.check(last_good())
            checkpointer.save(final_step, state, train_iter, force=True)
        checkpointer.wait()
        if stopped or signals.stop_requested():
            raise Preempted(final_step, signals.signal_name, last_good())

        summary = {"step": final_step, "finished": final_step == num_steps}
        eval_keys: set[str] = set()
        if final_step == num_steps:
            eval_record = training.evaluate(state.params, baseline=True)
            eval_keys = set(eval_record)
            summary.update(eval_record)
            if trains:
                logger.log(final_step, "eval", eval_record)
        if train_seconds:  # steady state: every log window after the first
            summary["train_examples_per_s"] = train_examples / train_seconds
            summary["train_tflops_per_s"] = train_flops / train_seconds / 1e12
            if peak:
                summary["mfu"] = train_flops / train_seconds / peak
        summary.update({k: v for k, v in record.items() if k in ("loss",)})
        if trains:
            logger.log(final_step, "summary", summary, not_in_tensorboard=eval_keys)
    finally:
        if progress_bar is not None:
            progress_bar.close()
        checkpointer.close()
        if logger is not None:
            logger.close()
    print_summary(summary)
    return summary


def _lookup_counters(window: list[dict]) -> dict[str, int | float]:
    """The embedding lookups' `<table>/overflow` and `<table>/out_of_range` counts, summed over the window,
    and their exchanges' `<table>/sent_rows` and `<table>/sent_bytes`, per step (the window's mean)."""
    counts = {k: int(sum(int(m[k]) for m in window)) for k in window[0] if k.endswith(("/overflow", "/out_of_range"))}
    return counts | {k: float(np.mean([m[k] for m in window])) for k in window[0] if k.endswith(("/sent_rows", "/sent_bytes"))}


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
