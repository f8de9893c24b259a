"""`gem-train` in a subprocess under SIGTERM, a double SIGINT and a second run on its workdir."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gem_jax.train.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow  # each start of the CLI takes 20-60 s on a loaded 2-core CPU


def _start(repo_root, workdir, *extra):
    env = dict(os.environ, PYTHONPATH=str(repo_root), JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-m", "gem_jax.cli", "--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(workdir),
         "--no-progress", "--set", "loop.num_steps=200", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=repo_root,
    )


def _wait_for_step(process, step):
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(f"step {step}:"):
            return lines
    raise AssertionError("the run ended before step {step}:\n" + "".join(lines) + process.stderr.read())


def test_sigterm_saves_the_finished_step_and_a_second_run_is_refused(repo_root, tmp_path):
    first = _start(repo_root, tmp_path)
    _wait_for_step(first, 3)
    second = _start(repo_root, tmp_path)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 2
    assert f"gem-train: {tmp_path} is in use by another run (process {first.pid} on this host" in err

    sent = time.perf_counter()
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    exit_seconds = time.perf_counter() - sent
    assert first.returncode == PREEMPTED_EXIT_CODE, err
    last_logged = max(int(line.split(":")[0].split()[1]) for line in out.splitlines() if line.startswith("step "))
    assert f"stopped on SIGTERM after step {last_logged}; newest checkpoint: step {last_logged}" in err
    assert (tmp_path / "checkpoints" / str(last_logged) / "checksums.json").is_file()  # saved, finished, sealed
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("gem-train:")] == [  # the notice and the stop message
        "gem-train: SIGTERM received: finishing the current step and saving a checkpoint (send it again to abort at once)",
        f"gem-train: stopped on SIGTERM after step {last_logged}; newest checkpoint: step {last_logged} "
        f"({tmp_path.absolute() / 'checkpoints' / str(last_logged)}); run the same command again to resume",
    ]
    assert exit_seconds < 30
    assert not (tmp_path / ".lock.0").exists()


def test_second_sigint_aborts_at_once(repo_root, tmp_path):
    run = _start(repo_root, tmp_path)
    _wait_for_step(run, 2)
    run.send_signal(signal.SIGINT)
    notice = run.stderr.readline()  # two signals sent back to back would arrive as one
    assert "SIGINT received: finishing the current step" in notice
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGINT
    assert "second signal (SIGINT): aborting without saving" in err and "Traceback" not in err
