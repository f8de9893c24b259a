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


def _compile_and_store(cache, jitted, args, job):
    """A miss as `gem_jax.train.programs.start_programs` handles it: compile, then store."""
    compiled = jitted.lower(*args).compile()
    return compiled, cache.store(cache.path("step", args, job), compiled)


def test_a_second_cache_loads_what_the_first_stored_and_computes_the_same(tmp_path):
    jitted = jax.jit(_step)
    x, y = np.arange(32, dtype=np.float32).reshape(8, 4), np.ones((8, 4), np.float32)
    first_cache = ExecutableCache(tmp_path)
    assert first_cache.load(first_cache.path("step", _args(), {"width": 4})) is None  # empty: a miss
    first, note = _compile_and_store(first_cache, jitted, _args(), {"width": 4})
    assert note == ""
    second_cache = ExecutableCache(tmp_path)
    second = second_cache.load(second_cache.path("step", _args(), {"width": 4}))
    assert second is not None
    np.testing.assert_array_equal(jax.device_get(second(x, y))["x"], x + 1.0)  # the identical program: exact
    assert float(second(x, y)["sum"]) == float(first(x, y)["sum"]) == float((x * 2.0 + y).sum())
    assert second_cache.load(second_cache.path("step", _args(16), {"width": 4})) is None  # another shape: a miss


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
    with monkeypatch.context() as flags:  # the same flags XLA takes, spaced, ordered or repeated otherwise: the same key
        flags.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false --xla_cpu_use_thunk_runtime=true")
        same = program_key("step", {"width": 4}, _args())
        for value in ("  --xla_cpu_enable_fast_math=false --xla_cpu_use_thunk_runtime=true ",  # `export XLA_FLAGS="$f ${XLA_FLAGS:-}"`
                      "--xla_cpu_use_thunk_runtime=true --xla_cpu_enable_fast_math=false",  # launch scripts' order against gem-train's
                      "--xla_cpu_enable_fast_math=true --xla_cpu_use_thunk_runtime=true --xla_cpu_enable_fast_math=false"):  # the last wins
            flags.setenv("XLA_FLAGS", value)
            assert program_key("step", {"width": 4}, _args()) == same, value
        flags.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true --xla_cpu_enable_fast_math=true")
        assert program_key("step", {"width": 4}, _args()) != same
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited")
    assert program_key("step", {"width": 4}, _args()) != base


def test_an_unreadable_entry_is_named_removed_and_missed(tmp_path, capsys):
    cache = ExecutableCache(tmp_path)
    _compile_and_store(cache, jax.jit(_step), _args(), {})
    (entry,) = (tmp_path / executable_cache.SUBDIR).glob("*.bin")
    assert entry == cache.path("step", _args(), {})
    entry.write_bytes(b"truncated")
    assert cache.load(entry) is None
    assert f"cached program {entry} is unreadable" in capsys.readouterr().err
    assert not entry.exists()


def test_the_build_seconds_are_kept_beside_the_entry(tmp_path):
    cache = ExecutableCache(tmp_path)
    path = cache.path("step", _args(), {})
    compiled = jax.jit(_step).lower(*_args()).compile()
    assert cache.store(path, compiled, build_s=73.5) == ""
    assert ExecutableCache(tmp_path).build_seconds(path) == 73.5
    other = cache.path("step", _args(16), {})
    assert cache.store(other, compiled) == "" and cache.build_seconds(other) is None  # not recorded: unknown
    path.with_suffix(".json").write_text("{")
    assert cache.build_seconds(path) is None  # unreadable: unknown, the entry itself still loads
    assert cache.load(path) is not None
    assert cache.build_seconds(None) is None
    assert sorted(p.name for p in (tmp_path / executable_cache.SUBDIR).iterdir()) == sorted(
        [path.name, path.with_suffix(".json").name, other.name]
    )  # no temporary files left


def test_no_directory_keeps_nothing():
    cache = ExecutableCache(None)
    assert cache.path("step", _args(), {}) is None and cache.load(None) is None
    assert cache.store(None, jax.jit(_step).lower(*_args()).compile()) == ""


def test_another_process_loads_the_entry(tmp_path):
    """Tree definitions and the executable survive the trip to a new process."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from gem_jax.train.executable_cache import ExecutableCache
        def _step(x, y):
            return {{"sum": (x * 2.0 + y).sum(), "x": x + 1.0}}
        args = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
        cache = ExecutableCache({str(tmp_path)!r})
        path = cache.path("step", args, {{}})
        compiled, source = cache.load(path), "loaded"
        if compiled is None:
            compiled, source = jax.jit(_step).lower(*args).compile(), "compiled"
            assert cache.store(path, compiled) == ""
        x = np.arange(32, dtype=np.float32).reshape(8, 4)
        print(source, float(compiled(x, np.ones((8, 4), np.float32))["sum"]))
    """)
    run = lambda: subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    assert run()[0] == "compiled"
    source, value = run()
    assert source == "loaded" and float(value) == float((np.arange(32) * 2.0 + 1).sum())
