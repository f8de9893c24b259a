"""Timing helpers shared by the benchmark scripts: wall clock and CUPTI device time."""

from __future__ import annotations

import statistics
import time

import jax


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
