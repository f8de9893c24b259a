"""Compiled programs kept on disk under a key known before tracing: a warm start skips trace, lowering and compile.

jax's persistent compilation cache (`gem_jax.train.compile_cache`) keys an executable by its
optimized HLO, so a warm start still traces the model and lowers it to StableHLO before it can
look the executable up. At GEM width on one H200 that Python work is ~10 s per program
(`benchmarks/lowering_bench.py`: trace 1-1.7 s, lowering 8.5-10.7 s, nearly independent of the
layer count), and a run compiles one program per token capacity: nine at `configs/gem_h200.py`.
This cache keys each compiled program by what determines it, computed without tracing:

- the program's name and the abstract arguments (tree structure, shapes, dtypes, shardings);
- the caller's description of the job (the resolved config and feature spec, minus what
  cannot change the program);
- the source of `gem_jax` and `pallas_kernels` (sha256 of every `.py` file's bytes);
- jax and jaxlib versions, the backend's platform and version, the devices' kinds and ids,
  the process index (each process of a multi-process run compiles for its own devices);
- `XLA_FLAGS` (the flags XLA takes from it, whatever their order, spacing and repeats:
  `gem_jax.xla_options.effective_flags`) and the jax config options that change compiled code.

A hit deserializes the executable (`jax.experimental.serialize_executable`, as MaxText's
AOT-compiled train steps are saved and loaded); a miss compiles and stores it. Entries are
written atomically (a temporary file renamed), so a crash never leaves a half entry that
looks whole; an entry that cannot be read is reported, removed and recompiled. Beside each
entry, `<key>.json` records the seconds its lowering and compile took (`build_seconds`): a
warm start that loads a program still knows what building it costs. Loading an entry runs
code from it: keep the cache in a directory only you write.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from gem_jax.xla_options import effective_flags

SUBDIR = "executables"
# jax config options that change the compiled program without changing its arguments.
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion", "jax_threefry_partitionable")
_PACKAGES = ("gem_jax", "pallas_kernels")


@functools.cache
def source_digest() -> str:
    """sha256 over the relative path and bytes of every `.py` file of `gem_jax` and `pallas_kernels`."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _describe_leaf(leaf) -> str:
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    where = f"{dict(mesh.shape)}:{spec}" if mesh is not None else repr(sharding)
    return f"{tuple(leaf.shape)}:{leaf.dtype}:{where}"


def program_key(name: str, job: Any, abstract_args: tuple) -> str:
    """The cache key (hex sha256) of program `name` of a job over `abstract_args`.

    Args:
      name: which program (e.g. `"train_step"`).
      job: JSON-serialisable description of everything besides the arguments that shapes the
        program (the resolved config and feature spec); `default=str` renders the rest.
      abstract_args: the program's arguments: arrays or `jax.ShapeDtypeStruct`s with shardings.
    """
    leaves, treedef = jax.tree.flatten(abstract_args)
    devices = jax.devices()
    material = {
        "name": name,
        "job": job,
        "args": [str(treedef)] + [_describe_leaf(leaf) for leaf in leaves],
        "source": source_digest(),
        "jax": jax.__version__,
        "jaxlib": metadata.version("jaxlib"),
        "process": [jax.process_index(), jax.process_count()],
        "backend": [devices[0].platform, devices[0].client.platform_version],
        "devices": [f"{d.id}:{d.device_kind}" for d in devices],
        "xla_flags": effective_flags(os.environ.get("XLA_FLAGS", "")),  # order, spacing and repeats aside
        "options": {option: str(getattr(jax.config, option, None)) for option in _JAX_OPTIONS},
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


class ExecutableCache:
    """Compiled programs under `directory/executables/<key>.bin` (None: no cache, always compile)."""

    def __init__(self, directory: str | Path | None):
        self.directory = None if directory is None else Path(directory) / SUBDIR
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, name: str, abstract_args: tuple, job: Any) -> Path | None:
        """Where program `name` over `abstract_args` of `job` is kept (`program_key`); None without a directory."""
        return None if self.directory is None else self.directory / f"{program_key(name, job, abstract_args)}.bin"

    @staticmethod
    def load(path: Path | None) -> jax.stages.Compiled | None:
        """The program kept at `path`, or None when there is none; an unreadable entry is reported and removed."""
        if path is None or not path.exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as error:  # a truncated or foreign file: recompile and replace it
            print(f"gem-train: cached program {path} is unreadable ({type(error).__name__}: {error}); compiling it again", file=sys.stderr, flush=True)
            path.unlink(missing_ok=True)
            return None

    @staticmethod
    def store(path: Path | None, compiled: jax.stages.Compiled, build_s: float | None = None) -> str:
        """Keeps `compiled` at `path` (atomically), and `build_s` (seconds its lowering and compile
        took) beside it; returns why it was not stored, else ""."""
        if path is None:
            return ""
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
        except (ValueError, NotImplementedError, TypeError, pickle.PicklingError) as error:
            return f"not stored: {type(error).__name__}: {error}"
        try:
            if build_s is not None:
                _write_atomically(path.with_suffix(".json"), json.dumps({"build_s": build_s}).encode())
            _write_atomically(path, payload)
        except OSError as error:
            return f"not stored: {error}"
        return ""

    @staticmethod
    def build_seconds(path: Path | None) -> float | None:
        """Seconds the lowering and compile of the program kept at `path` took when it was stored
        (None: no record, or one that cannot be read)."""
        if path is None:
            return None
        try:
            return float(json.loads(path.with_suffix(".json").read_text())["build_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _write_atomically(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file renamed over it (removed if the write fails)."""
    temporary = path.with_suffix(f"{path.suffix}.tmp{os.getpid()}")
    try:
        temporary.write_bytes(data)
        temporary.replace(path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise
