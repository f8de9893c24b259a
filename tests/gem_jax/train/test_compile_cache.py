"""The persistent compilation cache of gem-train: where it goes, and that a second process hits it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gem_jax.train import compile_cache

# A fresh process (the suite's own cache is configured in conftest): cache `jit(x + 1)` in
# argv[1] and print the number of persistent-cache hits.
PROGRAM = """
import sys
import jax
from gem_jax.train import compile_cache
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
compile_cache.enable(sys.argv[1])
jax.block_until_ready(jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(5.0)))
print(len(hits))
"""


def test_directory_order_explicit_then_environment_then_workdir(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.cache_dir(tmp_path / "run", str(tmp_path / "flag")) == tmp_path / "flag"
    assert compile_cache.cache_dir(tmp_path / "run") == tmp_path / "env"
    monkeypatch.setenv(compile_cache.ENV_VAR, "OFF")
    assert compile_cache.cache_dir(tmp_path / "run") is None
    assert compile_cache.cache_dir(tmp_path / "run", "off") is None
    monkeypatch.delenv(compile_cache.ENV_VAR)
    assert compile_cache.cache_dir(tmp_path / "run") == tmp_path / "run" / "jax_cache"
    with pytest.raises(ValueError, match="workdir"):
        compile_cache.cache_dir(None)
    with pytest.raises(ValueError, match="empty"):
        compile_cache.cache_dir(tmp_path, " ")
    with pytest.raises(ValueError, match="thresholds"):
        compile_cache.enable(tmp_path, min_compile_time_s=-1)
    assert compile_cache.enable(None) is None


def test_second_process_loads_the_executable_from_the_cache(repo_root, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(repo_root), "JAX_PLATFORMS": "cpu"}
    run = lambda: subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "cache")], env=env, capture_output=True, text=True, check=True)
    assert run().stdout.split()[-1] == "0"  # cold: compiled and stored
    assert any(Path(tmp_path / "cache").iterdir())
    assert int(run().stdout.split()[-1]) >= 1  # warm: loaded


# gem-train in a fresh process, counting the persistent cache's hits and misses and the programs compiled.
JOB = """
import collections, json, sys
import jax
from gem_jax.cli import train_main
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **kw: events.update([event.rsplit("/", 1)[-1]]) if "compilation_cache/cache_" in event else None)
train_main(sys.argv[1:])
print("COUNTS " + json.dumps(events))
"""


def test_a_second_start_of_the_same_run_compiles_nothing(repo_root, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(repo_root), "JAX_PLATFORMS": "cpu"}
    args = ["--config", str(repo_root / "configs" / "gem_h200_tiny.py"), "--workdir", str(tmp_path / "run"), "--compile-cache", str(tmp_path / "cache"), "--no-progress"]

    def start(*extra):
        out = subprocess.run([sys.executable, "-c", JOB, *args, *extra], env=env, capture_output=True, text=True, check=True).stdout
        return json.loads(out.rsplit("COUNTS ", 1)[1]), out

    cold, cold_out = start()
    warm, warm_out = start("--force-new")  # the same run from its start: every program again
    assert cold.get("cache_misses", 0) >= 2  # at least the train and eval steps were compiled and stored
    assert "compiled 2 programs before the first step" in cold_out and "compiled 2 programs before the first step" in warm_out
    assert warm.get("cache_misses", 0) == 0, warm  # every program's key is the same in a new process
    assert warm.get("cache_hits", 0) >= cold["cache_misses"]
