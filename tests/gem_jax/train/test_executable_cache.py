"""The on-disk cache of compiled programs: hits skip lowering, keys follow everything that shapes a program."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.train import executable_cache
from gem_jax.train.executable_cache import ExecutableCache, program_key

REPO = Path(__file__).resolve().parents[3]


def _step(x, y):
    return {"sum": (x * 2.0 + y).sum(), "x": x + 1.0}


def _args(n=8):
    return (jax.ShapeDtypeStruct((n, 4), jnp.float32), jax.ShapeDtypeStruct((n, 4), jnp.float32))


def test_a_second_cache_loads_what_the_first_compiled_and_computes_the_same(tmp_path):
    jitted = jax.jit(_step)
    x, y = np.arange(32, dtype=np.float32).reshape(8, 4), np.ones((8, 4), np.float32)
    first, report = ExecutableCache(tmp_path).compile("step", jitted, _args(), {"width": 4})
    assert (report.source, report.note) == ("compiled", "")
    second, again = ExecutableCache(tmp_path).compile("step", jitted, _args(), {"width": 4})
    assert again.source == "loaded" and again.lower_s == 0.0
    np.testing.assert_array_equal(jax.device_get(second(x, y))["x"], x + 1.0)  # the identical program: exact
    assert float(second(x, y)["sum"]) == float(first(x, y)["sum"]) == float((x * 2.0 + y).sum())


def test_the_key_changes_with_shapes_job_and_source(monkeypatch):
    base = program_key("step", {"width": 4}, _args())
    assert program_key("step", {"width": 4}, _args()) == base
    assert program_key("step", {"width": 4}, _args(16)) != base
    assert program_key("step", {"width": 5}, _args()) != base
    assert program_key("eval", {"width": 4}, _args()) != base
    with monkeypatch.context() as flags:
        flags.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
        assert program_key("step", {"width": 4}, _args()) != base
    assert program_key("step", {"width": 4}, _args()) == base
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited")
    assert program_key("step", {"width": 4}, _args()) != base


def test_an_unreadable_entry_is_named_removed_and_compiled_again(tmp_path, capsys):
    jitted = jax.jit(_step)
    ExecutableCache(tmp_path).compile("step", jitted, _args(), {})
    (entry,) = (tmp_path / executable_cache.SUBDIR).glob("*.bin")
    entry.write_bytes(b"truncated")
    _, report = ExecutableCache(tmp_path).compile("step", jitted, _args(), {})
    assert report.source == "compiled"
    assert f"cached program {entry} is unreadable" in capsys.readouterr().err
    assert entry.read_bytes() != b"truncated"


def test_no_directory_always_compiles(tmp_path):
    _, report = ExecutableCache(None).compile("step", jax.jit(_step), _args(), {})
    assert report.source == "compiled"


def test_another_process_loads_the_entry(tmp_path):
    """Tree definitions and the executable survive the trip to a new process."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from gem_jax.train.executable_cache import ExecutableCache
        def _step(x, y):
            return {{"sum": (x * 2.0 + y).sum(), "x": x + 1.0}}
        args = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
        compiled, report = ExecutableCache({str(tmp_path)!r}).compile("step", jax.jit(_step), args, {{}})
        x = np.arange(32, dtype=np.float32).reshape(8, 4)
        print(report.source, float(compiled(x, np.ones((8, 4), np.float32))["sum"]))
    """)
    run = lambda: subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    assert run()[0] == "compiled"
    source, value = run()
    assert source == "loaded" and float(value) == float((np.arange(32) * 2.0 + 1).sum())
