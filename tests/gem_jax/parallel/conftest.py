"""Runs a worker script (`parallel_worker.py`, `exchange_worker.py`) in a subprocess with fake CPU devices (this process has one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("parallel_worker.py")


def worker_env(devices: int, **extra: str) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu", **extra}


@pytest.fixture(scope="session")
def run_worker():
    """`run_worker(mode, tmp_path, *args, devices=8, worker=parallel_worker.py) -> report dict` (the worker's JSON)."""

    def run(mode: str, tmp_path: Path, *args, devices: int = 8, timeout: int = 900, worker: Path = WORKER) -> dict:
        out = tmp_path / f"{mode}.json"
        proc = subprocess.run(
            [sys.executable, str(worker), mode, str(out), *map(str, args)], env=worker_env(devices), capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out.read_text())

    return run


@pytest.fixture(scope="session")
def start_worker():
    """`start_worker(mode, out, *args, devices, **env) -> Popen` for multi-process runs."""

    def start(mode: str, out: Path, *args, devices: int, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(out), *map(str, args)],
            env=worker_env(devices, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    return start
