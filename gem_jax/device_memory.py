"""How much of a GPU's memory this process's jax allocator may take, how much it took, and XLA's out-of-memory errors.

jaxlib reads the share from `XLA_CLIENT_MEM_FRACTION` (or its deprecated name
`XLA_PYTHON_CLIENT_MEM_FRACTION`, refused beside it) when it creates the GPU client; its default
is 75%. Nothing here imports jax: a process sets the share before its first device use.
"""

from __future__ import annotations

import math
import os
import re

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


# XLA's allocator writes the size it asked for as tsl's human-readable bytes ("31.32GiB") or as a count ("... bytes"),
# and the device as "on device 0" (its local hardware id).
_REQUEST = re.compile(r"trying to allocate (\d+(?:\.\d+)?) ?(B|KiB|MiB|GiB|TiB|bytes)\b")
_DEVICE = re.compile(r"on device (\d+)")
_UNIT_BYTES = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(message: str) -> int | None:
    """The bytes an out-of-memory message says the allocator was asked for ("trying to allocate 31.32GiB"), or None."""
    match = _REQUEST.search(message)
    if match is None:
        return None
    number, unit = match.groups()
    return int(number) if unit in ("B", "bytes") and number.isdigit() else int(float(number) * _UNIT_BYTES[unit])


def fragmentation_note(message: str, devices) -> str:
    """A sentence for an out-of-memory message when enough memory is free but in smaller pieces than the
    request: XLA needs each buffer, a step's temporaries too, in one piece.

    Reads `bytes_limit`, `bytes_in_use` and `largest_free_block_bytes` (bytes, `jax.Device.memory_stats()`)
    now, after the error: the step's own temporaries have been given back, so the pieces are those the state
    and other live buffers leave; a buffer that split the memory only while the step asked (and is freed
    since) leaves no trace, and then there is no note. The GEM-width planted job with bfloat16 weights
    (configs/planted_gem.py, 55 GB remat plan, one H100) ran out asking for 31.32 GiB with about 55 GiB
    free in two pieces (benchmarks/quality.md, "bf16 weight matrices at GEM width").

    Args:
      message: the error's first line ("Out of memory while trying to allocate 31.32GiB ... on device 0").
      devices: the process's devices (`jax.local_devices()`); the one the message names is read (by
        `local_hardware_id`), or all of them, the smallest largest piece counting, when it names none.

    Returns:
      The sentence (sizes in GB of 1e9 bytes, and the request in GiB as XLA wrote it), or "" when the
      message names no size, names a device not among `devices`, a device reports no statistics (the CPU),
      one piece would hold the request or too little is free.

    Raises:
      whatever `memory_stats()` raises (`gem_jax.cli.out_of_memory_message` then gives no note).
    """
    request = requested_bytes(message)
    if request is None:
        return ""
    named = _DEVICE.search(message)
    if named is not None:  # a device this process does not hold gives no note rather than another device's
        devices = [d for d in devices if getattr(d, "local_hardware_id", None) == int(named.group(1))]
    pieces = []
    for device in devices:
        stats = device.memory_stats() or {}
        if not {"bytes_limit", "bytes_in_use", "largest_free_block_bytes"} <= stats.keys():
            return ""
        pieces.append((stats["largest_free_block_bytes"], stats["bytes_limit"] - stats["bytes_in_use"], stats["bytes_limit"]))
    if not pieces:
        return ""
    largest, free, limit = min(pieces)
    if not largest < request <= free:
        return ""
    short_gb = max(0.1, math.ceil((request - largest) / 1e8) / 10)  # rounded up: the request's size is rounded in its message
    return (
        f" The memory was there but not in one piece: {free / 1e9:.1f} GB of the {limit / 1e9:.1f} GB the allocator may "
        f"take are free, the largest free piece {largest / 1e9:.1f} GB, under the {request / 1e9:.1f} GB "
        f"({request / 2**30:.2f} GiB) asked for (XLA needs each buffer, a step's temporaries too, in one piece). Where "
        f"model.remat.budget_gb binds, a budget at least {short_gb:.1f} GB lower shrinks the step's temporaries by about "
        "as much; without one, a budget lets the planner recompute activations instead of keeping them."
    )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a jax runtime error is XLA's out-of-memory (status RESOURCE_EXHAUSTED)."""
    return "RESOURCE_EXHAUSTED" in str(error)
