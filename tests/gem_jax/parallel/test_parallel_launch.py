"""Launch plumbing: the process layout from the environment, and the XLA flags parse with the pinned jaxlib."""

import os
import subprocess
import sys

import pytest

from gem_jax.parallel.distributed import layout_from_env


def test_explicit_layout():
    layout = layout_from_env({"GEM_COORDINATOR_ADDRESS": "10.0.0.1:1234", "GEM_NUM_PROCESSES": "16", "GEM_PROCESS_ID": "3", "GEM_LOCAL_DEVICE_IDS": "3"})
    assert (layout.coordinator_address, layout.num_processes, layout.process_id, layout.local_device_ids, layout.source) == ("10.0.0.1:1234", 16, 3, (3,), "explicit")


def test_slurm_and_single_process_layouts():
    assert layout_from_env({"SLURM_NTASKS": "32", "SLURM_JOB_ID": "7"}).source == "slurm"
    assert layout_from_env({"SLURM_NTASKS": "1"}) is None
    assert layout_from_env({}) is None


@pytest.mark.parametrize(
    "env, message",
    [
        ({"GEM_COORDINATOR_ADDRESS": "h:1", "GEM_NUM_PROCESSES": "2"}, r"\['GEM_PROCESS_ID'\] are not"),
        ({"GEM_COORDINATOR_ADDRESS": "h:1", "GEM_NUM_PROCESSES": "2", "GEM_PROCESS_ID": "2"}, "outside"),
        ({"GEM_COORDINATOR_ADDRESS": "h:1", "GEM_NUM_PROCESSES": "two", "GEM_PROCESS_ID": "0"}, "malformed"),
    ],
)
def test_bad_explicit_layouts_are_clear_errors(env, message):
    with pytest.raises(ValueError, match=message):
        layout_from_env(env)


def test_xla_flags_parse_with_the_pinned_jaxlib(repo_root):
    flags = subprocess.run([sys.executable, str(repo_root / "scripts" / "xla_flags.py")], capture_output=True, text=True, check=True).stdout.strip()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]  # XLA aborts on an unknown flag
