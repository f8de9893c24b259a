"""Test-wide settings: CPU only, float32 matmuls at full precision, real paths."""

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU interpret mode runs each simulated warpgroup of a CTA as its own XLA:CPU program,
# and a program's later steps may continue on an XLA:CPU intra-op pool thread that then blocks
# in a barrier wait; the kernel call's own callback blocks one more. With the default pool (one
# thread per core) a 2-core machine can have every pool thread parked in a barrier while a
# warpgroup that would release them waits for a thread: a hang in about 3 runs of 4 of the
# causal GDPA tests (benchmarks/gdpa.md, "Interpret-mode hang"). Kernels of 3 warpgroups need
# at least 4 threads; 8 leaves room.
os.environ.setdefault("PJRT_NPROC", "8")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Tests run tiny shapes: compile time dominates, so compile with few optimizations.
jax.config.update("jax_disable_most_optimizations", True)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def load_script():
    """`load_script(name)` imports `scripts/<name>.py` by its path (the scripts are no package)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` beside the repo (override with GEM_SHARED_DATA)."""
    return Path(os.environ.get("GEM_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))

# Compiled executables are cached across the suite's processes and runs: the end-to-end
# tests compile the same tiny train step several times.
jax.config.update("jax_compilation_cache_dir", str(Path(os.environ.get("GEM_TEST_JAX_CACHE", "/tmp/gem-jax-test-cache"))))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# gem-train run in-process by the tests leaves the suite's cache settings alone.
os.environ.setdefault("GEM_COMPILE_CACHE_DIR", "off")


@pytest.fixture(autouse=True)
def _restore_launch_environment():
    """gem-train sets the process's GPU memory share when none is set (`gem_jax.device_memory`) and adds the
    project's XLA flags (`gem_jax.xla_options`); a test that runs it in-process leaves the variables as they were,
    so no later test, nor a process it starts, sees a share or flags it did not set."""
    from gem_jax.device_memory import MEMORY_FRACTION_VARIABLES

    saved = {name: os.environ.get(name) for name in (*MEMORY_FRACTION_VARIABLES, "XLA_FLAGS")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
