"""Every step program a run executes, compiled before it is needed: a train step per token capacity, one eval step.

Which token capacities a run's batches take comes from `gem_jax.train.capacity_plan`
(replayed from the data order before the run starts). Every eval batch is placed at the
largest capacity an eval batch takes, so the eval step is one program (eval is forward
only: its extra slack costs less than lowering and compiling a program per capacity).

`start_programs` builds each program (`Programs.finish` waits for it): loaded from an `ExecutableCache` (`gem-train`
keeps it beside jax's persistent cache, on GPUs: a warm start skips lowering, which the
persistent cache cannot skip), else lowered (`jax.jit(...).lower` on abstract arguments:
Python tracing, which holds the GIL) one after the other and compiled in parallel
threads (XLA compiles release the GIL).

Two schedules:
- ahead (the default): every program is built before the first step;
- background (`LoopConfig.compile_in_background`): only the largest train capacity is
  built before the first step, since every batch fits it (or loaded: a larger capacity the
  executable cache holds, which also fits every batch, is taken instead of building the
  largest planned one, as for a restart whose batches stop short of the run's largest); the rest are built in a
  background thread while the run trains (from `Programs.finish` on), the eval step and
  then the train capacities in order of how many of the run's steps take them. Until a batch's own capacity is
  ready it is placed at the smallest ready capacity above it (`Programs.train_capacity`):
  the same examples and labels with more slack rows, so such steps cost more device
  time and sum in another order (losses are not bit-identical to an ahead run's). An
  eval reached before its program is ready waits for it (`compile_after_start`).
  A train program the executable cache holds is always loaded. One it does not hold is
  built only if it pays (`capacities_worth_building`): the device time its steps would
  save over the rest of the run, at the step time measured at the first program's capacity,
  must exceed the seconds the first program's own build took (in this run, or as the
  executable cache recorded it when the program was loaded: a warm start decides alike).
  A short cold run at GEM width builds none (its steps at the largest capacity cost less
  than the background lowering, which holds the GIL, and compiling, which shares the
  CPU and the GPU with the run, take from them); a long one builds the common ones.
  One process only: the processes of a multi-process run must place every batch alike.

A batch at a capacity that was not planned (the replay and the placement disagree,
which is a bug, or the train iterator was moved) is compiled when it comes, with its
reason counted in the run's `compile_after_start` time (`gem_jax.train.goodput`),
rather than stopping a long job for a shape.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable

import jax

from gem_jax.batch import Batch, LocalBatch
from gem_jax.jagged import pick_capacity
from gem_jax.train import config_tree, goodput
from gem_jax.train.capacity_plan import capacities_worth_building
from gem_jax.train.executable_cache import ExecutableCache
from gem_jax.train.setup import Training

THREADS_ENV_VAR = "GEM_COMPILE_THREADS"


@dataclasses.dataclass(frozen=True)
class _Job:
    """One program to build: `step` lowered on `args` (abstract), kept in the cache at `path`."""

    kind: str  # "train" or "eval"
    capacity: int
    step: Callable
    args: tuple
    path: object

    @property
    def name(self) -> str:
        return f"{self.kind} step at token capacity {self.capacity}"


class Programs:
    """The compiled train and eval steps of a run, by token capacity.

    Call `train_step(state, batch)` and `eval_step(params, batch)` as the jitted steps of
    `Training`; each picks the executable of the batch's capacity (`batch.history.values`
    `[D, T_local, F]`: `T_local`). A capacity that was not planned is compiled then, in
    `chrono`'s `compile_after_start` bucket with the reason named. With programs still
    building in the background, place each train batch at `train_capacity(local)`.
    Made by `start_programs`: call `finish()` before the first step.

    Attributes:
      training: the job whose `train_step` / `eval_step` these are.
      train: capacity -> compiled train step (the ready ones).
      eval: capacity -> compiled eval step (the ready ones).
      eval_capacity: the token capacity every eval batch is placed at (None: no eval step).
      lowering_s: wall seconds of the lowering before the first step.
      compile_s: wall seconds of loading from the executable cache and of compiling before
        the first step, from the first compile's start to the last one's end (known after
        `finish`); `overlapped_s` of them ran beside the caller's other work (lowering
        the next programs, initialising or restoring the state), the rest was waited for.
      loaded: how many programs came from the executable cache.
      build_s: (kind, capacity) -> seconds its lowering and compile took, in this run or, for
        a program loaded from the cache, when it was stored (None: unknown).
      chrono: where late compiles and waits are counted (None: not counted).
    """

    def __init__(self, training: Training, eval_capacity: int | None, chrono: goodput.Chrono | None, cache: ExecutableCache):
        self.training = training
        self.train: dict[int, jax.stages.Compiled] = {}
        self.eval: dict[int, jax.stages.Compiled] = {}
        self.eval_capacity = eval_capacity
        self.lowering_s = 0.0
        self.compile_s = 0.0
        self.overlapped_s = 0.0
        self.loaded = 0
        self.chrono = chrono
        self._cache = cache
        self._before_first_step = 0
        self._compiling: list[tuple[_Job, concurrent.futures.Future]] | None = None  # started, not yet finished
        self._compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._later: list[_Job] = []  # to build in the background once `finish` returns
        self._threads: int | None = None
        self._background: list[_Job] = []
        self._pending: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._failed: dict[str, str] = {}
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._background_began = 0.0
        self._ready_after_s: float | None = None
        self._ready_at_step: int | None = None
        self._steps = 0
        self._steps_padded = 0
        self._counts: dict[int, int] = {}
        self._first: int | None = None  # the train capacity built before the first step (background schedule)
        self.build_s: dict[tuple[str, int], float | None] = {}
        self._go = threading.Event()  # the background may start: a step time is measured, or a program is awaited
        self._timed = threading.Event()  # train programs may be decided: a step time is measured, or the run ends
        self._step_s: float | None = None
        self._step_done_at = 0.0
        self._not_built: list[int] = []
        self._run_larger: set[int] = set()  # train capacities never built here (not paying, or failed): placed above

    # ------------------------------------------------------------------ the steps

    def train_capacity(self, local: LocalBatch) -> int | None:
        """The token capacity to place `local`'s global batch at (`BatchPlacement.put_local(capacity=...)`):
        its own when that program is ready, else (building, or not built: it would not have
        paid) the smallest ready one above it; None (the placement's own choice) when every
        planned program is ready."""
        if not self._pending and not self._run_larger:
            return None
        buckets = self.training.dataset.token_buckets
        per = local.global_batch_size // self.training.placement.num_shards
        needed = pick_capacity(int(local.chunk_rows().max()), buckets.capacities(per))
        if needed in self.train or (("train", needed) not in self._pending and needed not in self._run_larger):
            return needed
        self._steps_padded += 1
        return min(c for c in self.train if c > needed)

    def train_step(self, state, batch: Batch):
        """`(state, placed batch) -> (state, metrics)`, donating `state` (`gem_jax.train.step.make_train_step`)."""
        capacity = batch.history.values.shape[1]
        if capacity not in self.train:
            self.train[capacity] = self._late(f"train step, token capacity {capacity}", self.training.train_step, self.training.state.abstract, batch)
        self._steps += 1
        out = self.train[capacity](state, batch)
        if not self._timed.is_set() and self._background and self._steps in (2, 3):
            self._time_step(out)
        return out

    def _time_step(self, out) -> None:
        """Measures the wall time of the run's third step (from the end of the second to the end of
        the third, the loop's host work included) before the background begins, then lets it begin."""
        jax.block_until_ready(out[1])
        now = time.perf_counter()
        if self._steps == 3:
            self._step_s = now - self._step_done_at
            self._timed.set()
            self._go.set()
        self._step_done_at = now

    def eval_step(self, params, batch: Batch) -> dict:
        """`(params, placed batch) -> dict` (`gem_jax.train.step.make_eval_step`)."""
        capacity = batch.history.values.shape[1]
        if capacity not in self.eval:
            self._await(("eval", capacity))
        if capacity not in self.eval:
            self.eval[capacity] = self._late(f"eval step, token capacity {capacity}", self.training.eval_step, self.training.state.abstract.params, batch)
        return self.eval[capacity](params, batch)

    def _late(self, reason: str, step, *args) -> jax.stages.Compiled:
        if self._compiling is not None:
            raise RuntimeError(f"Programs: the {reason} was called before finish(): the programs built before the first step are still compiling")
        print(f"gem-train: compiling the {reason}: no batch of the planned steps took it", flush=True)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args)
        with self._late_compile(reason):
            return step.lower(*abstract).compile()

    def _late_compile(self, reason: str):
        return self.chrono.late_compile(reason) if self.chrono is not None else contextlib.nullcontext()

    def _await(self, key: tuple[str, int]) -> None:
        """Waits for a program still building in the background (counted as a late compile)."""
        future = self._pending.get(key)
        if future is None:
            return
        self._go.set()  # no step time yet (an eval before step 3): build the eval step now, the train steps once timed
        with self._late_compile(f"waiting for the background build of the {key[0]} step at token capacity {key[1]}"):
            concurrent.futures.wait([future])

    # ------------------------------------------------------------------ building

    def _start(self, jobs: list[_Job], threads: int | None, later: list[_Job]) -> None:
        """Starts building `jobs`: loads what the cache holds, lowers the rest one after the other (holding
        the GIL) and hands each to a compile thread as soon as it is lowered; returns without waiting
        for the compiles (`finish` waits, then builds `later` in the background)."""
        self._threads, self._later = threads, later
        began = time.perf_counter()
        with self._measure(goodput.COMPILE):
            compiled = [self._cache.load(job.path) for job in jobs]
        self.compile_s += time.perf_counter() - began
        for job, program in zip(jobs, compiled):
            if program is not None:
                self._ready(job, program)
                self.build_s[(job.kind, job.capacity)] = self._cache.build_seconds(job.path)
        missing = [job for job, program in zip(jobs, compiled) if program is None]
        self.loaded += len(jobs) - len(missing)
        self._before_first_step += len(jobs)
        self._compiling = []
        if not missing:
            return
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(_workers(len(missing), threads), thread_name_prefix="gem-compile")
        began = time.perf_counter()
        with self._measure(goodput.LOWERING):
            for job in missing:
                lowered, lowering_s = _timed(job.step.lower, *job.args)
                self._compiling.append((job, self._compile_pool.submit(self._compile_ahead, job, lowered, lowering_s)))
        self.lowering_s += time.perf_counter() - began

    def _compile_ahead(self, job: _Job, lowered, lowering_s: float) -> tuple[jax.stages.Compiled, float, float]:
        """Compiles and stores one program (in a compile thread); returns it with its start and end (`time.perf_counter`)."""
        began = time.perf_counter()
        program = lowered.compile()
        ended = time.perf_counter()
        self._store(job, program, lowering_s + ended - began)
        return program, began, ended

    def finish(self) -> Programs:
        """Waits for the compiles started before the first step, then starts the background builds, if any.

        Only the wait goes to `chrono`'s `startup/compile` bucket: the seconds the compiles ran
        beside other work are that work's. Call it once, before the first step.

        Returns:
          self, every program before the first step ready.

        Raises:
          the error of the first program (in build order) that failed to compile, once the other
          compiles have ended.
        """
        if self._compiling is None:
            raise RuntimeError("Programs.finish: nothing was started (make Programs with start_programs) or finish already ran")
        if self._compile_pool is not None:
            try:
                with self._measure(goodput.COMPILE):  # the wait, from `waiting` on: the compiles' part not overlapped
                    waiting = time.perf_counter()
                    done = [(job, *future.result()) for job, future in self._compiling]
            finally:
                self._compile_pool.shutdown(wait=True)
                self._compile_pool = None
            for job, program, _, _ in done:
                self._ready(job, program)
            began, ended = min(d[2] for d in done), max(d[3] for d in done)
            self.compile_s += ended - began
            self.overlapped_s = max(0.0, min(waiting, ended) - began)
        self._compiling = None
        if self._later:
            self._start_background(self._later, self._threads)
        return self

    def _start_background(self, jobs: list[_Job], threads: int | None) -> None:
        """Builds `jobs`, in order, in a background thread (lowering) and a compile pool."""
        self._background = jobs
        self._pending = {(job.kind, job.capacity): concurrent.futures.Future() for job in jobs}
        self._pool = concurrent.futures.ThreadPoolExecutor(_workers(len(jobs), threads), thread_name_prefix="gem-compile")
        self._background_began = time.perf_counter()
        self._thread = threading.Thread(target=self._lower_in_background, name="gem-lower", daemon=True)
        self._thread.start()

    def _lower_in_background(self) -> None:
        self._go.wait()
        chosen: set[int] | None = None
        for job in self._background:
            if self._cancel.is_set():
                self._pending[(job.kind, job.capacity)].cancel()
                continue
            try:
                program = self._cache.load(job.path)
                if program is not None:
                    self.loaded += 1
                    self._finish(job, program)
                    continue
                if job.kind == "train":
                    if chosen is None:
                        self._timed.wait()
                        if self._cancel.is_set():
                            self._pending[(job.kind, job.capacity)].cancel()
                            continue
                        chosen = self._worth_building()
                    if job.capacity not in chosen:
                        self._skip(job)
                        continue
                lowered, lowering_s = _timed(job.step.lower, *job.args)
                self._pool.submit(self._compile_in_background, job, lowered, lowering_s)
            except Exception as error:  # noqa: BLE001 - reported, and the run goes on without the program
                self._fail(job, error)

    @property
    def _first_build_s(self) -> float | None:
        """Seconds the first train program's lowering and compile took (None: unknown)."""
        return self.build_s.get(("train", self._first)) if self._first is not None else None

    def _worth_building(self) -> set[int]:
        """The train capacities the executable cache does not hold that pay for their build
        (`capacities_worth_building`); all of them when a build's or a step's time is unknown."""
        missing = {job.capacity for job in self._background if job.kind == "train"}
        if self._first_build_s is None or self._step_s is None:
            return missing
        ready = set(self.train) | {c for kind, c in self._pending if kind == "train" and c not in missing}
        steps_left = sum(self._counts.values()) - self._steps
        return set(capacities_worth_building(self._counts, ready, self._step_s, self._first_build_s, steps_left))

    def _skip(self, job: _Job) -> None:
        self._not_built.append(job.capacity)
        self._run_larger.add(job.capacity)
        self._pending.pop((job.kind, job.capacity)).set_result(None)
        if not any(kind == "train" for kind, _ in self._pending) and self._not_built:
            print(
                f"gem-train: not building the train steps at token capacities {sorted(self._not_built)}: each would save "
                f"less device time over the {sum(self._counts.values()) - self._steps} steps left ({self._step_s:.3f} s a step "
                f"at {self._first}) than its build takes ({self._first_build_s:.1f} s); their batches run at a larger capacity",
                flush=True,
            )
        if not self._pending:
            self._all_ready()

    def _compile_in_background(self, job: _Job, lowered, lowering_s: float) -> None:
        try:
            program, compile_s = _timed(lowered.compile)
            self._store(job, program, lowering_s + compile_s)
            self._finish(job, program)
        except Exception as error:  # noqa: BLE001 - reported, and the run goes on without the program
            self._fail(job, error)

    def _finish(self, job: _Job, program) -> None:
        self._ready(job, program)
        self._pending.pop((job.kind, job.capacity)).set_result(None)
        if not self._pending:
            self._all_ready()

    def _all_ready(self) -> None:
        self._ready_after_s = time.perf_counter() - self._background_began
        self._ready_at_step = self._steps
        done = f"background builds done ({len(self._not_built)} train steps not built)" if self._not_built else "all programs ready"
        print(f"gem-train: {done}, {self._ready_after_s:.1f} s after the first step's (step {self._steps})", flush=True)

    def _fail(self, job: _Job, error: Exception) -> None:
        self._failed[job.name] = f"{type(error).__name__}: {error}"
        if job.kind == "train":
            self._run_larger.add(job.capacity)
        print(f"gem-train: building the {job.name} in the background failed ({type(error).__name__}: {error}); its batches run at a larger capacity", flush=True)
        self._pending.pop((job.kind, job.capacity)).set_result(None)

    def _ready(self, job: _Job, program) -> None:
        (self.train if job.kind == "train" else self.eval)[job.capacity] = program

    def _store(self, job: _Job, program, build_s: float) -> None:
        self.build_s[(job.kind, job.capacity)] = build_s
        note = self._cache.store(job.path, program, build_s)
        if note:
            print(f"gem-train: the {job.name} was {note}", flush=True)

    def _measure(self, bucket: str):
        return self.chrono.measure(bucket) if self.chrono is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Stops building. Before `finish` (an error came first): compiles not begun are dropped,
        those running end in their threads (the process's exit waits for them). In the background:
        programs not yet lowered are dropped, compiles in flight are waited for (counted as a late
        compile); then the executable cache holds every finished program."""
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
            self._compile_pool = None
        if self._thread is None:
            return
        self._cancel.set()
        self._go.set()
        self._timed.set()
        with self._late_compile("background builds in flight at the end of the run") if self._pending else contextlib.nullcontext():
            self._thread.join()
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._thread = None

    # ------------------------------------------------------------------ reporting

    def describe(self) -> str:
        """One line: how many programs, for which capacities, lowering and compile seconds."""
        planned = sorted(set(self.train) | {c for kind, c in self._pending if kind == "train"})
        parts = [f"train steps at token capacities {planned}" if planned else "no train step"]
        parts.append(f"an eval step at {self.eval_capacity}" if self.eval_capacity is not None else "no eval step")
        line = (
            f"compiled {self._before_first_step} programs before the first step ({self.loaded} loaded from the "
            f"executable cache): {', '.join(parts)}; lowering {self.lowering_s:.1f} s, compile {self.compile_s:.1f} s"
        )
        if self.overlapped_s:
            line += f" ({self.overlapped_s:.1f} s of it beside other start-up work: lowering, the state's initialisation or restore)"
        if self._pending:
            line += (
                f"; {len(self._pending)} more build in the background while the run trains, a train step only if it "
                "pays for its build (until a batch's own capacity is ready it runs at the smallest ready one above it)"
            )
        return line

    def report(self) -> dict[str, float | int]:
        """The run's program measurements, for its summary: `programs_before_first_step`,
        `programs_in_background`, `steps_at_larger_capacity` (placed above their own capacity
        while it was building), and once all were ready `programs_ready_after_s` (seconds after
        the background began) and `programs_ready_at_step`; `programs_not_built` (train steps that
        would not have paid for their build), `background_step_s` (the step time that decided it);
        `programs_failed` if any failed; `programs_compile_s` and `programs_compile_overlapped_s`
        (`compile_s`, `overlapped_s`: seconds)."""
        out: dict[str, float | int] = {
            "programs_before_first_step": self._before_first_step,
            "programs_in_background": len(self._background),
            "programs_compile_s": self.compile_s,
            "programs_compile_overlapped_s": self.overlapped_s,
        }
        if self._background:
            out["steps_at_larger_capacity"] = self._steps_padded
            out["programs_not_built"] = len(self._not_built)
            if self._step_s is not None:
                out["background_step_s"] = self._step_s
            if self._ready_after_s is not None:
                out.update(programs_ready_after_s=self._ready_after_s, programs_ready_at_step=self._ready_at_step)
        if self._failed:
            out["programs_failed"] = len(self._failed)
        return out


def _timed(fn: Callable, *args):
    """`(fn(*args), wall seconds it took)`."""
    began = time.perf_counter()
    return fn(*args), time.perf_counter() - began


def _workers(jobs: int, threads: int | None) -> int:
    return max(1, min(jobs, threads or int(os.environ.get(THREADS_ENV_VAR, 0)) or os.cpu_count() or 1))


def program_job(training: Training) -> dict:
    """What shapes a run's programs besides their arguments, for `ExecutableCache` keys: the resolved config
    without the loop and checkpoint settings (they change no program: a restart with more steps finds its
    programs) and the feature spec."""
    config = config_tree.to_tree(training.config)
    return {"config": {k: v for k, v in config.items() if k not in ("loop", "checkpoint")}, "spec": repr(training.dataset.spec)}


def start_programs(
    training: Training,
    train_capacities: dict[int, int] | Iterable[int],
    eval_capacities: Iterable[int],
    *,
    chrono: goodput.Chrono | None = None,
    threads: int | None = None,
    cache: ExecutableCache | None = None,
    background: bool = False,
) -> Programs:
    """Starts building the train and eval steps at the given capacities: loads them from `cache`, else
    lowers them one after the other now and compiles each in one of `threads` threads (storing it in
    `cache`), returning while they compile; `Programs.finish()` waits for them.

    Needs no train state: call it before initialising or restoring the state, to overlap the two.

    Args:
      training: the job (`setup_training`, `init_state=False` will do); its jitted steps are
        lowered on abstract arguments (`training.state.abstract`, `BatchPlacement.abstract`).
      train_capacities: token capacities (rows per device) of the train steps, or capacity ->
        how many steps take it (`planned_capacities`: the background builds the commonest first).
      eval_capacities: token capacities of the eval step (at most one is used by `Training.evaluate`).
      chrono: lowering before the first step goes to its `startup/lowering` bucket, loading
        and `finish`'s wait for the compiles to `startup/compile`.
      threads: compile threads (default: `$GEM_COMPILE_THREADS`, else one per program,
        at most the CPU count). On a GPU, XLA autotunes while it compiles, on the device:
        fewer threads trade start-up time for undisturbed autotuning.
      cache: compiled programs on disk under a key known before tracing
        (`gem_jax.train.executable_cache`); a hit skips lowering and compiling.
      background: build only the largest train capacity before the first step and the rest
        in the background once `finish` returns (the module docstring's background schedule;
        call `Programs.close()` at the end).

    Raises:
      the errors of tracing and lowering a step (a compile's error comes from `finish`).
    """
    counts = train_capacities if isinstance(train_capacities, dict) else dict.fromkeys(sorted(set(train_capacities)), 1)
    evals = sorted(set(eval_capacities))
    dataset, placement = training.dataset, training.placement
    cache = ExecutableCache(None) if cache is None else cache
    template = dataset.train_batch(range(min(dataset.batch_size, dataset.info.num_train_examples)))
    job = program_job(training)

    def make(kind: str, capacity: int) -> _Job:
        step, state = (training.train_step, training.state.abstract) if kind == "train" else (training.eval_step, training.state.abstract.params)
        args = (state, placement.abstract(template, capacity))
        return _Job(kind, capacity, step, args, cache.path(f"{kind}_step", args, job))

    programs = Programs(training, evals[-1] if evals else None, chrono, cache)
    if background and counts:
        # The first program holds every batch: the largest planned capacity, or a larger one the cache
        # holds (a restart whose batches stop short of the largest capacity loads it instead of building one).
        per = dataset.batch_size // placement.num_shards
        candidates = [max(counts), *(c for c in dataset.token_buckets.capacities(per) if c > max(counts))]
        first = next((c for c in candidates if (path := make("train", c).path) is not None and path.exists()), max(counts))
        # the eval step first (its compile is the longest, and an eval waits for it), then the commonest capacities
        rest = [make("eval", c) for c in evals] + [make("train", c) for c in sorted(counts, key=lambda c: -counts[c]) if c != first]
        programs._counts, programs._first = dict(counts), first
        programs._start([make("train", first)], threads, later=rest)
    else:
        programs._start([make("train", c) for c in counts] + [make("eval", c) for c in evals], threads, later=[])
    return programs
