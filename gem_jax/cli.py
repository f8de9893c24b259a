"""Command-line entry points."""

from __future__ import annotations

import argparse

import jax


def train_main(argv: list[str] | None = None) -> None:
    """`gem-train --config configs/movielens.py --workdir runs/demo [--stop-after-steps N]`.

    Multi-host: one process per GPU; `jax.distributed` is initialised from SLURM or the
    `GEM_COORDINATOR_ADDRESS` / `GEM_NUM_PROCESSES` / `GEM_PROCESS_ID` variables
    (`gem_jax.parallel.distributed`), see scripts/launch_slurm.sh.
    """
    parser = argparse.ArgumentParser(prog="gem-train", description="Train a GEM-style model; resumes from the workdir's latest checkpoint.")
    parser.add_argument("--config", required=True, help="Python file with get_config() -> TrainConfig")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and TensorBoard logs")
    parser.add_argument("--stop-after-steps", type=int, default=None, help="stop (with a checkpoint) after N steps of this run")
    args = parser.parse_args(argv)

    from gem_jax.config import load_config
    from gem_jax.parallel import distributed
    from gem_jax.train.loop import train_and_evaluate

    layout = distributed.initialize()
    try:
        config = load_config(args.config)
    except (FileNotFoundError, TypeError) as error:
        parser.error(str(error))
    devices = jax.devices()
    where = f", process {jax.process_index()} of {jax.process_count()} ({layout.source})" if layout else ""
    print(f"gem-train: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}{where}")
    train_and_evaluate(config, args.workdir, stop_after_steps=args.stop_after_steps)
