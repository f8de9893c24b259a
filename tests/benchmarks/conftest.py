"""Fixtures of the benchmark scripts' tests."""

import importlib.util

import pytest


@pytest.fixture(scope="session")
def load_benchmark(repo_root):
    """`load_benchmark(name)` imports `benchmarks/<name>.py` by its path (CI's pytest does not put the repository root on `sys.path`)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name.lstrip('_')}", repo_root / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
