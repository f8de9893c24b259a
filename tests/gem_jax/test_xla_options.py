"""`gem_jax.xla_options`: the flags a process adds to `XLA_FLAGS`, and what XLA takes from the variable."""

import os
import subprocess
import sys


def test_the_project_xla_flags_join_the_environment_s_own_which_keep_their_values(monkeypatch):
    """gem-train (and train_bench) add `gem_jax.xla_options.XLA_FLAGS` ahead of the environment's flags, skipping any
    the environment names (its value kept, its text untouched), add nothing when the launch scripts' export already
    holds them or `XLA_FLAGS` names a file of flags, and leave the process's own environment alone once jax's
    backends exist (this test process's have started: XLA would not read the variable again)."""
    from gem_jax import xla_options

    env = {}
    assert xla_options.add_project_flags(env) == list(xla_options.XLA_FLAGS)
    assert env["XLA_FLAGS"].split() == list(xla_options.XLA_FLAGS)
    given = "--xla_gpu_enable_triton_gemm=true  --xla_dump_to='/tmp/a  b'"
    env = {"XLA_FLAGS": given}
    added = xla_options.add_project_flags(env)
    assert "--xla_gpu_enable_triton_gemm=false" not in added and len(added) == len(xla_options.XLA_FLAGS) - 1
    assert env["XLA_FLAGS"] == " ".join(added) + " " + given
    exported = {"XLA_FLAGS": " ".join(xla_options.XLA_FLAGS) + " "}  # scripts/xla_flags.py --env: "$flags ${XLA_FLAGS:-}"
    assert xla_options.add_project_flags(exported) == [] and exported["XLA_FLAGS"] == " ".join(xla_options.XLA_FLAGS) + " "
    from_file = {"XLA_FLAGS": "/etc/xla_flags.txt"}
    assert xla_options.add_project_flags(from_file) == [] and from_file == {"XLA_FLAGS": "/etc/xla_flags.txt"}
    import jax

    fresh = subprocess.run(  # a process that has not started jax's backends gets the flags in its environment
        [sys.executable, "-c", "import os, jax; from gem_jax import xla_options; print(len(xla_options.add_project_flags())); "
         "print(os.environ['XLA_FLAGS']); jax.devices()"],
        env={**os.environ, "XLA_FLAGS": "--xla_dump_to=/tmp/x", "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, check=True,
    )
    assert fresh.stdout.split("\n")[:2] == [str(len(xla_options.XLA_FLAGS)), " ".join(xla_options.XLA_FLAGS) + " --xla_dump_to=/tmp/x"]
    jax.devices()  # this process's backends exist
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert xla_options.add_project_flags() == [] and os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_other_flags_join_the_same_way_and_flag_in_effect_reads_their_value():
    """`add_project_flags(flags=...)` adds a benchmark's own flag by the same rule; `flag_in_effect` says whether the
    variable gives a flag exactly its value (train_bench records it for the traced step's CUDA graphs)."""
    from gem_jax import xla_options

    flag = "--xla_enable_command_buffers_during_profiling=true"
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert not xla_options.flag_in_effect(flag, env)
    assert xla_options.add_project_flags(env, flags=(flag,)) == [flag] and env["XLA_FLAGS"] == flag + " --xla_dump_to=/tmp/x"
    assert xla_options.flag_in_effect(flag, env)
    given = {"XLA_FLAGS": "--xla_enable_command_buffers_during_profiling=false"}
    assert xla_options.add_project_flags(given, flags=(flag,)) == [] and not xla_options.flag_in_effect(flag, given)
    assert not xla_options.flag_in_effect(flag, {"XLA_FLAGS": "/etc/xla_flags.txt"})  # a file of flags is not read


def test_effective_flags_are_what_xla_takes_from_the_variable():
    from gem_jax.xla_options import effective_flags

    assert effective_flags("") == {}
    assert effective_flags(" --a=1  --b --a=2 ") == {"--a": "2", "--b": None}
    assert effective_flags("/etc/xla_flags.txt ") == "/etc/xla_flags.txt"
