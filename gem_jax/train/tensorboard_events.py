"""TensorBoard event files of scalars, written with TensorBoard's own protos and record framing.

A TensorBoard writer of tensorboardX or `tensorboard.summary` imports PyTorch
(tensorboardX does, whenever it is installed) or TensorFlow (`tf.io.gfile`, whenever
it is installed) on first use: ~6 s of a GEM-width job's start-up on the H200 went to
`import torch` alone. `EventWriter` needs neither: each record is an `Event` protobuf
(`tensorboard.compat.proto`) in TFRecord framing (`RecordWriter`: length, masked
CRC32C, data, masked CRC32C), the format `tensorboard --logdir` reads.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

# Two writers of one process opened within the same second get distinct files, in the order opened.
_FILE_NUMBER = itertools.count()


class EventWriter:
    """Appends scalar events to a new `events.out.tfevents.*` file in `logdir`.

    Args:
      logdir: the folder (created if missing).
      purge_step: when given, TensorBoard drops the events of earlier files at this
        step and after (a `SessionLog.START` at that step): a resumed run replaces
        what its previous start logged after its checkpoint.

    `flush` hands what was added to the OS (a run killed later keeps it).
    """

    def __init__(self, logdir: str | Path, *, purge_step: int | None = None):
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_NUMBER):06d}"
        self.path = logdir / name
        self._records = RecordWriter(open(self.path, "wb"))  # noqa: SIM115  (closed by `close`)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Records `value` (a float) under `tag` at `step`."""
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._write(Event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()

    def _write(self, event: Event) -> None:
        self._records.write(event.SerializeToString())
