"""Graceful stop on SIGTERM, SIGINT and SIGUSR1: finish the step, save, exit with `PREEMPTED_EXIT_CODE`.

Cluster schedulers announce the end of a job with a signal: SLURM sends SIGTERM at
the time limit or on preemption (and, with `sbatch --signal=USR1@120`, SIGUSR1 two
minutes before), Kubernetes SIGTERM, a terminal SIGINT on Ctrl-C. `StopSignals`
turns the first such signal into a request that the training loop reads once per
step: it finishes the step in flight, saves a checkpoint synchronously, waits for
the saves in flight and exits with `PREEMPTED_EXIT_CODE` (75, `EX_TEMPFAIL` of
sysexits.h: "try again later"). A second signal while stopping aborts at once
with `128 + signal number`, the shell's convention for a death by that signal.

In a multi-process run every process must stop after the same step (the save is
a collective), so `stop_requested` agrees across processes with one tiny
all-gather of the per-process flags (`jax.experimental.multihost_utils`); a
single process reads its own flag only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import jax
import numpy as np

PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint.

    Attributes:
      step: the last finished step (its checkpoint is on disk).
      signal_name: the signal that asked for the stop, e.g. "SIGTERM".
      checkpoint: the newest checkpoint on disk, e.g. "step 7 (runs/demo/checkpoints/7)".
    """

    def __init__(self, step: int, signal_name: str, checkpoint: str):
        super().__init__(f"stopped on {signal_name} after step {step}; newest checkpoint: {checkpoint}; run the same command again to resume")
        self.step = step
        self.signal_name = signal_name
        self.checkpoint = checkpoint


class StopSignals:
    """Context manager: while active, SIGTERM/SIGINT/SIGUSR1 request a stop instead of killing.

    Handlers can only be installed from the main thread; elsewhere (a training
    loop started from a worker thread) the context does nothing and signals keep
    their previous handlers.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            print(f"gem-train: second signal ({sig.name}): aborting without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.received = sig
        print(f"gem-train: {sig.name} received: finishing the current step and saving a checkpoint "
              "(send it again to abort at once)", file=sys.stderr, flush=True)

    def stop_requested(self) -> bool:
        """Whether any process received a stop signal; the same answer on every process."""
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.array(local))))

    @property
    def signal_name(self) -> str:
        return self.received.name if self.received is not None else "a signal of another process"
