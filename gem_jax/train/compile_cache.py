"""JAX's persistent compilation cache for training runs: a restart skips the XLA compile.

A GEM-width train step takes about two minutes to compile on an H200; with the cache a
second start with the same program (same config, code, jax and GPU) loads the executable
from disk instead. jax keys entries by the optimized HLO, the compile options, the
backend and the jax/jaxlib versions, so a stale entry is never used; it also keeps
XLA's per-fusion autotuning results under the same directory
(`jax_persistent_cache_enable_xla_caches`). Source: jax's persistent compilation cache
guide (docs/persistent_compilation_cache.md).

The directory is, in order: the explicit argument (`gem-train --compile-cache DIR`), the
environment variable `GEM_COMPILE_CACHE_DIR`, `<workdir>/jax_cache`. The word `off` (in
either place) turns the cache off. It is not part of the config, so moving the cache never
changes a run's identity (`run.json`).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV_VAR = "GEM_COMPILE_CACHE_DIR"
OFF = "off"
DEFAULT_SUBDIR = "jax_cache"


def cache_dir(workdir: str | Path | None, explicit: str | None = None) -> Path | None:
    """The cache directory for a run in `workdir` (None: the cache is off).

    Args:
      workdir: the run's directory; the default cache is `<workdir>/jax_cache`.
      explicit: a directory or `"off"` given on the command line; beats the environment.

    Raises:
      ValueError: `explicit` is empty, or neither it, `GEM_COMPILE_CACHE_DIR` nor `workdir`
        names a directory.
    """
    if explicit is not None and not explicit.strip():
        raise ValueError("empty compile cache directory; give a path or 'off'")
    choice = explicit if explicit is not None else os.environ.get(ENV_VAR) or None
    if choice is not None:
        return None if choice.strip().lower() == OFF else Path(choice)
    if workdir is None:
        raise ValueError(f"no compile cache directory: pass one, set {ENV_VAR}, or give a workdir")
    return Path(workdir) / DEFAULT_SUBDIR


def enable(directory: str | Path | None, *, min_compile_time_s: float = 0.0, min_entry_size_bytes: int = 0, create: bool = True) -> Path | None:
    """Points jax's persistent compilation cache at `directory` (None: leaves it off).

    Call before the first jit compile of the process. Every compiled program of at least
    `min_compile_time_s` seconds and `min_entry_size_bytes` bytes is stored (defaults:
    all of them, so that a warm start compiles nothing; small ones cost milliseconds).
    With `create` False the directory is not made now: jax makes it when it first uses the
    cache (`gem-train`: a start refused before compiling leaves no cache behind).

    Returns:
      The directory (absolute; created unless `create` is False), or None.

    Raises:
      ValueError: negative thresholds.
    """
    if min_compile_time_s < 0 or min_entry_size_bytes < 0:
        raise ValueError(f"thresholds must be >= 0, got {min_compile_time_s=} {min_entry_size_bytes=}")
    if directory is None:
        return None
    directory = Path(directory).expanduser().absolute()
    if create:
        directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    return directory
