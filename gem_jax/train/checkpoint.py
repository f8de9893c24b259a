"""Orbax checkpointing of the train state together with the data iterator's position.

One `orbax.checkpoint.CheckpointManager` (async, keep N) saves two items per step: the
sharded `TrainState` and the grain iterator state, so a restarted run continues with
exactly the batches an uninterrupted run would have seen.

Saves never wait for an earlier save's disk writes, and, where the device has the
memory, not for the device-to-host copy either: `save` copies the state on the device
(a jitted copy into new buffers with the same shardings, `snapshot.copy_program`) and hands the
copy to Orbax from a background thread, which does the device-to-host copy, frees the
device copy and leaves the file writes to Orbax's own thread; the next train step may
donate the live state at once (CheckFreq's snapshot-then-persist; torchtitan's async
checkpoint with staging). `CheckpointConfig.snapshot` decides it ("auto": when the
state's bytes on each device fit in what the steps leave free, `snapshot.fits`).
Otherwise `save` blocks for Orbax's device-to-host copy. A save that falls due while the
previous one is still copying or writing is deferred to the first step at which it has
finished (`should_save`), and the run says so once, with the write's duration; a forced
save (the final or a preemption save) is never deferred: it waits, and it copies
without a snapshot. So at most one copy of the state is staged (on the device or in
host memory), and TensorStore's in-flight write buffers are bounded by
`WRITE_BUFFER_FRACTION` of host RAM (Orbax's `save_concurrent_gb`). Every call of the
Orbax manager holds one lock: the background thread and the loop's never use it at
once. `report()` gives each save's blocking and write seconds.

Every finished step gets a checksum manifest (`gem_jax.train.integrity`), written by a
background thread once its files have committed (hashing a GEM-width step takes tens of
seconds). `restore_latest` verifies the newest step against it and, when the step is
corrupt or cannot be read, names it, moves it aside to `quarantine_dir` (nothing is
deleted) and falls back to the next older intact step, unless told not to.

A save that fails (typically a full disk) surfaces as `CheckpointWriteError` from the
next `should_save`, `save`, `wait` or `close`. Orbax writes a step into
`<step>.orbax-checkpoint-tmp-*` and renames it only at commit, so a half-written step is
never taken for a finished one; its files are deleted to give the space back, and the
earlier steps stay intact and restorable. `preflight` compares the checkpoints' peak
size with the free space before the first step (`gem_jax.train.disk_space`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from gem_jax.checks import check_bool, check_int, write_problem
from gem_jax.train import disk_space, integrity, snapshot
from gem_jax.train.state import TrainState
from gem_jax.units import format_bytes

# Share of host RAM that TensorStore's in-flight write buffers may take (Orbax's
# `save_concurrent_gb`, default 96 GB: most of a 128 GB host). The staged copy of the
# state (one at a time: saves are deferred, never overlapped) comes on top.
WRITE_BUFFER_FRACTION = 0.125
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_PARTIAL_QUIET_S = 0.5  # a failed save's temporary directory must stay away this long to count as removed
_PARTIAL_REMOVAL_S = 30.0
SWITCHES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When the train state is saved, how it is written, and how a restore reads it.

    Attributes:
      every_steps: save interval in steps (a final checkpoint is always written); a save
        due while the previous one is still being written waits for it to finish (it is
        deferred to that step).
      max_to_keep: checkpoints kept on disk (older ones deleted); the disk must hold one
        more while a save is written.
      async_save: write in a background thread while training continues.
      snapshot: "auto", "on" or "off": copy the state on the device and save the copy from
        a background thread, so that `save` blocks for milliseconds (needs the state's
        bytes once more on each device while its device-to-host copy runs). "auto": on
        when they fit in the memory the steps leave free (`snapshot.fits`; off where the
        device reports no memory statistics, as the CPU). Needs `async_save`.
      pinned_host: "auto", "on" or "off": Orbax copies the state to page-locked host
        memory (faster device-to-host copies; the pinned pool, a copy of the state, stays
        allocated). "auto": Orbax's default, on for GPUs.
      compression: zstd-compress the written chunks (Orbax's default). Uncompressed
        copies are larger (the size `disk_space.checkpoint_bytes` bounds) but need no
        compression on the host's cores when written nor decompression when restored.
      data_file_bytes: target size of each OCDBT data file of a step in bytes (Orbax's
        default 2 GiB; 0: no limit). Smaller files are written and checksummed by more
        threads at once.
      restore_concurrent_gb: at most this many GB (10^9 bytes) read at once by a
        restore (Orbax's `restore_concurrent_gb`, default 96).
    """

    every_steps: int = 200
    max_to_keep: int = 3
    async_save: bool = True
    snapshot: str = "auto"
    pinned_host: str = "auto"
    compression: bool = True
    data_file_bytes: int = 2**31
    restore_concurrent_gb: int = 96

    def __post_init__(self):
        check_int(self, "every_steps", minimum=1)
        check_int(self, "max_to_keep", minimum=1)
        check_bool(self, "async_save")
        check_bool(self, "compression")
        check_int(self, "data_file_bytes", minimum=0)
        check_int(self, "restore_concurrent_gb", minimum=1)
        for name in ("snapshot", "pinned_host"):
            if getattr(self, name) not in SWITCHES:
                raise ValueError(f"CheckpointConfig.{name} must be one of {', '.join(SWITCHES)}, got {getattr(self, name)!r}")
        if self.snapshot == "on" and not self.async_save:
            raise ValueError("CheckpointConfig.snapshot='on' needs async_save=True (a synchronous save has nothing to overlap)")


class CheckpointWriteError(RuntimeError):
    """A checkpoint save that failed; the run should end with its summary and this message.

    Attributes:
      step: the step whose save failed (its partial files are removed).
      path: the checkpoint folder.
      free_bytes: bytes free on its filesystem after the partial files were removed.
      disk_full: whether a full disk or quota caused it (`disk_space.is_disk_full`).
      last_good_step: the newest finished step, intact and restorable (None: none).
      max_to_keep: the run's `CheckpointConfig.max_to_keep` (lowering it is suggested only above 1).
    """

    def __init__(self, step: int, path: Path, free_bytes: int, disk_full: bool, last_good_step: int | None, cause: str, max_to_keep: int):
        self.step, self.path, self.free_bytes = step, path, free_bytes
        self.disk_full, self.last_good_step = disk_full, last_good_step
        what = f"the disk is full ({format_bytes(free_bytes)} free on the filesystem of {path})" if disk_full else cause
        good = (
            f"the last good checkpoint is step {last_good_step} ({path / str(last_good_step)}), intact; a restart resumes from it"
            if last_good_step is not None
            else "no earlier checkpoint was finished"
        )
        fewer = f", lower checkpoint.max_to_keep (now {max_to_keep})" if max_to_keep > 1 else ""
        todo = f"; free space{fewer} or use another --workdir, then restart" if disk_full else ""
        super().__init__(f"checkpoint step {step} could not be written: {what}; {good}{todo}")


@dataclasses.dataclass
class SaveRecord:
    """One save's measurements.

    Attributes:
      step: the saved step.
      bytes: what one copy writes (`disk_space.checkpoint_bytes`; the files' sizes once committed).
      blocking_s: seconds inside `save` (a snapshot save: dispatching the device copy;
        otherwise the device-to-host copy; for a forced save also the wait for the
        previous write).
      write_s: seconds from the call of `save` to the commit of its files (None while
        writing; for a commit seen only by polling, up to a step late).
      snapshot: whether it saved an on-device snapshot from the background thread.
    """

    step: int
    bytes: int
    blocking_s: float
    write_s: float | None = None
    snapshot: bool = False
    started: float = dataclasses.field(default=0.0, repr=False)


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def write_buffer_gb() -> int:
    """TensorStore's in-flight write bound in whole GB (Orbax's unit, 10^9 bytes): `WRITE_BUFFER_FRACTION` of host RAM, at least 1."""
    return max(1, int(WRITE_BUFFER_FRACTION * host_memory_bytes() / 1e9))


class _Position:
    """A data iterator's position taken now, for a save written later: grain's checkpoint handler
    writes `get_state()` of what it is given, and the live iterator moves on meanwhile."""

    def __init__(self, iterator: grain.DatasetIterator):
        state = iterator.get_state()
        # The bytes grain's handler writes for a DatasetIterator (`json.dumps(state, indent=4)`); other iterators give bytes.
        self._state = json.dumps(state, indent=4).encode() if isinstance(iterator, grain.DatasetIterator) else state

    def get_state(self) -> bytes:
        return self._state


class Checkpointer:
    """Saves and restores (`TrainState`, data iterator) pairs under `directory`; measures every save (`report`)."""

    def __init__(self, directory: str | Path, config: CheckpointConfig, *, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        self.config = config
        self.saves: list[SaveRecord] = []
        self.deferred: list[tuple[int, int]] = []  # (due step, step saved at)
        self._writing: SaveRecord | None = None
        self._committed_at: float | None = None  # set by Orbax's thread when the write in flight commits
        self._pending: int | None = None  # the due step of a deferred save
        self._copy_bytes: int | None = None
        self._manifests = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-manifest")
        self._closed = False
        self._ending: dict[str, float] = {}  # the last `wait` and `close`: seconds of each part
        self._manifest_jobs: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.RLock()  # held by every call of `self.manager`, from either thread
        self._stager = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-snapshot")
        self._staging: concurrent.futures.Future | None = None  # the snapshot save being handed to Orbax
        self._snapshot: bool | None = None  # whether saves snapshot, decided at the first one (`_snapshots`)
        self._copy = None  # the compiled snapshot copy (`snapshot.copy_program`)
        self.write_buffer_gb = write_buffer_gb()
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
                # Deferral is decided by `should_save`, not by Orbax's own in-progress check.
                enable_should_save_is_saving_in_progress_check=False,
                enable_async_checkpointing=config.async_save,
                # The step's temporary directory is made in `save` itself, not by a thread of its own: a save that
                # fails (a full disk) then leaves no thread that creates the directory after `_write_failed` removed it.
                async_options=ocp.AsyncOptions(post_finalization_callback=self._on_committed, create_directories_asynchronously=False)
                if config.async_save
                else None,
                read_only=read_only,
                create=not read_only,
                cleanup_tmp_directories=not read_only,
                # The step a rotation drops is deleted in Orbax's thread, beside the checksum
                # manifest of the step just written; `close` waits for it (a job's last ~7 s at GEM width).
                enable_background_delete=True,
            ),
            item_handlers={
                # The format of Orbax's StandardCheckpointHandler (which wraps this one), with the write options exposed.
                "state": ocp.PyTreeCheckpointHandler(
                    save_concurrent_gb=self.write_buffer_gb,
                    restore_concurrent_gb=config.restore_concurrent_gb,
                    use_compression=config.compression,
                    enable_pinned_host_transfer={"auto": None, "on": True, "off": False}[config.pinned_host],
                ),
                "data": grain.checkpoint.CheckpointHandler(),
            },
        )

    def preflight(self, abstract_state: TrainState) -> list[str]:
        """Checks that the run's checkpoints fit on their filesystem; returns the lines to print.

        The peak is `max_to_keep + 1` copies of `disk_space.checkpoint_bytes(abstract_state)`
        (the kept ones and the one being written); finished steps already in the folder (a
        restart) count towards it (the rule: `disk_space.SpacePlan`). Below 2x headroom a
        warning line is added. Also checks that the largest array shard fits the in-flight
        write bound (`write_buffer_gb`), and compiles the snapshot copy when saves may
        snapshot (`CheckpointConfig.snapshot`), so that no compile follows the first step.

        Raises:
          CheckpointSpaceError: the folder cannot be written (`gem_jax.checks.write_problem`), the peak does not fit in the free space (needed, free, the path and what
            to change named), or a shard exceeds the write bound.
        """
        if (problem := write_problem(self.directory)) is not None:  # found now, not at the first save after training
            raise disk_space.CheckpointSpaceError(
                f"{self.directory}: the checkpoint folder cannot be written ({problem}); make it writable or use another --workdir"
            )
        float32_matrices = disk_space.float32_matrices(abstract_state)
        abstract_state = _checkpointed(abstract_state)
        self._copy_bytes = disk_space.checkpoint_bytes(abstract_state)
        largest = disk_space.largest_shard_bytes(abstract_state)
        if largest >= self.write_buffer_gb * 1e9:
            raise disk_space.CheckpointSpaceError(
                f"the largest array shard ({format_bytes(largest)}) exceeds the checkpoint write buffer bound, "
                f"{self.write_buffer_gb} GB ({WRITE_BUFFER_FRACTION:g} of host RAM, {format_bytes(host_memory_bytes())}): "
                "shard it over more devices or use a host with more memory"
            )
        plan = disk_space.plan_space(
            abstract_state, self.config.max_to_keep, len(self.all_steps()), self.directory, float32_matrices=float32_matrices
        )
        plan.check()
        if self._fits(abstract_state)[0]:  # compiled now: a compile after the first step would count as one the run should not need
            self._copy = snapshot.copy_program(abstract_state)
        return plan.lines()

    def step_path(self, step: int) -> Path:
        """The folder of checkpoint step `step` (absolute; it need not exist)."""
        return self.directory / str(step)

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` without `force` saves now.

        True on the interval (and at a preemption Orbax sees) and at the first step after a
        deferred save's predecessor has finished writing; False while a write is in flight,
        or while a snapshot is being handed to Orbax, which defers a save due now (noted
        for `report`). Also notes a write that has finished (its seconds; its manifest is
        queued). Never waits for the background thread.

        Raises:
          CheckpointWriteError: the save in flight failed.
        """
        if self.read_only:
            return False
        self._poll()
        if self._staging is not None and not self._staging.done():
            # The background thread holds the manager: its decision policy (`__init__`), evaluated without it.
            due = step % self.config.every_steps == 0 or ocp.multihost.reached_preemption(step)
        else:
            with self._lock:
                due = self.manager.should_save(step)
        if not (due or self._pending is not None):
            return False
        if self._still_writing():
            if due:
                self._pending = self._pending or step
            return False
        return True

    def latest_step(self) -> int | None:
        """The newest step saved or being saved (None: none); does not wait for a snapshot's hand-over to Orbax."""
        if self._staging is not None and not self._staging.done():
            return self._writing.step  # Orbax lists it once the background thread's save returns
        with self._lock:
            return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps with a finished checkpoint, ascending."""
        with self._lock:
            return sorted(self.manager.all_steps())

    def restore_state(self, step: int, abstract_state: TrainState) -> TrainState:
        """Restores only the train state of `step` (not the data position), onto `abstract_state`'s shardings
        (a `TrainState`'s compute copy made from the restored parameters)."""
        with self._lock:
            saved = self.manager.restore(step, args=ocp.args.Composite(state=_restore_args(abstract_state))).state
        return _restored(saved, abstract_state)

    def save(self, step: int, state: TrainState, data_iterator: grain.DatasetIterator, *, force: bool = False) -> bool:
        """Starts a save when `should_save(step)` (or `force`); returns whether it did.

        With snapshots (`CheckpointConfig.snapshot`, decided at the first save) it blocks
        for dispatching the device copy only: the background thread hands the copy to
        Orbax (device-to-host copy, then the files in Orbax's thread) and frees it.
        Otherwise it blocks for Orbax's device-to-host copy; the files are written in the
        background. `force` (the final or a preemption save) first waits for the save in
        flight and copies without a snapshot.

        Raises:
          CheckpointWriteError: this save, or the one in flight, failed (the half-written
            step is removed; the last good step is named).
        """
        if not (force or self.should_save(step)):
            return False
        start = time.perf_counter()
        state = _checkpointed(state)
        if force:
            self._finish_write()
        steps = self.all_steps()
        self._await_manifests(steps[: max(0, len(steps) + 1 - self.config.max_to_keep)])  # this save's rotation deletes them
        if self._pending == step:  # due while the previous save was being written, and saved at that step after all
            self._pending = None
        elif self._pending is not None:
            self._announce_deferral(step)
        copy_bytes = self._copy_bytes or disk_space.checkpoint_bytes(state)
        record = SaveRecord(step, copy_bytes, 0.0, started=start, snapshot=not force and self._snapshots(state))
        self._committed_at = None
        if record.snapshot:
            self._copy = self._copy or snapshot.copy_program(state)
            self._staging = self._stager.submit(self._save_snapshot, step, self._copy(state), _Position(data_iterator))
        else:
            try:
                self._save_now(step, state, data_iterator)
            except Exception as error:
                raise self._write_failed(step, error) from error
        record.blocking_s = time.perf_counter() - start
        self.saves.append(record)
        self._writing = record
        if not self.config.async_save:
            self._finish_write()
        return True

    def restore(self, step: int, abstract_state: TrainState, data_iterator: grain.DatasetIterator) -> TrainState:
        """Restores `step` onto the shardings carried by `abstract_state` (a `TrainState`'s compute copy made
        from the restored parameters); moves `data_iterator` in place.

        Raises:
          FileNotFoundError: no checkpoint for `step`.
        """
        with self._lock:
            if step not in self.manager.all_steps():
                raise FileNotFoundError(f"no checkpoint for step {step} in {self.manager.directory}")
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(state=_restore_args(abstract_state), data=grain.checkpoint.CheckpointRestore(data_iterator)),
            )
        return _restored(restored.state, abstract_state)

    def wait(self) -> None:
        """Waits for the save in flight and the checksum manifests of the steps this process saved.

        Raises:
          CheckpointWriteError: the save in flight, or writing a manifest, failed.
        """
        began = time.perf_counter()
        self._finish_write()
        written = time.perf_counter()
        # Only the steps this process wrote: a step found without a manifest (its process ended before
        # writing one) is never vouched for by hashing whatever its files hold now.
        for step in sorted(set(self.all_steps()) & {record.step for record in self.saves}):
            self._queue_manifest(step)
        self._await_manifests(list(self._manifest_jobs))
        self._ending.update(checkpoint_final_wait_s=written - began, checkpoint_final_manifests_s=time.perf_counter() - written)

    def report(self) -> dict[str, float | int]:
        """The run's checkpoint measurements, for its summary.

        Keys: `checkpoint_bytes` (one copy), `checkpoint_saves`, `checkpoint_deferred`
        (saves started later than due), `checkpoint_snapshots` (saves from an on-device
        snapshot), `checkpoint_blocking_s_mean` and `_max` (time in `save`),
        `checkpoint_write_gb_per_s` (bytes over write seconds of the finished saves),
        `checkpoint_final_write_s` (the last save's write on its own); of the last `wait`,
        `checkpoint_final_wait_s` (for the write in flight) and `checkpoint_final_manifests_s`
        (for the checksum manifests still being written), and `checkpoint_close_s` (releasing
        Orbax's manager and the threads after it, including the wait for Orbax's deletion of
        the steps the rotation dropped). Only the keys with a measurement are present.
        """
        report: dict[str, float | int] = {
            "checkpoint_saves": len(self.saves),
            "checkpoint_deferred": len(self.deferred),
            "checkpoint_snapshots": sum(s.snapshot for s in self.saves),
        }
        if self._copy_bytes is not None or self.saves:
            report["checkpoint_bytes"] = self.saves[-1].bytes if self.saves else self._copy_bytes
        if self.saves:
            blocking = [s.blocking_s for s in self.saves]
            report["checkpoint_blocking_s_mean"] = float(np.mean(blocking))
            report["checkpoint_blocking_s_max"] = float(np.max(blocking))
        written = [s for s in self.saves if s.write_s]
        if written:
            report["checkpoint_write_gb_per_s"] = sum(s.bytes for s in written) / sum(s.write_s for s in written) / 1e9
            if written[-1] is self.saves[-1]:
                report["checkpoint_final_write_s"] = written[-1].write_s
        report.update(self._ending)
        return report

    def restore_latest(
        self, abstract_state: TrainState, data_iterator: grain.DatasetIterator, *, quarantine_dir: Path, fallback: bool = True
    ) -> tuple[int, TrainState] | None:
        """Restores the newest intact step; None when there is no checkpoint.

        Each step, newest first, is checked against its manifest and restored (its structure
        first; its array data hashed in a thread beside Orbax's read of the same files, the
        state kept only when they pass); a step that fails its manifest, or has none
        and cannot be read, is reported (path and cause on stderr), moved to
        `quarantine_dir/<step>-<time>` and the next older step is tried. A readable step without
        a manifest (its process ended before writing one) is restored unverified, said on stderr,
        and stays without one.

        Raises:
          CorruptCheckpointError: the newest step is corrupt and `fallback` is
            False, or no step is intact (every path and cause named).
          Exception: Orbax's error for a step that passes its manifest but does not fit
            `abstract_state` (not corruption: nothing is moved).
        """
        failures = []
        for step in reversed(self.all_steps()):
            path = self.step_path(step)
            restored, error, problems = self._restore_verified(step, abstract_state, data_iterator)
            if not problems and error is None:
                if not integrity.has_manifest(path) and jax.process_index() == 0:
                    print(
                        f"gem-train: checkpoint step {step} has no checksum manifest (the process that saved it ended "
                        f"before writing one): restored without verification ({path})",
                        file=sys.stderr,
                        flush=True,
                    )
                return step, restored
            if not problems:
                if integrity.has_manifest(path):
                    raise error  # intact files that do not fit this run's state: not corruption
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
                f"no intact checkpoint in {self.directory}; the corrupt steps were moved to {quarantine_dir}. The run cannot "
                "resume: put an intact checkpoint back, or start a new run with --force-new (the run's files are moved aside)"
            )
        return None

    def _restore_verified(
        self, step: int, abstract_state: TrainState, data_iterator: grain.DatasetIterator
    ) -> tuple[TrainState | None, Exception | None, list[str]]:
        """`step` checked against its manifest and restored: (the state or None, the restore's error or None,
        the manifest's problems). The step's structure (indexes, metadata, file list and sizes) is checked
        first, and a step failing it is not read; its array data is hashed in a thread while Orbax reads it,
        and a state read from data that fails is freed."""
        path = self.step_path(step)
        if problems := integrity.verify(path, part="structure"):
            return None, None, problems
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-verify") as verifier:
            verifying = verifier.submit(integrity.verify, path, part="data")
            try:
                restored, error = self.restore(step, abstract_state, data_iterator), None
            except Exception as failure:  # Orbax and tensorstore raise many types for unreadable files
                restored, error = None, failure
            problems = verifying.result()
        if problems and restored is not None:
            _free(restored)
            restored = None
        return restored, error, problems

    def close(self) -> None:
        """Waits for the save in flight and the manifests, then releases the manager and the threads (also
        when the wait raises); a second call does nothing.

        Raises:
          CheckpointWriteError: as `wait`.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            began = time.perf_counter()
            self._stager.shutdown(wait=True)
            self._manifests.shutdown(wait=True)
            with self._lock:
                self.manager.close()
            self._ending["checkpoint_close_s"] = time.perf_counter() - began

    # ------------------------------------------------------------------ the write in flight

    def _on_committed(self) -> None:
        """Orbax's background thread, once the files of the save in flight are complete (process 0)."""
        self._committed_at = time.perf_counter()

    def _save_now(self, step: int, state: TrainState, data_iterator) -> None:
        """Orbax's save of `step` (blocks for its device-to-host copy; the files are written in its thread)."""
        with self._lock:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(state, ocdbt_target_data_file_size=self.config.data_file_bytes),
                    data=grain.checkpoint.CheckpointSave(data_iterator),
                ),
                force=True,  # due: on the interval, deferred or forced
            )

    def _save_snapshot(self, step: int, copy: TrainState, position: _Position) -> None:
        """The background thread: Orbax's save of the snapshot `copy`, then its device buffers freed.
        Orbax has copied every array to the host when `save` returns (without
        `save_device_host_concurrent_gb` every array is a "prioritized" synchronous transfer)."""
        try:
            self._save_now(step, copy, position)
        finally:
            _free(copy)

    def _snapshots(self, state: TrainState) -> bool:
        """Whether non-forced saves snapshot the state on the device; decided at the first save, when the
        steps' peak device memory is known (`snapshot.fits`), and said once when it does not fit."""
        if self._snapshot is None:
            fits, line = self._fits(state)
            self._snapshot = bool(fits)
            if fits is False and line and jax.process_index() == 0:
                print(
                    f"gem-train: checkpoints: {line}: saves block for the device-to-host copy instead (checkpoint.snapshot=on forces snapshots)",
                    flush=True,
                )
        return self._snapshot

    def _fits(self, tree) -> tuple[bool | None, str | None]:
        """Whether saves may snapshot `tree` by the config, or by `snapshot.fits` for "auto"; with its line (None: the config decided)."""
        if not self.config.async_save or self.config.snapshot == "off":
            return False, None
        if self.config.snapshot == "on":
            return True, None
        return snapshot.fits(tree)

    def _poll(self) -> None:
        """Finishes (records, queues the manifest of) a write that is done; no waiting, no collective."""
        if self._writing is None or (self._staging is not None and not self._staging.done()):
            return
        with self._lock:
            saving = self.manager.is_saving_in_progress()
        if not saving:
            self._finish_write()

    def _still_writing(self) -> bool:
        """Whether a write is in flight on any process: in a multi-process run all must decide alike
        (one small all-gather, only at steps where a save is due or deferred)."""
        writing = self._writing is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            writing = bool(np.any(multihost_utils.process_allgather(np.array(writing))))
        return writing

    def _finish_write(self) -> None:
        """Waits for the save in flight (its hand-over to Orbax, then its files), records its write time and queues its manifest."""
        record, self._writing = self._writing, None
        staging, self._staging = self._staging, None
        if record is None:
            return
        try:
            if staging is not None:
                staging.result()
            with self._lock:
                self.manager.wait_until_finished()
        except Exception as error:
            raise self._write_failed(record.step, error) from error
        record.write_s = (self._committed_at or time.perf_counter()) - record.started
        if self.step_path(record.step).is_dir():
            record.bytes = disk_space.directory_bytes(self.step_path(record.step))
        self._queue_manifest(record.step)

    def _announce_deferral(self, step: int) -> None:
        due, self._pending = self._pending, None
        self.deferred.append((due, step))
        if len(self.deferred) == 1 and jax.process_index() == 0:
            last = self.saves[-1]
            print(
                f"gem-train: checkpoint step {last.step} took {last.write_s:.1f} s to write, more than the "
                f"{self.config.every_steps} steps (checkpoint.every_steps) to step {due}: step {due}'s save was deferred to "
                f"step {step}, when the write had finished, and later saves wait likewise (a save never blocks on disk writes; "
                "fewer saves or a faster filesystem keep the cadence)",
                flush=True,
            )

    def _queue_manifest(self, step: int) -> None:
        if self.read_only or jax.process_index() != 0 or step in self._manifest_jobs:
            return
        if integrity.has_manifest(self.step_path(step)):
            return
        self._manifest_jobs[step] = self._manifests.submit(_write_manifest, self.step_path(step))

    def _await_manifests(self, steps: list[int]) -> None:
        """Waits for the manifests of `steps` (before a save whose rotation deletes them, and in `wait`)."""
        for step in steps:
            job = self._manifest_jobs.pop(step, None)
            try:
                job and job.result()
            except OSError as error:
                raise self._write_failed(step, error, committed=True) from error

    def _write_failed(self, step: int, error: BaseException, *, committed: bool = False) -> CheckpointWriteError:
        """The `CheckpointWriteError` of `step`'s save; removes its partial files (unless `committed`)."""
        if not committed and jax.process_index() == 0:
            _remove_partial(self.directory, step)
        with self._lock:
            self.manager.reload()  # Orbax forgets rotated steps at save time; the disk still holds them
        good = [s for s in self.all_steps() if s != step or committed]
        cause = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}" if str(error) else type(error).__name__
        return CheckpointWriteError(
            step, self.directory, disk_space.free_bytes(self.directory), disk_space.is_disk_full(error), max(good, default=None), cause,
            self.config.max_to_keep,
        )

    def _quarantine(self, step: int, quarantine_dir: Path) -> Path:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = Path(quarantine_dir) / f"{step}-{stamp}"
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.step_path(step)), str(target))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"gem-quarantine-{step}")
        with self._lock:
            self.manager.reload()
        return target


def _remove_partial(directory: Path, step: int) -> None:
    """Deletes `step`'s temporary directory under `directory`, and again while it comes back.

    When one array's write fails, TensorStore writes of the save's other arrays may still be in
    flight in its own threads, which Orbax's failed future does not wait for; they recreate
    their parent directories. So the directory is removed until it has stayed away for
    `_PARTIAL_QUIET_S`, for at most `_PARTIAL_REMOVAL_S` (a restart's Orbax cleanup of
    temporary directories removes anything left after that).
    """
    began = quiet_since = time.monotonic()
    while True:
        partials = list(directory.glob(f"{step}{TMP_SUFFIX}*"))
        for partial in partials:
            shutil.rmtree(partial, ignore_errors=True)
        now = time.monotonic()
        if partials:
            quiet_since = now
        if now - quiet_since >= _PARTIAL_QUIET_S or now - began >= _PARTIAL_REMOVAL_S:
            return
        time.sleep(0.05)


def _free(tree) -> None:
    """Frees the device buffers of `tree`'s arrays now (a snapshot handed over, a state read from a corrupt step)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.delete()


def _checkpointed(state):
    """What a checkpoint of `state` holds: a `TrainState`'s `SavedState` (no compute copy), any other tree whole."""
    return state.checkpointed() if isinstance(state, TrainState) else state


def _restored(saved, abstract_state):
    """The state restored onto `abstract_state`: a `TrainState` with its compute copy rebuilt
    (`SavedState.train_state`), any other tree as read."""
    return saved.train_state(abstract_state) if isinstance(abstract_state, TrainState) else saved


def _restore_args(abstract_state: TrainState) -> ocp.args.PyTreeRestore:
    """Orbax's restore of what a checkpoint holds of `abstract_state` (`_checkpointed`), onto its shapes, dtypes and
    shardings."""
    abstract_state = _checkpointed(abstract_state)
    return ocp.args.PyTreeRestore(item=abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))


def _write_manifest(step_dir: Path) -> None:
    """`integrity.write_manifest`, skipped for a step deleted meanwhile (moved aside as corrupt)."""
    try:
        integrity.write_manifest(step_dir)
    except FileNotFoundError:
        pass
