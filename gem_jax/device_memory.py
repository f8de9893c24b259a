"""How much of a GPU's memory this process's jax allocator may take, how much it took, and XLA's out-of-memory errors.

jaxlib reads the share from `XLA_CLIENT_MEM_FRACTION` (or its deprecated name
`XLA_PYTHON_CLIENT_MEM_FRACTION`, refused beside it) when it creates the GPU client; its default
is 75%. Nothing here imports jax: a process sets the share before its first device use.
"""

from __future__ import annotations

import os

# The share's variable: jaxlib's name, then its deprecated one (jaxlib refuses the two together).
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
DEFAULT_MEMORY_FRACTION = "0.9"  # the launch scripts' value too (scripts/xla_flags.py)


def claim_device_memory(fraction: str = DEFAULT_MEMORY_FRACTION) -> None:
    """Sets `XLA_CLIENT_MEM_FRACTION` to `fraction` (a share of each GPU's memory, "0.9": 90%) unless it or
    its deprecated name is set; call it before the first device use.

    jax's own default, 75%, leaves a quarter of the GPU of a training process that is alone on it
    unused, and XLA's allocator needs each of a step's large temporary buffers in one free piece:
    the GEM-width model on the planted log (configs/planted_gem.py, one H200) ran out of memory at
    75% asking for 44.8 GiB while more than that was free in two pieces, and trained at 92%.
    Several processes on one GPU set a smaller share each (benchmarks/quality_runs.sh).
    """
    if not any(os.environ.get(name) for name in MEMORY_FRACTION_VARIABLES):
        os.environ[MEMORY_FRACTION_VARIABLES[0]] = fraction


def device_memory_share() -> str:
    """`NAME=value` of the memory-fraction variable in force (`MEMORY_FRACTION_VARIABLES`), or jax's default, 75%."""
    name = next((name for name in MEMORY_FRACTION_VARIABLES if os.environ.get(name)), None)
    return f"{name}={os.environ[name]}" if name else "jax's default share, 75%,"


def peak_memory_gb(devices) -> dict[str, float]:
    """The largest peak of device memory this process reached: `device_peak_gb`, the largest
    `peak_bytes_in_use` among `devices`' memory statistics (`jax.Device.memory_stats()`), and that
    device's `device_limit_gb` (`bytes_limit`: what this process's share lets the allocator take),
    both in GB (1e9 bytes); {} when a device reports no statistics (the CPU).
    """
    peaks = []
    for device in devices:
        stats = device.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats or "bytes_limit" not in stats:
            return {}
        peaks.append((stats["peak_bytes_in_use"], stats["bytes_limit"]))
    if not peaks:
        return {}
    peak, limit = max(peaks)
    return {"device_peak_gb": peak / 1e9, "device_limit_gb": limit / 1e9}


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a jax runtime error is XLA's out-of-memory (status RESOURCE_EXHAUSTED)."""
    return "RESOURCE_EXHAUSTED" in str(error)
