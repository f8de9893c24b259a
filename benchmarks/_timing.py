"""Timing helpers shared by the benchmark scripts: wall clock, CUPTI device time, a profiler trace's device timeline."""

from __future__ import annotations

import glob
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax


def forward_backward(f: Callable) -> Callable:
    """`(q, k, v, dout) -> (out, dq, dk, dv)`: the layer's output and `jax.vjp`'s gradients.

    The output is returned, not dropped: a kernel whose backward recomputes what it needs (no
    residual from the forward, as block-local attention and GDPA) would otherwise have its
    forward removed by XLA as dead code, and "forward + backward" would time the backward alone.
    """

    def run(q, k, v, dout):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    return run


def wall_seconds(f, *args, iters: int = 5, reps: int = 3) -> float:
    """Median over `reps` of the mean seconds per call of `iters` back-to-back calls.

    One compile-and-warm-up call first; one block at the end of each repetition,
    so the time includes launch gaps and host work between kernels.
    """
    jax.block_until_ready(f(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def device_ms(f, args, iters: int) -> float | None:
    """Median over `iters` calls of the summed GPU kernel time of one call (CUPTI), or None without CUPTI."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, per_iter = profiler.measure(f, iterations=iters)(*args)
        return float(statistics.median(per_iter)) if per_iter else None
    except Exception as e:  # CUPTI may be unavailable
        print(f"  cupti unavailable: {type(e).__name__}: {e}", flush=True)
        return None


def kernel_breakdown_us(f, args) -> list[tuple[str, float]] | None:
    """`[(kernel name, microseconds)]` of the kernels one call launches (CUPTI), or None."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, kernels = profiler.measure(f, aggregate=False)(*args)
        return [(name[:80], round(ms * 1e3, 2)) for name, ms in kernels]
    except Exception:
        return None


def cupti_kernels(run: Callable[[], Any]) -> tuple[Any, list[tuple[str, float]] | None]:
    """Runs `run()` once under CUPTI: `(its result, [(kernel name, ms)] in launch order)`.

    The same CUPTI binding that `jax.experimental.mosaic.gpu.profiler.measure` uses, but
    with no warm-up call of its own, so `run` may donate its inputs (a train step): the
    caller warms it up. The kernel list is None without CUPTI (no Mosaic GPU extension,
    not a GPU); `run()` has run either way.
    """
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init()
    except Exception as e:  # no CUPTI here: run without it
        print(f"  cupti unavailable: {type(e).__name__}: {e}", flush=True)
        return jax.block_until_ready(run()), None
    try:
        result = jax.block_until_ready(run())
    finally:
        timings = ext._cupti_get_timings(True)
    return result, [(str(name), float(ms)) for name, ms in timings] if timings else None


def traced_device_activities(run: Callable[[], Any], device: int = 0) -> tuple[Any, list[tuple[str, float, float]] | None]:
    """Runs `run()` once under `jax.profiler.trace`: `(its result, [(name, start_us, duration_us)])`.

    The activities are what the trace's `/device:GPU:<device>` plane records on its streams
    (`Stream #...` lines: kernels, copies, memsets), with their start times, so the gaps between
    them can be measured (`_profile.idle_between_kernels`); None where the trace has no such
    plane (not a GPU). Like `cupti_kernels`, no warm-up call of its own: `run` may donate.

    Raises:
      ValueError: the trace did not write exactly one `.xplane.pb` file; what `run()` raises.
    """
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            result = jax.block_until_ready(run())
        (xspace,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(xspace)
    plane = data.find_plane_with_name(f"/device:GPU:{device}")
    if plane is None:
        return result, None
    return result, [
        (event.name, event.start_ns / 1e3, event.duration_ns / 1e3)
        for line in plane.lines
        if line.name.startswith("Stream")
        for event in line.events
    ]
