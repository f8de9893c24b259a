"""Orbax checkpointing of the train state together with the data iterator's position.

One `orbax.checkpoint.CheckpointManager` (async, keep N) saves two items per step: the
sharded `TrainState` and the grain iterator state, so a restarted run continues with
exactly the batches an uninterrupted run would have seen.

Every finished step gets a checksum manifest (`gem_jax.train.integrity`), written
once its async save has finished (before the next save starts, or on `wait`).
`restore_latest` verifies the newest step against it and, when the step is
corrupt or cannot be read, names it, moves it aside to `quarantine_dir` (nothing
is deleted) and falls back to the next older intact step, unless told not to.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import sys
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp

from gem_jax.checks import check_int
from gem_jax.train import integrity
from gem_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Attributes:
    every_steps: save interval in steps (a final checkpoint is always written).
    max_to_keep: checkpoints kept on disk (older ones deleted).
    async_save: write in a background thread while training continues.
    """

    every_steps: int = 200
    max_to_keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        check_int(self, "every_steps", minimum=1)
        check_int(self, "max_to_keep", minimum=1)
        if not isinstance(self.async_save, bool):
            raise TypeError(f"CheckpointConfig.async_save must be a bool, got {self.async_save!r}")


class Checkpointer:
    """Saves and restores (`TrainState`, data iterator) pairs under `directory`."""

    def __init__(self, directory: str | Path, config: CheckpointConfig, *, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.max_to_keep,
                # Every `every_steps` steps and at a preemption signal Orbax sees; not Orbax's default
                # extra save at the first step, which at GEM width writes the whole state (~40 GB)
                # after step 1 of every new run.
                save_decision_policy=ocp.checkpoint_managers.AnySavePolicy(
                    [
                        ocp.checkpoint_managers.FixedIntervalPolicy(config.every_steps),
                        ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
                    ]
                ),
                enable_async_checkpointing=config.async_save,
                read_only=read_only,
                create=not read_only,
                cleanup_tmp_directories=not read_only,
            ),
        )

    def step_path(self, step: int) -> Path:
        """The folder of checkpoint step `step` (absolute; it need not exist)."""
        return self.directory / str(step)

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` without `force` would save."""
        return self.manager.should_save(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps with a finished checkpoint, ascending."""
        return sorted(self.manager.all_steps())

    def restore_state(self, step: int, abstract_state: TrainState) -> TrainState:
        """Restores only the train state of `step` (not the data position), onto `abstract_state`'s shardings."""
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))).state

    def save(self, step: int, state: TrainState, data_iterator: grain.DatasetIterator, *, force: bool = False) -> bool:
        """Saves when `step` is on the interval (or `force`); returns whether it saved.

        The previous save is finished and given its checksum manifest first.
        """
        if not (force or self.should_save(step)):
            return False
        self.wait()
        return self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator)),
            force=force,
        )

    def restore(self, step: int, abstract_state: TrainState, data_iterator: grain.DatasetIterator) -> TrainState:
        """Restores `step` onto the shardings carried by `abstract_state`; moves `data_iterator` in place.

        Raises:
          FileNotFoundError: no checkpoint for `step`.
        """
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.manager.directory}")
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(data_iterator)
            ),
        )
        return restored.state

    def wait(self) -> None:
        """Waits for the save in flight, then writes the manifest of every finished step that lacks one."""
        self.manager.wait_until_finished()
        if self.read_only or jax.process_index() != 0:
            return
        for step in self.all_steps():
            if not integrity.has_manifest(self.step_path(step)):
                integrity.write_manifest(self.step_path(step))

    def restore_latest(
        self, abstract_state: TrainState, data_iterator: grain.DatasetIterator, *, quarantine_dir: Path, fallback: bool = True
    ) -> tuple[int, TrainState] | None:
        """Restores the newest intact step; None when there is no checkpoint.

        Each step, newest first, is checked against its manifest and restored; a
        step that fails its manifest, or has none and cannot be read, is reported (path and cause on stderr), moved to
        `quarantine_dir/<step>-<time>` and the next older step is tried.

        Raises:
          CorruptCheckpointError: the newest step is corrupt and `fallback` is
            False, or no step is intact (every path and cause named).
        """
        failures = []
        for step in reversed(self.all_steps()):
            path = self.step_path(step)
            problems = integrity.verify(path)
            if not problems:
                try:
                    return step, self.restore(step, abstract_state, data_iterator)
                except Exception as error:  # Orbax and tensorstore raise many types for unreadable files
                    if integrity.has_manifest(path):
                        raise  # intact files that do not fit this run's state: not corruption
                    problems = [f"{path}: cannot be restored ({type(error).__name__}: {str(error).splitlines()[0][:300]})"]
            failures.append(problems)
            report = "\n  ".join(problems)
            if not fallback:
                raise integrity.CorruptCheckpointError(
                    f"checkpoint step {step} is corrupt:\n  {report}\n"
                    "Without --no-fallback the run restarts from the newest intact older step (the corrupt one is moved aside)."
                )
            moved = self._quarantine(step, quarantine_dir)
            print(f"gem-train: checkpoint step {step} is corrupt, moved to {moved}:\n  {report}", file=sys.stderr, flush=True)
        if failures:
            raise integrity.CorruptCheckpointError(
                f"no intact checkpoint in {self.directory}; the corrupt steps were moved to {quarantine_dir}"
            )
        return None

    def _quarantine(self, step: int, quarantine_dir: Path) -> Path:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = Path(quarantine_dir) / f"{step}-{stamp}"
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.step_path(step)), str(target))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"gem-quarantine-{step}")
        self.manager.reload()
        return target

    def close(self) -> None:
        """Waits for pending async saves (and writes their manifests), then releases the manager."""
        self.wait()
        self.manager.close()
