"""Where a run's wall time goes: every second from process start to the summary, in one named bucket.

`Chrono` holds a clock that starts when the process started (read from the OS, see
`process_start_time`) and a set of buckets. The trainer wraps each phase of a run in
`chrono.measure(bucket)`; the time before the `Chrono` was made is `startup/imports`,
and whatever no measurement covers is `other`, so the buckets always sum to the wall
time exactly. Goodput is `train_step` time over wall time.

Train steps are dispatched asynchronously: a step's device time shows when its
metrics are fetched at the end of a log window, and that blocking fetch is measured
as `train_step` too. `data_wait` is host time blocked on the train iterator alone.

A compile that happens after the first step (a shape no program was compiled for
ahead of time, or any other program jax compiles on first use) is taken out of the
bucket that was open when it ran and counted in `compile_after_start`, with the
compiled function's name as its reason (jax's backend-compile monitoring event).

After big_vision's `utils.chrono`: one object owns time and throughput, the loop only
says which phase it is in.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from jax import monitoring

# jax._src.dispatch.BACKEND_COMPILE_EVENT: recorded (with fun_name) for every XLA compile,
# a persistent-cache hit included.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

IMPORTS = "startup/imports"
SETUP = "startup/setup"
DATA = "startup/data"
INIT = "startup/init"
LOWERING = "startup/lowering"
COMPILE = "startup/compile"
RESTORE = "restore"
TRAIN_STEP = "train_step"
DATA_WAIT = "data_wait"
EVAL = "eval"
CHECKPOINT = "checkpoint"
LOGGING = "logging"
COMPILE_AFTER_START = "compile_after_start"
OTHER = "other"

BUCKETS = (
    IMPORTS, SETUP, DATA, INIT, LOWERING, COMPILE, RESTORE,
    TRAIN_STEP, DATA_WAIT, EVAL, CHECKPOINT, LOGGING, COMPILE_AFTER_START, OTHER,
)


def process_start_time() -> float:
    """When this process started, in seconds since the epoch (`time.time()`'s clock).

    Read from `/proc/self/stat` (field 22, `starttime`, in clock ticks after boot) and
    the boot time of `/proc/stat` (`btime`), so the interpreter's own start and every
    import count; 10 ms resolution. Where `/proc` is missing (not Linux), the time of
    this module's import, which then misses the imports before it.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # the command name (field 2) may hold spaces: split after its closing parenthesis
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 overall: the fields after the name start at field 3
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


class Chrono:
    """Every second of a run in one bucket of `BUCKETS`; `measure(bucket)` adds a phase's time.

    Args:
      start: when the run's clock starts, seconds since the epoch (default: now, so that
        `startup/imports` is 0; `gem-train` passes `process_start_time()`). The time
        from `start` to the `Chrono`'s creation is `startup/imports`.

    Measurements do not nest (a phase is in one bucket); `seconds()` adds `other`, the time
    no measurement covered, so the buckets sum to the wall time.
    """

    def __init__(self, start: float | None = None):
        now = time.time()
        self.start = now if start is None else float(start)
        self._seconds = dict.fromkeys(BUCKETS[:-1], 0.0)
        self._seconds[IMPORTS] = max(0.0, now - self.start)
        self.compiles_after_start: list[tuple[str, float]] = []  # (reason, seconds)
        self._open: str | None = None
        self._thread = threading.get_ident()
        self._taken = 0.0  # compile seconds taken out of the open measurement
        self._watching = False
        self._compiling = False  # inside `late_compile`: its compiles are counted there

    def wall(self) -> float:
        """Seconds from `start` to now."""
        return time.time() - self.start

    @contextlib.contextmanager
    def measure(self, bucket: str):
        """Adds the time spent inside the block to `bucket`.

        Raises ValueError for an unknown bucket or a nested measurement.
        """
        self._check(bucket, excluded={IMPORTS, COMPILE_AFTER_START})
        if self._open is not None:
            raise ValueError(f"time bucket {bucket!r} opened inside {self._open!r}: measurements do not nest")
        self._open, self._taken = bucket, 0.0
        began = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            self._open = None
            self._seconds[bucket] += elapsed - self._taken

    @contextlib.contextmanager
    def late_compile(self, reason: str):
        """Counts the time inside the block in `compile_after_start`, with `reason` (e.g. "train
        step, token capacity 896"), taking it out of the measurement it runs in, if any."""
        self._compiling = True
        began = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            self._compiling = False
            if self._open is not None:
                self._taken += elapsed
            self._seconds[COMPILE_AFTER_START] += elapsed
            self.compiles_after_start.append((reason, elapsed))

    def add(self, bucket: str, seconds: float) -> None:
        """Adds `seconds` measured elsewhere to `bucket` (for a phase that is not one block)."""
        self._check(bucket, excluded={IMPORTS})
        self._seconds[bucket] += seconds

    def _check(self, bucket: str, excluded: set[str]) -> None:
        """Raises ValueError unless `bucket` is one of `BUCKETS` (without `other`) outside `excluded`."""
        if bucket not in self._seconds or bucket in excluded:
            raise ValueError(f"unknown time bucket {bucket!r}; measurable ones: {sorted(set(self._seconds) - excluded)}")

    def watch_compiles(self) -> None:
        """From now on, a compile jax runs in this thread is counted in `compile_after_start`.

        Call right after the first step is dispatched; undone by `close()`.
        """
        if not self._watching:
            monitoring.register_event_duration_secs_listener(self._on_compile)
            self._watching = True

    def close(self) -> None:
        """Stops watching compiles (the buckets stay readable)."""
        if self._watching:
            monitoring.unregister_event_duration_listener(self._on_compile)
            self._watching = False

    def _on_compile(self, event: str, duration: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT or threading.get_ident() != self._thread or self._compiling:
            return
        if self._open is not None:
            self._taken += duration
        self._seconds[COMPILE_AFTER_START] += duration
        self.compiles_after_start.append((f"first use of {kwargs.get('fun_name', 'a program')}", duration))

    def seconds(self) -> dict[str, float]:
        """Each bucket's seconds so far, `other` included: they sum to `wall()`."""
        wall = self.wall()
        out = dict(self._seconds)
        out[OTHER] = wall - sum(out.values())
        return out

    def snapshot(self) -> dict[str, float]:
        """The measured buckets' seconds so far (without `other`), for differences over a window."""
        return dict(self._seconds)

    def record(self) -> dict[str, float | int]:
        """Flat metrics: `time_<bucket>_s` (a `/` in a name becomes `_`), `wall_s`, `goodput`, `compiles_after_start`."""
        seconds = self.seconds()
        wall = sum(seconds.values())
        out: dict[str, float | int] = {f"time_{name.replace('/', '_')}_s": value for name, value in seconds.items()}
        out["wall_s"] = wall
        out["goodput"] = seconds[TRAIN_STEP] / wall if wall > 0 else 0.0
        out["compiles_after_start"] = len(self.compiles_after_start)
        return out

    def table(self) -> list[str]:
        """The split as lines: bucket, seconds, share of the wall time; then goodput and the late compiles' reasons."""
        seconds = self.seconds()
        wall = sum(seconds.values())
        lines = [f"{name:<22}{value:10.2f} s {value / wall:7.1%}" for name, value in seconds.items() if value or name in (TRAIN_STEP, OTHER)]
        lines.append(f"{'wall':<22}{wall:10.2f} s")
        lines.append(f"goodput (train_step / wall): {seconds[TRAIN_STEP] / wall:.1%}")
        lines += [f"compile after start: {reason} ({s:.2f} s)" for reason, s in self.compiles_after_start]
        return lines
