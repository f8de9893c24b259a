"""Command-line entry point: `gem-train` (also `python -m gem_jax.cli`)."""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from gem_jax.checks import output_directory_problem, positive_int
from gem_jax.device_memory import claim_device_memory, device_memory_share, fragmentation_note, is_out_of_memory
from gem_jax.xla_options import add_project_flags

CHECKPOINT_WRITE_EXIT_CODE = 4  # a save failed (disk full): the run ended with its summary, the last good step intact
OUT_OF_MEMORY_EXIT_CODE = 5  # the device ran out of memory: the checkpoints already written are kept
RESUME = "run the same command again to resume"
RESUME_WITHOUT_FORCE_NEW = "run the same command without --force-new to resume (with it, the run would start over)"


class _ConfigFields(argparse.Action):
    """`--help-config`: prints every config field with its type, default and meaning, then exits (imports the config schema)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from gem_jax.train import config_tree
        from gem_jax.train.config import TrainConfig

        # wrapped as argparse wraps --help: to the terminal's width less 2, here less the 2 of the indent below
        width = max(shutil.get_terminal_size().columns - 4, 40)
        print("config fields for --set (path: type = default of the schema; a config file sets its own):")
        print("\n".join(f"  {line}" for line in config_tree.override_help(TrainConfig, width=width)))
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    # Nothing here imports jax or the train stack: `gem-train --help` answers at once.
    return argparse.ArgumentParser(
        prog="gem-train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train a GEM-style model; a restart with the same command resumes from the workdir's latest checkpoint.\n\n"
            "Multi-host: one process per GPU; jax.distributed is initialised from SLURM or from "
            "GEM_COORDINATOR_ADDRESS / GEM_NUM_PROCESSES / GEM_PROCESS_ID (scripts/launch_slurm.sh)."
        ),
        epilog=(
            "gem-train --help-config lists every config field --set takes, with its type, default and meaning.\n\n"
            "example: gem-train --config configs/movielens.py --workdir runs/lr --set optim.learning_rate=3e-3 loop.num_steps=800\n\n"
            "outputs in WORKDIR: metrics.jsonl (train, eval and summary records; the summary splits the wall time from "
            "process start into start-up, train steps, data waits, eval, checkpoints, restore and compiles, and gives "
            "goodput = train-step time / wall time), tensorboard/, checkpoints/, run.json.\n\n"
            "SIGTERM, SIGINT and SIGUSR1 stop after the current step with a checkpoint (a second signal aborts).\n"
            "exit status: 0 the run is finished (or --dry-run); 2 refused (bad arguments or config, workdir in use or holding another run, "
            "corrupt checkpoint with --no-fallback, processes holding different data sets, a data setting the data set cannot "
            "take, a remat budget below the smallest that fits, checkpoints that cannot fit on their disk); 3 the loss diverged "
            "(NaN/Inf); 4 a checkpoint could not be written (e.g. the disk filled up: the last good checkpoint stays intact, "
            "the summary says what was saved; free space and run the same command again); 5 the device ran out of memory "
            "(the message says what to change; the checkpoints already written are kept); 75 stopped before loop.num_steps, by a signal or by --stop-after-steps, with a checkpoint: "
            "run the same command again to resume (without --force-new, which would start the run over)"
        ),
    )


def train_main(argv: list[str] | None = None) -> None:
    """`gem-train --config FILE --workdir DIR [--set path=value ...] [--force-new] [--no-progress] [--stop-after-steps N] [--compile-cache DIR|off] [--no-fallback] [--dry-run]`."""
    parser = _parser()
    parser.add_argument("--help-config", action=_ConfigFields, help="list the config fields --set takes, with types, defaults and meanings, and exit")
    parser.add_argument("--config", required=True, help="Python file with get_config() -> TrainConfig")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl, TensorBoard logs and run.json")
    parser.add_argument(
        "--set", nargs="+", action="extend", default=[], metavar="PATH=VALUE", dest="overrides",
        help="override config fields, e.g. --set loop.num_steps=3 model.embed_dim=128 (see --help-config); repeatable: "
        "the overrides of every --set apply in order, and a later value for the same field wins",
    )
    parser.add_argument("--force-new", action="store_true", help="start a new run even if the workdir holds another (it is moved to previous_runs/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the default when stdout is not a terminal)")
    parser.add_argument(
        "--stop-after-steps", type=positive_int, default=None, metavar="N",
        help="stop after N (>= 1) steps of this start with a checkpoint, as a preemption does: exit status 75 while the run "
        "is not finished (run the command again, without --force-new, to go on), 0 once it is",
    )
    parser.add_argument(
        "--compile-cache", default=None, metavar="DIR|off",
        help="jax's persistent compilation cache (default: $GEM_COMPILE_CACHE_DIR, else WORKDIR/jax_cache; 'off': none)",
    )
    parser.add_argument(
        "--no-fallback", action="store_true",
        help="refuse to start when the newest checkpoint is corrupt (default: move it aside, resume from the newest intact one)",
    )
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the resolved config, the data set, the token capacities the run compiles and the checkpoint size, "
        "then exit without compiling or training",
    )
    args = parser.parse_args(argv)
    workdir_error = output_directory_problem(args.workdir, "--workdir")
    if workdir_error:  # before --compile-cache, whose default lies under it
        parser.error(workdir_error)
    claim_device_memory()  # 90% of each GPU unless the environment says otherwise, before jax's client starts
    add_project_flags()  # the project's XLA flags (gem_jax.xla_options) unless the environment gives them

    import jax

    from gem_jax.data.config import DataConfigError, require_path
    from gem_jax.data.rows import BadRowError, DataFormatError
    from gem_jax.model.config import describe_attention
    from gem_jax.parallel import distributed
    from gem_jax.parallel.distributed import ProcessMismatchError
    from gem_jax.train import compile_cache, config_tree, goodput, run_record
    from gem_jax.train.config import load_config
    from gem_jax.train.checkpoint import CheckpointWriteError
    from gem_jax.train.disk_space import CheckpointSpaceError
    from gem_jax.train.divergence import NonFiniteLossError
    from gem_jax.train.integrity import CorruptCheckpointError
    from gem_jax.train.loop import dry_run, train_and_evaluate
    from gem_jax.train.preemption import PREEMPTED_EXIT_CODE, Preempted
    from gem_jax.train.remat_plan import RematBudgetError
    from gem_jax.train.run_record import RunMismatchError
    from gem_jax.train.workdir_lock import WorkdirLockedError
    from pallas_kernels import ImplementationUnavailableError

    # The run's clock starts with the process (`goodput.process_start_time`): the imports above count.
    chrono = goodput.Chrono(goodput.process_start_time())
    setup_began = time.perf_counter()
    try:
        config = config_tree.apply_overrides(load_config(args.config), args.overrides)
        require_path(config.data)
    except (FileNotFoundError, TypeError, ValueError) as error:  # ConfigError, ConfigFileError and DataConfigError are ValueErrors
        parser.error(str(error))
    # Neither the workdir nor the cache is made here: a dry run writes nothing, and a start refused before
    # it compiles leaves the filesystem as it was (jax makes the cache directory at its first compile).
    try:
        cache = compile_cache.cache_dir(args.workdir, args.compile_cache)
        if cache is not None and (problem := output_directory_problem(str(cache), "--compile-cache")):
            raise ValueError(problem.removeprefix("--compile-cache "))
        if not args.dry_run:  # a dry run compiles nothing
            cache = compile_cache.enable(cache, create=False)
    except (ValueError, OSError) as error:
        parser.error(f"--compile-cache: {error}")
    layout = distributed.initialize()
    process = f", process {jax.process_index()} of {jax.process_count()} ({layout.source})" if layout else ""
    print(f"gem-train: {run_record.describe_devices({**run_record.device_record(), 'jax': jax.__version__}, process)}", flush=True)
    print(f"gem-train: compilation cache {cache or 'off'}{' (unused: --dry-run compiles nothing)' if args.dry_run and cache else ''}", flush=True)
    try:
        for line in describe_attention(config.model):
            print(f"gem-train: {line}", flush=True)
    except (ImplementationUnavailableError, ValueError) as error:  # e.g. "pallas" asked for on a machine without a Hopper GPU
        print(f"gem-train: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    chrono.add(goodput.SETUP, time.perf_counter() - setup_began)  # config, compile cache, devices
    try:
        if args.dry_run:
            dry_run(config, args.workdir, force_new=args.force_new)
            return
        summary = train_and_evaluate(
            config,
            args.workdir,
            stop_after_steps=args.stop_after_steps,
            force_new=args.force_new,
            progress=False if args.no_progress else None,
            fallback=not args.no_fallback,
            chrono=chrono,
        )
    except Preempted as error:
        message = str(error).replace(RESUME, RESUME_WITHOUT_FORCE_NEW) if args.force_new else str(error)
        print(f"gem-train: {message}", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT_CODE)
    except (
        RunMismatchError, WorkdirLockedError, CorruptCheckpointError, BadRowError, DataFormatError, DataConfigError,
        FileNotFoundError, ProcessMismatchError, RematBudgetError, CheckpointSpaceError,
    ) as error:
        # refused: the run, the workdir, the data set or the memory budget is not usable as given,
        # or the processes hold different data (the message says why)
        print(f"gem-train: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except NonFiniteLossError as error:
        print(f"gem-train: {error}", file=sys.stderr, flush=True)
        sys.exit(3)
    except CheckpointWriteError as error:  # the summary of what was saved is printed; restart once the disk has room
        print(f"gem-train: {error}", file=sys.stderr, flush=True)
        sys.exit(CHECKPOINT_WRITE_EXIT_CODE)
    except jax.errors.JaxRuntimeError as error:
        if not is_out_of_memory(error):
            raise
        print(f"gem-train: {out_of_memory_message(error)}", file=sys.stderr, flush=True)
        sys.exit(OUT_OF_MEMORY_EXIT_CODE)
    if not summary["finished"]:  # --stop-after-steps: stopped like a preemption, the run goes on when started again
        print(f"gem-train: stopped after step {summary['step']} of {config.loop.num_steps} (--stop-after-steps); {RESUME_WITHOUT_FORCE_NEW if args.force_new else RESUME}", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT_CODE)


def out_of_memory_message(error: BaseException) -> str:
    """What ran out, what this process may use of the device, and what to change, for an out-of-memory error;
    when the free memory was enough but split, says so (`device_memory.fragmentation_note`)."""
    import jax

    what = str(error).strip().splitlines()[0].removeprefix("RESOURCE_EXHAUSTED: ")
    try:
        note = fragmentation_note(what, jax.local_devices())
    except Exception:  # noqa: BLE001 - the note is optional; the out-of-memory exit must not fail on it
        note = ""
    return (
        f"the device ran out of memory ({what}).{note} "
        f"This process's allocator may take {device_memory_share()} of the device's "
        "memory. Lower data.batch_size or data.max_seq_len, give the backward a memory budget "
        "(--set model.remat.budget_gb=GB: README, Memory), train in bfloat16 (model.compute_dtype: float32 attention takes "
        "the jnp reference, whose scores are padded), keep AdamW's moments and the weight matrices in bfloat16 for a new run "
        "(optim.moments_dtype=bfloat16, optim.weights_dtype=bfloat16; with a remat budget, lower it by what they save, "
        "or the planner spends the room on saved activations), or give the process more of the device. The checkpoints already "
        "written are kept: the same command resumes from the last."
    )


if __name__ == "__main__":
    train_main()
