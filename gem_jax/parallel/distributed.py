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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax


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
