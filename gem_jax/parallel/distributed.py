"""Multi-host start-up: `jax.distributed.initialize` from the job's environment, one process per GPU.

One process per GPU is the layout JAX uses by default under SLURM and Open MPI on GPUs,
and the one NVIDIA's JAX-Toolbox recommends against collective hangs (see
docs/GPU_performance.md there). Sources of the process layout, first match wins:

1. explicit: `GEM_COORDINATOR_ADDRESS` (host:port of process 0), `GEM_NUM_PROCESSES`,
   `GEM_PROCESS_ID`, optional `GEM_LOCAL_DEVICE_IDS` (comma-separated);
2. SLURM with more than one task (`SLURM_NTASKS > 1`): JAX's own SLURM detection
   (coordinator on the first node of `SLURM_JOB_NODELIST`, one task per GPU);
3. otherwise a single process, nothing to initialise.

On CPU (tests), cross-process collectives need gloo; it is switched on here.

`check_processes_agree` is the start-up check that every process holds the same
thing (the data set's identity): one all-gather of a few bytes per process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping

import jax
import numpy as np

DIGEST_BYTES = 8  # bytes sent per value by `check_processes_agree`


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """Attributes:
    coordinator_address: host:port of process 0 (None: let JAX detect it).
    num_processes, process_id: None to let JAX detect them.
    local_device_ids: devices this process drives (None: JAX's default).
    source: "explicit" or "slurm".
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    source: str


def layout_from_env(env: Mapping[str, str] | None = None) -> ProcessLayout | None:
    """The process layout the environment describes, or None for a single-process run.

    Raises:
      ValueError: an explicit layout with a missing or malformed variable.
    """
    env = os.environ if env is None else env
    if "GEM_COORDINATOR_ADDRESS" in env:
        missing = [k for k in ("GEM_NUM_PROCESSES", "GEM_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(f"GEM_COORDINATOR_ADDRESS is set but {missing} are not")
        try:
            num, pid = int(env["GEM_NUM_PROCESSES"]), int(env["GEM_PROCESS_ID"])
            ids = env.get("GEM_LOCAL_DEVICE_IDS")
            local = tuple(int(i) for i in ids.split(",")) if ids else None
        except ValueError as exc:
            raise ValueError(f"malformed GEM_* process variables: {exc}") from None
        if not 0 <= pid < num:
            raise ValueError(f"GEM_PROCESS_ID {pid} is outside [0, GEM_NUM_PROCESSES={num})")
        return ProcessLayout(env["GEM_COORDINATOR_ADDRESS"], num, pid, local, "explicit")
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        return ProcessLayout(None, None, None, None, "slurm")
    return None


def initialize(env: Mapping[str, str] | None = None) -> ProcessLayout | None:
    """Calls `jax.distributed.initialize` for the environment's layout (before any other jax use).

    Returns:
      The layout, or None for a single process (nothing done).
    """
    layout = layout_from_env(env)
    if layout is None:
        return None
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=layout.coordinator_address,
        num_processes=layout.num_processes,
        process_id=layout.process_id,
        local_device_ids=list(layout.local_device_ids) if layout.local_device_ids else None,
    )
    return layout


class ProcessMismatchError(ValueError):
    """The processes of a multi-process run hold different versions of something they must share."""


def _digest(value) -> bytes:
    """`DIGEST_BYTES` bytes standing for `value`: an int itself (int64), anything else the start of its sha256."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return int(value).to_bytes(DIGEST_BYTES, "little", signed=True)
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()[:DIGEST_BYTES]


def encode_values(values: Mapping[str, object]) -> np.ndarray:
    """uint8 `[1 + len(values), DIGEST_BYTES]`: a digest of the sorted key names, then one per value in key order."""
    keys = sorted(values)
    return np.frombuffer(b"".join([_digest(keys)] + [_digest(values[k]) for k in keys]), np.uint8).reshape(-1, DIGEST_BYTES)


def describe_mismatch(gathered: np.ndarray, values: Mapping[str, object]) -> list[str]:
    """What differs between processes, one line per process that differs from process 0.

    Args:
      gathered: uint8 `[P, 1 + len(values), DIGEST_BYTES]`, `encode_values` of every
        process, in process order.
      values: this process's values (for the key names and integer types).

    Returns:
      e.g. `"process 1: num_train_examples 70 (process 0: 80), fingerprint differs"`;
      empty when every process sent what process 0 sent.
    """
    keys = sorted(values)
    lines = []
    for process in range(1, gathered.shape[0]):
        if np.array_equal(gathered[process], gathered[0]):
            continue
        if not np.array_equal(gathered[process, 0], gathered[0, 0]):
            lines.append(f"process {process}: holds other fields than process 0")
            continue
        parts = []
        for k, key in enumerate(keys, start=1):
            if np.array_equal(gathered[process, k], gathered[0, k]):
                continue
            if isinstance(values[key], (int, np.integer)) and not isinstance(values[key], bool):
                theirs, ref = (int.from_bytes(gathered[p, k].tobytes(), "little", signed=True) for p in (process, 0))
                parts.append(f"{key} {theirs} (process 0: {ref})")
            else:
                parts.append(f"{key} differs")
        lines.append(f"process {process}: " + ", ".join(parts))
    return lines


def check_processes_agree(values: Mapping[str, object], what: str) -> None:
    """Checks that every process of the run passes the same `values`; nothing to do in a single process.

    Every process must call it (an all-gather through
    `jax.experimental.multihost_utils.process_allgather` of `DIGEST_BYTES` bytes per
    value): integers are sent as they are, other values (strings, e.g. a sha256)
    as the first bytes of their sha256 (a difference escapes with probability
    2^-64). Every process raises the same error, so all of them stop.

    Args:
      values: flat mapping of names to ints or JSON-serialisable values.
      what: what the values describe, for the message (e.g. "data set").

    Raises:
      ProcessMismatchError: some process's values differ from process 0's; the
        message names each differing process and field (with both values for
        integers).
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(encode_values(values)))
    lines = describe_mismatch(gathered, values)
    if lines:
        report = "\n  ".join(lines)
        raise ProcessMismatchError(
            f"the processes hold different {what}s (process {jax.process_index()} of {jax.process_count()} reporting):\n  {report}\n"
            f"Every process must read the same {what}."
        )


def wait_for_processes(name: str) -> None:
    """Returns once every process of the run has called it with `name` (a barrier); at once in a single process.

    Raises:
      RuntimeError (from jax's coordination service): some process did not arrive in time.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def wait_at_barrier(name: str, timeout_s: float = 3600.0) -> None:
    """Returns once every process of the run has called it with `name`; at once in a single process.

    A barrier of jax's coordination service, not a device collective: a process may arrive
    up to `timeout_s` after another (gloo, the CPU collectives, gives up after 30 s), e.g.
    after compiling its programs for longer. jax has no public call for it (jax 0.11:
    `jax._src.distributed.global_state.client`).

    Raises:
      RuntimeError (from jax's coordination service): some process did not arrive in time.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed

    jax_distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))
