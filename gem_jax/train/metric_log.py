"""Metric sinks: stdout, a JSONL file and TensorBoard, behind one `log` call."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter


def _scalars(record: dict) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class MetricLogger:
    """Appends records to `<workdir>/metrics.jsonl` and TensorBoard `<workdir>/tensorboard`."""

    def __init__(self, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
        self.tensorboard = SummaryWriter(str(workdir / "tensorboard"))

    def log(self, step: int, kind: str, record: dict) -> None:
        """Writes `record` (flat dict of scalars) for `step`; `kind` is "train", "eval" or "summary"."""
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}
        self.jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self.jsonl.flush()
        for key, value in _scalars(record).items():
            if math.isfinite(value):
                self.tensorboard.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.jsonl.close()
        self.tensorboard.close()
