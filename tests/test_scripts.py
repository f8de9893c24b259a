"""The scripts in scripts/ answer --help without starting anything, refuse bad arguments with
exit status 2, and run Python through the one interpreter rule of scripts/common.sh."""

import os
import subprocess
import sys

import pytest

SHELL_SCRIPTS = ["chaos.sh", "launch_local.sh", "launch_slurm.sh"]


@pytest.fixture
def fake_python(tmp_path):
    """An interpreter that only records its arguments (one line per call) in `calls.log`."""
    log = tmp_path / "calls.log"
    python = tmp_path / "fake-python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    python.chmod(0o755)
    return python, log


def run(repo_root, tmp_path, script, *args, python=None, **extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "SLURM_SUBMIT_DIR")} | extra_env
    env["TMPDIR"] = str(tmp_path / "tmp")  # where chaos.sh would make its run folder
    os.makedirs(env["TMPDIR"], exist_ok=True)
    if python:
        env["PYTHON"] = str(python)
    command = ["bash", str(repo_root / "scripts" / script), *args]
    return subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_shows_the_usage_and_starts_nothing(repo_root, tmp_path, fake_python, script, flag):
    python, log = fake_python
    done = run(repo_root, tmp_path, script, flag, python=python)
    assert done.returncode == 0, done.stderr
    assert f"scripts/{script}" in done.stdout and f"Interpreter: {python}" in done.stdout
    assert not log.exists() and not os.listdir(tmp_path / "tmp")


def test_xla_flags_answers_help_and_refuses_an_unknown_flag(repo_root):
    script = str(repo_root / "scripts" / "xla_flags.py")
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--env" in done.stdout and "XLA_FLAGS" in done.stdout
    done = subprocess.run([sys.executable, script, "--bogus"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("chaos.sh", ["--set"], "N must be a positive number of kills, got '--set'"),
        ("chaos.sh", ["0"], "N must be a positive number of kills, got '0'"),
        ("chaos.sh", ["2", "configs/nowhere.py"], "config file 'configs/nowhere.py' not found"),
        ("launch_local.sh", [], "expected NUM_PROCESSES CONFIG WORKDIR, got 0 argument(s)"),
        ("launch_local.sh", ["two", "configs/gem_sharded_tiny.py", "runs/x"], "NUM_PROCESSES must be a positive number, got 'two'"),
        ("launch_local.sh", ["2", "configs/nowhere.py", "runs/x"], "config file 'configs/nowhere.py' not found"),
        ("launch_slurm.sh", ["configs/gem_sharded_tiny.py"], "expected CONFIG WORKDIR, got 1 argument(s)"),
        ("launch_slurm.sh", ["configs/nowhere.py", "runs/x"], "config file 'configs/nowhere.py' not found"),
    ],
)
def test_a_bad_argument_is_a_usage_error(repo_root, tmp_path, fake_python, script, args, message):
    python, log = fake_python
    done = run(repo_root, tmp_path, script, *args, python=python)
    assert done.returncode == 2
    first, usage = done.stderr.splitlines()
    assert first == f"{script}: {message}" and usage.startswith("usage: ") and f"scripts/{script}" in usage
    assert not log.exists() and not os.listdir(tmp_path / "tmp")


def test_the_launch_and_chaos_scripts_run_python_through_the_interpreter_rule(repo_root, tmp_path, fake_python):
    python, log = fake_python
    run(repo_root, tmp_path, "launch_local.sh", "1", "configs/gem_sharded_tiny.py", str(tmp_path / "run"), python=python)
    calls = log.read_text().splitlines()
    assert calls[0] == f"{repo_root}/scripts/xla_flags.py --env"
    assert calls[1].startswith("-c from gem_jax.cli import train_main") and calls[1].endswith(f"--workdir {tmp_path / 'run'}")
    log.unlink()
    # the fake trains nothing, so the first kill (a second after the start, when the fake has long
    # exited) finds no run: exit 1, after both starts went to the fake
    done = run(
        repo_root, tmp_path, "chaos.sh", "1", "configs/movielens_tiny.py", str(tmp_path / "chaos"), python=python,
        CHAOS_MIN_S="1", CHAOS_MAX_S="1",
    )
    assert done.returncode == 1 and "found no run in training" in done.stdout
    assert [call.split(" --workdir ")[0] for call in log.read_text().splitlines()] == ["-m gem_jax.cli --config configs/movielens_tiny.py"] * 2


@pytest.mark.parametrize("venv, python, expected", [(False, None, "python3"), (True, None, "VENV"), (True, "/opt/py", "/opt/py")])
def test_the_interpreter_rule(repo_root, tmp_path, venv, python, expected):
    # $PYTHON when set, else REPO/.venv/bin/python when it exists, else python3
    if venv:
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\n")
        (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | ({"PYTHON": python} if python else {})
    code = f'REPO={tmp_path}; source {repo_root}/scripts/common.sh; echo "$PYTHON"'
    done = subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == expected.replace("VENV", f"{tmp_path}/.venv/bin/python")
