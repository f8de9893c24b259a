"""Metric sinks: a JSONL file and TensorBoard behind one `log` call, and the concise stdout train line.

A resumed run replays the steps after its checkpoint; records that an earlier
start wrote for those steps are dropped when the logger opens (`resume_step`), from
`metrics.jsonl` and, through TensorBoard's purge step, from the event files, so each
step is recorded once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from pathlib import Path

import numpy as np

from gem_jax.train.metrics import one_class_note
from gem_jax.train.tensorboard_events import EventWriter

# Counters printed on the train line only when non-zero (they are always in metrics.jsonl).
COUNTER_SUFFIXES = ("/overflow", "/out_of_range")


def _scalars(record: dict) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def _drop_after(path: Path, step: int) -> int:
    """Rewrites `path` without the records of steps after `step` (atomically); returns how many it dropped."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] > step:
                continue
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill: not a record
            continue
        kept.append(line)
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return len(lines) - len(kept)


class MetricLogger:
    """Appends records to `<workdir>/metrics.jsonl` and TensorBoard `<workdir>/tensorboard`.

    Args:
      workdir: the run's workdir.
      resume_step: the step training resumes from; records of later steps (written
        by a start that stopped before its next checkpoint) are removed.
      write: False: open nothing and drop every record (the processes other than
        process 0 of a multi-process run, which share its workdir and its records).
    """

    def __init__(self, workdir: Path, resume_step: int = 0, *, write: bool = True):
        self.write = write
        if not write:
            return
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "metrics.jsonl"
        if path.exists():
            _drop_after(path, resume_step)
        self.jsonl = open(path, "a", encoding="utf-8")
        self.tensorboard = EventWriter(workdir / "tensorboard", purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, kind: str, record: dict, *, not_in_tensorboard: Collection[str] = ()) -> None:
        """Writes `record` (flat dict of scalars) for `step`; `kind` is "train", "eval" or "summary".

        Keys in `not_in_tensorboard` go to the JSONL record only (values already plotted under another kind).
        """
        if not self.write:
            return
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}
        self.jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self.jsonl.flush()
        for key, value in _scalars(record).items():
            if math.isfinite(value) and key not in not_in_tensorboard:
                self.tensorboard.add_scalar(f"{kind}/{key}", value, step)
        self.tensorboard.flush()

    def close(self) -> None:
        if not self.write:
            return
        self.jsonl.close()
        self.tensorboard.close()


def format_metric(value, spec: str) -> str:
    """`value` formatted with `spec`; "n/a" for an undefined metric (None, or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def eval_line(step: int, record: dict, task_names) -> str:
    """The stdout line of an eval record: its float metrics (n/a where undefined), then, when a task's
    eval examples are all of one class, the one-line reason its AUC and NE are n/a."""
    line = f"step {step}: " + ", ".join(
        f"{k}={format_metric(v, '.4f')}" for k, v in record.items() if v is None or isinstance(v, float)
    )
    note = one_class_note(record, task_names)
    return line if note is None else f"{line}\nstep {step}: {note}"


def train_line(step: int, record: dict, task_names) -> str:
    """The stdout line of a train record: loss, gradient norm, learning rate, per-task NE (n/a where the
    window holds one class), speed, balance; the lookup counters only when non-zero (per-task BCE and the
    rest are in metrics.jsonl)."""
    parts = [f"loss={record['loss']:.4f}", f"gnorm={record['grad_norm']:.3g}", f"lr={record['learning_rate']:.3g}"]
    parts.append("ne=" + "/".join(format_metric(record[f"ne_{name}"], ".3f") for name in task_names))
    parts.append(f"ex/s={record['examples_per_s']:.4g}")
    parts.append(f"TFLOP/s={record['tflops_per_s']:.3g}")
    if "mfu" in record:
        parts.append(f"mfu={record['mfu']:.1%}")
    parts.append(f"imbalance={record['load_imbalance_mean']:.3f}/{record['load_imbalance_max']:.3f}")
    parts.append(f"slack={record['slack_fraction']:.1%}")
    parts += [f"{k}={v}" for k, v in record.items() if k.endswith(COUNTER_SUFFIXES) and v]
    return f"step {step}: " + " ".join(parts)
