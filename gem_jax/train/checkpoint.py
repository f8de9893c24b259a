"""Orbax checkpointing of the train state together with the data iterator's position.

One `orbax.checkpoint.CheckpointManager` (async, keep N) saves two items per step: the
sharded `TrainState` and the grain iterator state, so a restarted run continues with
exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grain
import orbax.checkpoint as ocp

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


class Checkpointer:
    """Saves and restores (`TrainState`, data iterator) pairs under `directory`."""

    def __init__(self, directory: str | Path, config: CheckpointConfig, *, read_only: bool = False):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.max_to_keep,
                save_interval_steps=config.every_steps,
                enable_async_checkpointing=config.async_save,
                read_only=read_only,
                create=not read_only,
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps with a finished checkpoint, ascending."""
        return sorted(self.manager.all_steps())

    def restore_state(self, step: int, abstract_state: TrainState) -> TrainState:
        """Restores only the train state of `step` (not the data position), onto `abstract_state`'s shardings."""
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))).state

    def save(self, step: int, state: TrainState, data_iterator: grain.DatasetIterator, *, force: bool = False) -> bool:
        """Saves when `step` is on the interval (or `force`); returns whether it saved."""
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

    def close(self) -> None:
        """Waits for pending async saves, then releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
