"""The training loop: each step reads as data, step, log, checkpoint, eval; time goes to `gem_jax.train.goodput`.

Before the first step every train and eval program the run takes is compiled
(`gem_jax.train.programs`): they are planned and lowered on the state's shapes while a
fresh state is initialised in a thread, then compile in threads while it finishes or the
state is restored. A `Chrono` owns the run's time, a
`TrainWindow` the metrics between two train records (`gem_jax.train.window`).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from gem_jax.batch import validate_ids
from gem_jax.data.pipeline import describe_capacities, load_dataset
from gem_jax.device_memory import peak_memory_gb
from gem_jax.model import flops as flops_lib
from gem_jax.parallel.distributed import check_processes_agree, wait_at_barrier, wait_for_processes
from gem_jax.train import config_tree, disk_space, goodput, run_record
from gem_jax.train.checkpoint import Checkpointer, CheckpointWriteError
from gem_jax.train.config import TrainConfig
from gem_jax.train.divergence import FiniteTracker
from gem_jax.train.executable_cache import ExecutableCache
from gem_jax.train.metric_log import MetricLogger, eval_line, format_metric, train_line
from gem_jax.train.metrics import one_class_note
from gem_jax.train.optimizer import learning_rate_schedule
from gem_jax.train.preemption import Preempted, StopSignals
from gem_jax.train.capacity_plan import planned_capacities
from gem_jax.train.programs import Programs, start_programs
from gem_jax.train.setup import setup_training
from gem_jax.train.window import TrainWindow
from gem_jax.train.workdir_lock import WorkdirLock
from gem_jax.units import format_bytes


def train_and_evaluate(
    config: TrainConfig,
    workdir: str | Path,
    *,
    stop_after_steps: int | None = None,
    force_new: bool = False,
    progress: bool | None = None,
    fallback: bool = True,
    chrono: goodput.Chrono | None = None,
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
      chrono: the run's clock (default: one started now; `gem-train` passes one started
        at the process's start, so that the imports count).

    Returns:
      The final summary record (eval metrics, baseline AUC, throughput, and where the
      wall time went: `time_<bucket>_s`, `wall_s`, `goodput`, `compiles_after_start`;
      `gem_jax.train.goodput`; on a GPU the peak of device memory of this start on the
      busiest device of any process, `device_peak_gb` of `device_limit_gb`). A run stopped
      by `stop_after_steps` before `loop.num_steps` returns it with `finished` False.

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
    chrono = goodput.Chrono() if chrono is None else chrono
    try:
        with WorkdirLock(workdir, jax.process_index()), StopSignals() as signals:
            return _train(config, workdir, signals, chrono, stop_after_steps, force_new, progress, fallback)
    finally:
        chrono.close()


def _train(config, workdir, signals, chrono, stop_after_steps, force_new, progress, fallback) -> dict:
    if force_new:
        # The workdir is shared: process 0 moves the earlier run, the others wait until it has.
        moved = run_record.start_new_run(workdir) if jax.process_index() == 0 else None
        wait_for_processes("gem-train --force-new")
        if moved:
            print(f"gem-train: the earlier run in {workdir} was moved to {moved}")
    with chrono.measure(goodput.DATA):
        dataset = load_dataset(config.data)
    print(dataset.info.summary(), flush=True)
    identity = dataset.info.identity()
    # Before any step: processes with different data would build different global batches or run
    # out at different steps. The path may differ between hosts; the fingerprint compares content.
    check_processes_agree({k: v for k, v in identity.items() if k != "path"}, "data set")
    checkpoint_dir = workdir / "checkpoints"
    has_checkpoints = checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir())
    primary = jax.process_index() == 0  # writes the run record and the metrics of the shared workdir
    record = run_record.make_record(config, identity, dataset.spec)
    # Checked now, written once the checkpoint preflight passes: a run refused there leaves no record
    # that would refuse the same workdir's next start with the changed settings it asked for.
    run_record.check_run(workdir, record, has_checkpoints=has_checkpoints, write=False)
    checkpointer = Checkpointer(checkpoint_dir, config.checkpoint)
    logger, progress_bar, write_error, programs = None, None, None, None
    try:
        latest = checkpointer.latest_step()
        dataset.prefetch_train_order(latest or 0)  # its epoch's shuffle (seconds at 100M examples) beside the set-up below
        num_steps = config.loop.num_steps
        run_record.check_num_steps(num_steps, latest, checkpoint_dir)
        quarantine = workdir / run_record.QUARANTINE_DIR
        run_record.check_not_restarting_lost_run(workdir, latest, quarantine)
        with chrono.measure(goodput.INIT):  # the job without its state: it is initialised or restored while the programs compile
            training, _ = setup_training(config, dataset=dataset, init_state=False)
        _describe(training)
        for line in checkpointer.preflight(training.state.abstract):  # refuses a run whose checkpoints cannot fit
            print(f"gem-train: {line}", flush=True)
        run_record.check_run(workdir, record, has_checkpoints=has_checkpoints, write=primary)
        dataset = training.dataset
        train_iter = dataset.local_train_iterator(training.placement.shard)

        def last_step_from(start: int) -> int:
            return num_steps if stop_after_steps is None else min(num_steps, start + stop_after_steps)

        # A fresh state is initialised, or the newest checkpoint restored, in a thread while the capacity plan
        # waits for the data order and the programs are lowered or loaded (the thread's trace is short; its
        # compile, its run and the restore's reads release the GIL).
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gem-state") as state_thread:
            if latest is None:
                ready, bucket = state_thread.submit(training.initial_state), goodput.INIT
            else:
                ready = state_thread.submit(checkpointer.restore_latest, training.state.abstract, train_iter, quarantine_dir=quarantine, fallback=fallback)
                bucket = goodput.RESTORE
            # Planned from the newest checkpoint: should the restore fall back to an older one, a batch of the
            # steps between needing an unplanned capacity is compiled when it comes (`Programs.train_step`).
            planned = latest or 0
            programs = _start_programs(training, range(planned, last_step_from(planned)), last_step_from(planned), chrono)
            with chrono.measure(bucket):  # what is left of it: the programs compile meanwhile
                outcome = ready.result()
        state, restored = (outcome, None) if latest is None else (None, outcome)
        start = 0
        if restored:
            start, state = restored
            if start >= num_steps:
                print(f"gem-train: the run finished at step {start} ({checkpointer.step_path(start)}); reporting its summary", flush=True)
            else:
                print(f"gem-train: resuming from step {start} ({checkpointer.step_path(start)})", flush=True)

        last_step = last_step_from(start)
        trains = start < last_step  # False for a finished run started again: it only re-reports
        learning_rate = learning_rate_schedule(config.optim)
        _finish_programs(programs, start, chrono, learning_rate)

        def last_good() -> str:
            step = checkpointer.latest_step()
            return f"step {step} ({checkpointer.step_path(step)})" if step is not None else "none (no checkpoint was written)"

        peak = flops_lib.peak_flops()
        finite = FiniteTracker()
        window = TrainWindow(training.workload, training.mesh.devices.size, dataset.task_names, training.state.plan.tables, peak)
        logger = MetricLogger(workdir, resume_step=start, write=primary) if trains else None
        record: dict = {}
        steady = {"seconds": 0.0, "flops": 0.0, "examples": 0}  # every log window after the run's first
        window_start, window_time = chrono.snapshot(), chrono.wall()
        progress_bar = tqdm(total=num_steps, initial=start, desc="train", unit="step", dynamic_ncols=True, disable=not (sys.stdout.isatty() if progress is None else progress))
        done, stopped = start, False
        try:
            for step in range(start, last_step):
                if signals.stop_requested():
                    stopped = True
                    break
                with chrono.measure(goodput.DATA_WAIT):
                    local = next(train_iter)  # this process's part of the global batch
                with chrono.measure(goodput.TRAIN_STEP):
                    validate_ids(local.batch, dataset.spec, where=f"train batch {step}")
                    placed = training.placement.put_local(local, programs.train_capacity(local))
                    state, step_metrics = programs.train_step(state, placed)
                    window.add(local, placed, step_metrics)
                    done = step + 1
                    finite.update(done, step_metrics)
                if done % config.loop.log_every == 0 or done == last_step:
                    with chrono.measure(goodput.TRAIN_STEP):  # the window's steps finish here: asynchronous dispatch
                        finite.check(last_good())
                        fetched, window_flops, window_examples = window.fetch(), window.flops, window.examples
                    seconds = {k: v - window_start[k] for k, v in chrono.snapshot().items()}
                    step_seconds = seconds[goodput.TRAIN_STEP] + seconds[goodput.DATA_WAIT]
                    with chrono.measure(goodput.LOGGING):
                        record = window.record(fetched, done, step_seconds, float(learning_rate(done - 1)))
                        wall = chrono.wall()
                        record.update(
                            time_steps_s=step_seconds,
                            data_wait_s=seconds[goodput.DATA_WAIT],
                            window_goodput=seconds[goodput.TRAIN_STEP] / (wall - window_time),
                            goodput=chrono.seconds()[goodput.TRAIN_STEP] / wall,
                        )
                        logger.log(done, "train", record)
                        progress_bar.set_postfix(loss=f"{record['loss']:.4f}", ne=format_metric(record[f"ne_{dataset.task_names[0]}"], ".3f"))
                        tqdm.write(train_line(done, record, dataset.task_names))
                    if done - len(fetched) > start:  # the run's first window holds the first steps' start-up: not steady state
                        steady["seconds"] += step_seconds
                        steady["flops"] += window_flops
                        steady["examples"] += window_examples
                    window_start, window_time = chrono.snapshot(), chrono.wall()
                if checkpointer.should_save(done):
                    with chrono.measure(goodput.CHECKPOINT):
                        finite.check(last_good())
                        checkpointer.save(done, state, train_iter)
                if config.loop.eval_every and done % config.loop.eval_every == 0 and done != num_steps:
                    with chrono.measure(goodput.EVAL):
                        eval_record = training.evaluate(state.params, eval_step=programs.eval_step, capacity=programs.eval_capacity)
                    logger.log(done, "eval", eval_record)
                    tqdm.write(eval_line(done, eval_record, dataset.task_names))
                progress_bar.update(1)
                if step == start:
                    chrono.watch_compiles()  # from here on every compile is one the run should not need

            with chrono.measure(goodput.CHECKPOINT):
                if done and checkpointer.latest_step() != done:
                    finite.check(last_good())
                    checkpointer.save(done, state, train_iter, force=True)
                checkpointer.close()
        except CheckpointWriteError as error:  # e.g. the disk filled up: end with a summary of what was saved
            write_error = error
        final_step = done

        if write_error is None and (stopped or signals.stop_requested()):
            raise Preempted(final_step, signals.signal_name, last_good())

        summary = {"step": final_step, "finished": final_step == num_steps and write_error is None}
        if write_error is not None:
            summary.update(checkpoint_error=str(write_error), last_good_step=write_error.last_good_step)
        eval_keys: set[str] = set()
        if final_step == num_steps and write_error is None:
            with chrono.measure(goodput.EVAL):
                eval_record = training.evaluate(state.params, baseline=True, eval_step=programs.eval_step, capacity=programs.eval_capacity)
            eval_keys = set(eval_record)
            summary.update(eval_record)
            if (note := one_class_note(eval_record, dataset.task_names)) is not None:
                print(f"gem-train: step {final_step}: {note}", flush=True)
            if trains:
                logger.log(final_step, "eval", eval_record)
        if steady["seconds"]:
            summary["train_examples_per_s"] = steady["examples"] / steady["seconds"]
            summary["train_tflops_per_s"] = steady["flops"] / steady["seconds"] / 1e12
            if peak:
                summary["mfu"] = steady["flops"] / steady["seconds"] / peak
        summary.update({k: v for k, v in record.items() if k in ("loss",)})
        programs.close()  # compiles still in flight end before the run's time is read
        summary.update(checkpointer.report())
        summary.update(programs.report())
        summary.update(peak_device_memory())
        summary.update(chrono.record())
        if trains:
            logger.log(final_step, "summary", summary, not_in_tensorboard=eval_keys)
    finally:
        if programs is not None:
            programs.close()
        if progress_bar is not None:
            progress_bar.close()
        try:
            checkpointer.close()
        except CheckpointWriteError:
            if write_error is None:  # a failure the loop has not reported yet
                raise
        if logger is not None:
            logger.close()
    print_summary(summary, chrono, outputs(workdir) if trains else {})
    if "checkpoint_final_write_s" in summary:
        print(f"gem-train: the final checkpoint took {summary['checkpoint_final_write_s']:.1f} s to write", flush=True)
    if write_error is not None:
        raise write_error
    return summary


def _describe(training) -> None:
    """The start-up lines about the job: the remat plan, the embedding exchanges, the token capacities."""
    if training.remat_plan is not None:
        print(f"gem-train: rematerialization plan\n{training.remat_plan.table()}", flush=True)
    for line in training.describe_exchanges():
        print(f"gem-train: {line}", flush=True)
    print(f"gem-train: {describe_capacities(training.dataset.token_buckets, training.per_device_batch)}", flush=True)


def _start_programs(training, train_steps: range, last_step: int, chrono) -> Programs:
    """Every train and eval program the steps `train_steps` and their evals run, lowered now and
    compiling in threads when it returns (`gem_jax.train.programs.start_programs`; `_finish_programs` waits)."""
    loop = training.config.loop
    periodic = loop.eval_every and any(step % loop.eval_every == 0 and step != loop.num_steps for step in range(train_steps.start + 1, last_step + 1))
    with chrono.measure(goodput.DATA):
        train, evals = planned_capacities(training, train_steps, evaluates=bool(periodic) or last_step == loop.num_steps)
    # Compiled programs beside jax's cache (off with it). Not on the CPU: an XLA:CPU executable loaded in
    # another process can fail to run ("Function wrapped_broadcast not found", jax 0.11.2).
    cache = jax.config.jax_compilation_cache_dir if jax.default_backend() != "cpu" else None
    background = loop.compile_in_background
    if background and jax.process_count() > 1:
        print("gem-train: loop.compile_in_background is ignored in a multi-process run (every process must place a batch alike)", flush=True)
        background = False
    return start_programs(training, train, evals, chrono=chrono, cache=ExecutableCache(cache) if cache else None, background=background)


def _finish_programs(programs: Programs, start: int, chrono, learning_rate) -> None:
    """Waits for `programs`' compiles (`Programs.finish`), compiles the learning-rate schedule's host-side
    ops (for step `start`), and waits for the other processes; all in `startup/compile`."""
    programs.finish()
    with chrono.measure(goodput.COMPILE):
        float(learning_rate(start))  # the schedule's host-side ops compile on first use
        wait_at_barrier("gem-train: programs compiled")  # processes finish compiling at different times
    print(f"gem-train: {programs.describe()}", flush=True)


def dry_run(config: TrainConfig, workdir: str | Path, force_new: bool = False) -> dict:
    """What `train_and_evaluate(config, workdir, force_new=force_new)` would run, printed, without compiling,
    training or writing.

    Prints the resolved config, the data set's summary, what the start would do with the run the
    workdir holds (resume from its newest checkpoint, or, with `force_new`, move it aside), the
    start-up lines about the job (remat plan, exchanges, token capacities), the token capacities
    of the train programs for the steps left and of the eval programs, the size of a checkpoint
    and the disk preflight (`gem_jax.train.disk_space`: whether the kept copies fit).

    Returns:
      `{"start_step", "train_capacities", "eval_capacities", "checkpoint_bytes"}` (the step the run
      would continue after, 0 for a new run; the last: bytes of the `params` and `opt_state` arrays
      and of one written `copy`, `gem_jax.train.disk_space`).

    Raises:
      RunMismatchError: the start would be refused for what the workdir holds (another config or
        data set, checkpoints without a run record, loop.num_steps below the newest checkpoint).
    """
    print("gem-train: resolved config\n" + json.dumps(config_tree.to_tree(config), indent=2), flush=True)
    dataset = load_dataset(config.data)
    print(dataset.info.summary(), flush=True)
    checkpoint_dir = Path(workdir) / "checkpoints"
    held = sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit()) if checkpoint_dir.is_dir() else []
    start = _dry_run_start(config, Path(workdir), dataset, held, force_new)
    training, _ = setup_training(config, dataset=dataset, init_state=False)
    _describe(training)
    train, evals = planned_capacities(training, range(start, config.loop.num_steps), evaluates=True)
    abstract = training.state.abstract
    sizes = {"params": disk_space.array_bytes(abstract.params), "opt_state": disk_space.array_bytes(abstract.opt_state)}
    plan = disk_space.plan_space(abstract.checkpointed(), config.checkpoint.max_to_keep, 0 if force_new else len(held), checkpoint_dir,
                                 float32_matrices=disk_space.float32_matrices(abstract))
    steps = ", ".join(f"{capacity} ({count} steps)" for capacity, count in train.items())
    print(
        f"gem-train: would compile {len(train) + len(evals)} programs: train steps at token capacities {steps} "
        f"(the batches of steps {start + 1} to {config.loop.num_steps}), the eval step at {list(evals)}",
        flush=True,
    )
    print(
        f"gem-train: a checkpoint holds parameters {format_bytes(sizes['params'])}, optimizer state "
        f"{format_bytes(sizes['opt_state'])} and the data iterator's position; {config.checkpoint.max_to_keep} kept in {checkpoint_dir}",
        flush=True,
    )
    for line in plan.lines():
        print(f"gem-train: {line}", flush=True)
    try:
        plan.check()
    except disk_space.CheckpointSpaceError as error:
        print(f"gem-train: the run would be refused: {error}", flush=True)
    return {"start_step": start, "train_capacities": tuple(train), "eval_capacities": evals, "checkpoint_bytes": sizes | {"copy": plan.copy_bytes}}


def _dry_run_start(config: TrainConfig, workdir: Path, dataset, held: list[int], force_new: bool) -> int:
    """The step a start in `workdir`, whose checkpoint folder holds the finished steps `held` (ascending), would
    continue after (0: a new run), checked and said as the start checks what the workdir holds (`_train`); reads only.

    Raises:
      RunMismatchError: as the start would raise it.
    """
    checkpoint_dir = workdir / "checkpoints"
    if force_new:
        if run_record.read_record(workdir) is not None or held:
            print(f"gem-train: --force-new: the run in {workdir} would be moved to {workdir / run_record.ARCHIVE_DIR}/<time> and a new one started", flush=True)
        return 0
    record = run_record.make_record(config, dataset.info.identity(), dataset.spec)
    run_record.check_run(workdir, record, has_checkpoints=checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir()), write=False)
    latest = held[-1] if held else None
    run_record.check_num_steps(config.loop.num_steps, latest, checkpoint_dir)
    run_record.check_not_restarting_lost_run(workdir, latest, workdir / run_record.QUARANTINE_DIR)
    if latest is not None:
        print(
            f"gem-train: {workdir} holds this run: it would resume from its newest checkpoint, step {latest} "
            f"({checkpoint_dir / str(latest)}; one found corrupt is moved aside for the next older)",
            flush=True,
        )
    return latest or 0


def outputs(workdir: Path) -> dict[str, Path]:
    """Where a run in `workdir` writes: metrics, TensorBoard logs, checkpoints, the run record."""
    return {
        "metrics": workdir / "metrics.jsonl",
        "tensorboard": workdir / "tensorboard",
        "checkpoints": workdir / "checkpoints",
        "run record": workdir / run_record.RUN_FILE,
    }


def peak_device_memory() -> dict[str, float]:
    """`peak_memory_gb` over every process's devices (each process's own, then the largest, through one
    all-gather that every process of a multi-process run reaches); {} on the CPU. Memory statistics count from
    the process's start: a resumed run reports the peak of this start."""
    local = peak_memory_gb(jax.local_devices())
    if jax.process_count() == 1 or not local:
        return local
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.array([local["device_peak_gb"], local["device_limit_gb"]]))
    peak, limit = max(map(tuple, np.asarray(gathered).reshape(-1, 2).tolist()))
    return {"device_peak_gb": peak, "device_limit_gb": limit}


def print_summary(summary: dict, chrono: goodput.Chrono | None = None, written: dict[str, Path] | None = None) -> None:
    """Prints the summary record as a two-column table (the time split apart, from `chrono`), then where the outputs went."""
    table = Table(title="gem-jax run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    timing = set(chrono.record()) if chrono is not None else set()
    for key, value in summary.items():
        if key not in timing:
            table.add_row(key, format_metric(value, ".4f") if value is None or isinstance(value, float) else str(value))
    console = Console()
    console.print(table)
    if chrono is not None:
        print("where the wall time went (from process start):\n  " + "\n  ".join(chrono.table()), flush=True)
    for name, path in (written or {}).items():
        print(f"gem-train: {name}: {path}", flush=True)
