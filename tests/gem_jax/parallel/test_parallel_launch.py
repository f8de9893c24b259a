"""Launch plumbing: the process layout from the environment, and the XLA flags parse with the pinned jaxlib."""

import os
import subprocess
import sys

import numpy as np
import pytest

from gem_jax.parallel.distributed import check_processes_agree, describe_mismatch, encode_values, layout_from_env


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


def test_mismatch_report_names_each_differing_process_and_field():
    identity = {"source": "SYNTHETIC", "fingerprint": "ab" * 32, "num_train_examples": 80, "num_eval_examples": 64, "skipped_rows": 0}
    other = {**identity, "num_train_examples": 70, "fingerprint": "cd" * 32}
    renamed = {k.upper(): v for k, v in identity.items()}
    gathered = np.stack([encode_values(v) for v in (identity, identity, other, renamed)])
    assert gathered.shape == (4, 6, 8) and gathered.dtype == np.uint8
    assert describe_mismatch(gathered, identity) == [
        "process 2: fingerprint differs, num_train_examples 70 (process 0: 80)",
        "process 3: holds other fields than process 0",
    ]
    assert describe_mismatch(gathered[:2], identity) == []
    negative = {"n": -(2**40)}
    assert describe_mismatch(np.stack([encode_values(negative), encode_values({"n": 3})]), negative) == ["process 1: n 3 (process 0: -1099511627776)"]


def test_a_single_process_agrees_without_communicating():
    check_processes_agree({"num_train_examples": 1}, "data set")  # no jax.distributed here: returns at once
