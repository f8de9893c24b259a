"""`benchmarks/train_bench.py --fit-batch`: the largest batch a step should fit, from XLA's out-of-memory message.

A try that runs out of device memory names the allocation that failed; with the device's limit,
what it held before the step and the gradients' bytes, that gives the largest per-device batch
whose step should fit (`largest_fitting_batch`), rounded down to one the data config accepts
(`valid_batch_at_most`). Each try is a set-up and a compile, so this replaces bisection.
`train_bench.run_fitting_batch` makes the tries; benchmarks/long_history.md uses it for the
padded peer at histories to 4096.
"""

from __future__ import annotations

import dataclasses
import math
import re

from gem_jax.data.bbs import check_shard_split
from gem_jax.data.config import DataConfig
from gem_jax.train import remat_plan, snapshot
from gem_jax.train.setup import Training
from gem_jax.units import format_bytes

# --fit-batch: tries of one mode on one device count (the asked batch, then up to two derived
# ones; each is a set-up and a compile), and the share of the device's limit a derived batch
# leaves to what its memory model does not count (`largest_fitting_batch`).
MAX_TRIES = 3
HEADROOM = 0.05

# The size in XLA's out-of-memory message on the GPU (jaxlib 0.11): the device allocator's
# "Out of memory while trying to allocate 27.81GiB with allocator GPU_0_bfc on device 0." or,
# from other allocation paths, "... allocate 4770354232 bytes.". Binary units as tsl's
# HumanReadableNumBytes writes them (B; KiB with one decimal; MiB to EiB with two).
_ASKED = re.compile(r"Out of memory while trying to allocate (\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB|PiB|EiB)\b")
_BYTES_PER_UNIT = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50, "EiB": 2**60}


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes of the mesh's first device, as `largest_fitting_batch` counts them.

    Attributes:
      limit: what this process may allocate there (`memory_stats()["bytes_limit"]`: the
        device's memory times XLA_CLIENT_MEM_FRACTION); None where the device reports
        no statistics (the CPU).
      resident: what it holds once the train state is built, before any step
        (`memory_stats()["bytes_in_use"]`): the state's shard (parameters, optimizer state)
        and whatever else the process keeps there; None where unreported.
      gradients: the gradients' shard (from shapes: `gem_jax.train.remat_plan.state_bytes`
        less the state's), among the step's temporaries whatever its batch.
    """

    limit: int | None
    resident: int | None
    gradients: int


def memory_before_step(training: Training) -> DeviceMemory:
    """`DeviceMemory` of `training`'s first device; call it once the state is built and nothing else runs."""
    device = training.mesh.devices.flat[0]
    state = snapshot.device_bytes(training.state.abstract)[device]
    with_gradients = remat_plan.state_bytes(training.state, row_wise_tables=training.config.optim.sparse_embedding_updates)
    stats = device.memory_stats() or {}
    return DeviceMemory(limit=stats.get("bytes_limit"), resident=stats.get("bytes_in_use"), gradients=with_gradients - state)


class StepOutOfMemory(RuntimeError):
    """A run's device ran out of memory (XLA's RESOURCE_EXHAUSTED) at `per_device_batch` examples.

    Attributes:
      per_device_batch: the try's examples per device.
      message: XLA's message.
      memory: the device's bytes before the step (`DeviceMemory`).
    """

    def __init__(self, per_device_batch: int, message: str, memory: DeviceMemory):
        super().__init__(f"out of device memory at a per-device batch of {per_device_batch}: {message}")
        self.per_device_batch, self.message, self.memory = per_device_batch, message, memory


class BatchFitError(RuntimeError):
    """Every try of a run ran out of device memory (one try without `--fit-batch`), or no batch was derived for the next.

    Attributes:
      failed_tries: the tries' records (`failed_try`), in order.
    """

    def __init__(self, failed_tries: list[dict]):
        tries = ", ".join(
            f"{t['per_device_batch']} (asked {'?' if t['asked_bytes'] is None else format_bytes(t['asked_bytes'])})" for t in failed_tries
        )
        last = failed_tries[-1]
        why = f"; no batch derived from the last: {last['no_derived_batch']}" if "no_derived_batch" in last else ""
        super().__init__(f"the step ran out of device memory at every per-device batch tried: {tries}{why}")
        self.failed_tries = failed_tries


def asked_bytes(message: str) -> int:
    """Bytes of the allocation that XLA's out-of-memory `message` says failed (the first one it names).

    Reads "Out of memory while trying to allocate SIZE", SIZE in bytes ("4770354232 bytes")
    or in a binary unit ("27.81GiB", "896.00MiB", "512.0KiB"; XLA rounds these to two
    decimals, one for KiB: 27.81GiB reads as 29,860,760,125 bytes, within 0.005 GiB of the
    request).

    Raises:
      ValueError: the message names no allocation in that form (quoted in the error), e.g. the
        autotuner's "Allocating N bytes exceeds the memory limit of M bytes.", whose limit is
        its scratch allowance (`--xla_gpu_redzone_scratch_max_megabytes`), not the device.
    """
    found = _ASKED.search(message)
    if found is None:
        raise ValueError(f"no allocation size in this out-of-memory message: {message[:500]!r}")
    number, unit = found.groups()
    return round(float(number) * _BYTES_PER_UNIT[unit])


def largest_fitting_batch(per_device_batch: int, asked: int, memory: DeviceMemory, headroom: float = HEADROOM) -> int:
    """The largest per-device batch whose train step should fit, from a try at `per_device_batch` that ran out.

    The model, in bytes of one device: a step of b examples needs

        need(b) = resident + gradients + b * per_example

    `resident` (the state, measured before the step) and `gradients` (temporaries of every
    step) do not depend on b; everything else the step allocates grows with it (activations
    kept for the backward, workspaces, and for the padded peer its `[B, N, H, D]` layouts).
    On the GPU XLA allocates a step's temporaries as one buffer, so the allocation that
    failed, `asked`, is `gradients + per_device_batch * per_example`:

        per_example = (asked - gradients) / per_device_batch
        batch = floor(((1 - headroom) * limit - resident - gradients) / per_example)

    `headroom` (a share of `limit`) is left to what the model does not count: allocator
    fragmentation, the placed batches, compiled programs. Counting all the gradients as
    fixed errs towards a smaller batch: if fewer of them are live at the step's peak, the
    batch needs less than the model says. An allocation that was not the step's
    temporaries but a smaller one (made while compiling, say) makes the batch too large;
    the next try's message corrects it.

    Raises:
      ValueError: the device reports no limit or no resident bytes; the allocation is no
        larger than the gradients, or it and `resident` fit the limit (the model does not
        explain the failure, so nothing follows from it); or no batch of 1 fits.
    """
    if memory.limit is None or memory.resident is None:
        raise ValueError(f"the device reports no memory limit or bytes in use ({memory}): no batch to derive")
    per_example = (asked - memory.gradients) / per_device_batch
    if per_example <= 0 or memory.resident + asked <= memory.limit:
        raise ValueError(
            f"an allocation of {format_bytes(asked)} at {per_device_batch} examples does not explain running out: "
            f"gradients {format_bytes(memory.gradients)}, {format_bytes(memory.resident)} resident, limit {format_bytes(memory.limit)}"
        )
    batch = math.floor(((1 - headroom) * memory.limit - memory.resident - memory.gradients) / per_example)
    if batch < 1:
        raise ValueError(
            f"no batch fits: {format_bytes(memory.resident)} resident and {format_bytes(memory.gradients)} of gradients leave "
            f"less than one example's {format_bytes(per_example)} of {1 - headroom:.0%} of the limit {format_bytes(memory.limit)}"
        )
    return batch


def valid_batch_at_most(per_device_batch: int, num_devices: int, data: DataConfig) -> int:
    """The largest per-device batch <= `per_device_batch` whose global batch the job accepts.

    The checks are the job's own: `DataConfig`'s and, with BBS on, `check_shard_split`'s
    (which `Dataset.resolve_bbs` applies on the mesh: an even batch per device when there
    are several).

    Raises:
      ValueError: no batch from `per_device_batch` down to 1 passes them.
    """
    for batch in range(per_device_batch, 0, -1):
        try:
            checked = dataclasses.replace(data, batch_size=batch * num_devices)
            if checked.bbs is not None:
                check_shard_split(checked.batch_size, num_devices, "DataConfig.bbs")
        except ValueError:
            continue
        return batch
    raise ValueError(f"no per-device batch from {per_device_batch} down to 1 gives {num_devices} device(s) a global batch the data config accepts")


def failed_try(oom: StepOutOfMemory, num_devices: int, data: DataConfig) -> dict:
    """The record of a try that ran out of memory, with the batch derived from its message.

    Returns:
      `{per_device_batch, message, asked_bytes, device_memory_bytes, derived_per_device_batch}`
      (the derived batch: `largest_fitting_batch` rounded down by `valid_batch_at_most`, the
      next try's with `--fit-batch`). Where none follows (one of `asked_bytes`,
      `largest_fitting_batch` and `valid_batch_at_most` refuses), `derived_per_device_batch`
      is None and `no_derived_batch` says why (`asked_bytes` too is None when the message
      gives no size).
    """
    record = {
        "per_device_batch": oom.per_device_batch,
        "message": oom.message[:2000],
        "asked_bytes": None,
        "device_memory_bytes": dataclasses.asdict(oom.memory),
        "derived_per_device_batch": None,
    }
    try:
        record["asked_bytes"] = asked_bytes(oom.message)
        fitting = largest_fitting_batch(oom.per_device_batch, record["asked_bytes"], oom.memory)
        record["derived_per_device_batch"] = valid_batch_at_most(fitting, num_devices, data)
    except ValueError as error:
        record["no_derived_batch"] = str(error)
    return record
