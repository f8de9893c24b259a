"""Disk space of checkpoints: what one copy writes, what a run needs at its peak, and a full disk recognised.

A run keeping `max_to_keep` checkpoints holds `max_to_keep + 1` copies while a save is
being written: Orbax deletes the oldest step only after the new one has committed.
`plan_space` compares that peak with the free space of the checkpoint folder's
filesystem before the first step (`CheckpointSpaceError` when it cannot fit), and
`is_disk_full` recognises, in an exception chain from Orbax or TensorStore, a write
that failed because the disk filled up anyway.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from gem_jax.units import format_bytes

# What a copy writes beyond the arrays' bytes: Orbax's step and tree metadata, the OCDBT
# manifests, the data iterator's JSON and the checksum manifest (a fixed part, measured at
# ~100 kB on the tiny config), and per array its metadata entries and the rounding of its
# data to filesystem blocks.
FIXED_METADATA_BYTES = 1 << 20
PER_ARRAY_METADATA_BYTES = 16 << 10
# Free space below this many times the bytes a run still needs draws a warning.
WARN_HEADROOM = 2.0
_FULL_MARKERS = ("No space left on device", "RESOURCE_EXHAUSTED", "ENOSPC", "Disk quota exceeded")


class CheckpointSpaceError(ValueError):
    """The checkpoints a run keeps cannot be written: they do not fit on their filesystem (bytes needed and free, the
    path, what to change), or their folder is not writable (`Checkpointer.preflight`)."""


def checkpoint_bytes(abstract_state) -> int:
    """Bytes one checkpoint copy of `abstract_state` writes, an upper bound (Orbax compresses nothing that matters).

    Args:
      abstract_state: a `TrainState` of `jax.ShapeDtypeStruct`s or of arrays; global
        shapes: every element is written once, whatever the sharding and replication.

    Returns:
      The arrays' bytes (`array_bytes`) plus `FIXED_METADATA_BYTES` and
      `PER_ARRAY_METADATA_BYTES` per array (metadata, the data iterator's state, block
      rounding).
    """
    return array_bytes(abstract_state) + FIXED_METADATA_BYTES + PER_ARRAY_METADATA_BYTES * len(jax.tree.leaves(abstract_state))


def array_bytes(tree) -> int:
    """Bytes of the arrays of `tree` (leaves with `.shape` and `.dtype`), from shapes and dtypes alone."""
    return sum(math.prod(leaf.shape) * jax.numpy.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def largest_shard_bytes(abstract_state) -> int:
    """Bytes of the largest piece of one array a process writes at once: its shard's shape (the global shape when unsharded)."""
    largest = 0
    for leaf in jax.tree.leaves(abstract_state):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        largest = max(largest, math.prod(shape) * jax.numpy.dtype(leaf.dtype).itemsize)
    return largest


def nearest_existing(path: str | Path) -> Path:
    """`path` or its nearest existing parent (a checkpoint folder need not exist before the first save)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes free to this user on the filesystem holding `path` (or its nearest existing parent)."""
    return shutil.disk_usage(nearest_existing(path)).free


def directory_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (their sizes, not their blocks); 0 when it does not exist."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # deleted by a rotation meanwhile
                pass
    return total


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from or during, reports a full disk or quota.

    Orbax re-raises TensorStore's `ValueError: RESOURCE_EXHAUSTED: ... No space left on
    device` from its background thread; Python writes raise `OSError(ENOSPC)`.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(error) for marker in _FULL_MARKERS):
            return True
        error = error.__cause__ or error.__context__
    return False


@dataclasses.dataclass(frozen=True)
class SpacePlan:
    """A run's checkpoints against the free space of their filesystem.

    Attributes:
      copy_bytes: one checkpoint copy (`checkpoint_bytes`).
      max_to_keep: copies kept after each save.
      on_disk: finished steps of this run already in the folder (a restart), counted at
        `copy_bytes` each: the space they hold is already not free, and rotation replaces
        them by new copies.
      free: bytes free on the folder's filesystem now.
      path: the folder whose filesystem was measured.
      float32_moments: whether the state holds AdamW moments in float32 (then bfloat16
        moments are one of the remedies named).
      float32_matrices: whether the state holds float32 weight matrices that a bfloat16 step
        casts (`float32_matrices`; then bfloat16 weights are one of the remedies named).

    The peak is `max(max_to_keep, on_disk) + 1` copies (the kept ones and the one being
    written; a restart holding more than `max_to_keep` deletes the extra ones only after
    its first save). Of these, `on_disk` exist, so `needed` bytes must still be free.
    """

    copy_bytes: int
    max_to_keep: int
    on_disk: int
    free: int
    path: Path
    float32_moments: bool = True
    float32_matrices: bool = False

    @property
    def peak_copies(self) -> int:
        return max(self.max_to_keep, self.on_disk) + 1

    @property
    def needed(self) -> int:
        """Bytes the run still has to write at its peak, beyond what its checkpoints already hold."""
        return (self.peak_copies - self.on_disk) * self.copy_bytes

    @property
    def headroom(self) -> float:
        """Free bytes over needed bytes (>= 1 fits)."""
        return self.free / self.needed

    def lines(self) -> list[str]:
        """The plan as start-up lines: the copy's size, the peak, what is on disk and free, the headroom."""
        lines = [
            f"checkpoints: {format_bytes(self.copy_bytes)} a copy; {self.max_to_keep} kept + 1 being written = "
            f"{self.peak_copies} copies, {format_bytes(self.peak_copies * self.copy_bytes)} at the peak"
            + (f" ({self.on_disk} already on disk)" if self.on_disk else ""),
            f"checkpoints: {format_bytes(self.needed)} still needed, {format_bytes(self.free)} free on the filesystem of "
            f"{self.path}: headroom {self.headroom:.2f}x",
        ]
        if self.headroom < WARN_HEADROOM:
            lines.append(
                f"checkpoints: warning: less than {WARN_HEADROOM:g}x headroom; anything else writing to this filesystem "
                f"can fill it before the run ends ({self._remedies()})"
            )
        return lines

    def check(self) -> None:
        """Raises `CheckpointSpaceError` (needed, free, path, what to change) when the peak does not fit."""
        if self.needed > self.free:
            raise CheckpointSpaceError(
                f"the checkpoints cannot fit: {self.peak_copies} copies of {format_bytes(self.copy_bytes)} need "
                f"{format_bytes(self.needed)} more, {format_bytes(self.free)} is free on the filesystem of {self.path}. "
                f"Change one of: {self._remedies()}."
            )

    def _remedies(self) -> str:
        fewer = dataclasses.replace(self, max_to_keep=self.max_to_keep - 1)  # CheckpointConfig keeps at least 1
        return ", ".join(
            ([f"checkpoint.max_to_keep={fewer.max_to_keep} ({format_bytes(fewer.needed)} needed)"] if fewer.max_to_keep >= 1 and fewer.needed < self.needed else [])
            + (["optim.moments_dtype=bfloat16 for a new run (AdamW moments at half size)"] if self.float32_moments else [])
            + (["optim.weights_dtype=bfloat16 for a new run (weight matrices at half size)"] if self.float32_matrices else [])
            + [
                "a --workdir on a filesystem with more free space",
                "free space on this one",
            ]
        )


def plan_space(abstract_state, max_to_keep: int, on_disk: int, directory: str | Path, *, float32_matrices: bool = False) -> SpacePlan:
    """The `SpacePlan` of saving `abstract_state` (what a checkpoint holds) into `directory` (free space probed now,
    via `free_bytes`); `float32_matrices`: `float32_matrices` of the train state it was taken from."""
    path = nearest_existing(directory)
    return SpacePlan(
        checkpoint_bytes(abstract_state), max_to_keep, on_disk, free_bytes(path), path, _float32_moments(abstract_state), float32_matrices
    )


def float32_matrices(state) -> bool:
    """Whether a `TrainState` (abstract or not) keeps compute-dtype copies of weight matrices: float32 weights a
    bfloat16 step casts, which `optim.weights_dtype=bfloat16` would store at half size. False for any other tree."""
    copies = getattr(state, "compute_params", None) or {}
    return any(len(leaf.shape) >= 2 for leaf in copies.values())


def _float32_moments(abstract_state) -> bool:
    adam = [s for s in jax.tree.leaves(abstract_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    return any(leaf.dtype == jnp.float32 for s in adam for leaf in jax.tree.leaves(s.mu))
