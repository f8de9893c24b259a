"""Runs a worker script (`parallel_worker.py`, `exchange_worker.py`) in a subprocess with fake CPU devices (this process has one).

Each worker runs under `timeout -k 5`: once `jax.distributed` is up, JAX handles SIGTERM, so a
hung worker is killed 5 s after its time is up, and the test fails instead of waiting.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("parallel_worker.py")


def limited(command: list[str], seconds: int) -> list[str]:
    """`command` under coreutils `timeout`: SIGTERM after `seconds`, SIGKILL 5 s later."""
    return ["timeout", "-k", "5", str(seconds), *command]


def worker_env(devices: int, **extra: str) -> dict:
    """This process's environment with `devices` fake CPU devices; XLA flags already set here (say, a
    tolerance sweep's summation-order settings) come first, so the device count is the one that holds."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", **extra}


@pytest.fixture(scope="session")
def run_worker():
    """`run_worker(mode, tmp_path, *args, devices=8, worker=parallel_worker.py) -> report dict` (the worker's JSON)."""

    def run(mode: str, tmp_path: Path, *args, devices: int = 8, timeout: int = 900, worker: Path = WORKER) -> dict:
        out = tmp_path / f"{mode}.json"
        proc = subprocess.run(
            limited([sys.executable, str(worker), mode, str(out), *map(str, args)], timeout),
            env=worker_env(devices), capture_output=True, text=True, timeout=timeout + 30,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out.read_text())

    return run


def start_python(argv: list, *, devices: int, timeout: int = 900, **env: str) -> subprocess.Popen:
    """`python ARGV...` with `devices` fake CPU devices and `env`, under `limited`; stdout and stderr merged."""
    return subprocess.Popen(
        limited([sys.executable, *map(str, argv)], timeout),
        env=worker_env(devices, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="session")
def start_worker():
    """`start_worker(mode, out, *args, devices, timeout=900, **env) -> Popen` for multi-process runs."""
    return lambda mode, out, *args, **kwargs: start_python([WORKER, mode, out, *args], **kwargs)


@pytest.fixture(scope="session")
def start_cli():
    """`start_cli(*gem_train_args, devices, timeout=900, **env) -> Popen`: `python -m gem_jax.cli ...`."""
    return lambda *args, **kwargs: start_python(["-m", "gem_jax.cli", *args], **kwargs)
