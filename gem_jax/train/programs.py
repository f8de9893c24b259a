"""Every step program a run executes, compiled before its first step: a train step per token capacity, one eval step.

A batch's history rows are packed into one of the data set's token capacities
(`gem_jax.jagged.TokenBuckets`), and each capacity is its own program. Which ones a run
takes is known before it starts: the batches' example indices come from the shuffle
seed, their history lengths from the data set's metadata, so `run_capacities` replays
the placement's choice (`gem_jax.parallel.placement`) for every batch of the steps to
run and of the eval set, without building a batch. Every eval batch is placed at the
largest capacity an eval batch takes, so the eval step is one program (eval is forward
only: its extra slack costs less than lowering and compiling a program per capacity).
`compile_programs` then lowers each
program (`jax.jit(...).lower` on abstract arguments: Python tracing, which holds the
GIL) one after the other and compiles them in parallel threads (XLA compiles release
the GIL); jax's persistent cache (`gem_jax.train.compile_cache`) serves a warm start.

A batch at a capacity that was not compiled (the replay and the placement disagree,
which is a bug, or the train iterator was moved) is compiled when it comes, with its
reason counted in the run's `compile_after_start` time (`gem_jax.train.goodput`),
rather than stopping a long job for a shape. With an `ExecutableCache` (`gem-train` keeps
it beside jax's persistent cache, on GPUs), a warm start loads each program and skips its
lowering, which the persistent cache cannot skip.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np

from gem_jax.batch import Batch
from gem_jax.jagged import TokenBuckets, pick_capacity
from gem_jax.train import config_tree, goodput
from gem_jax.train.executable_cache import ExecutableCache
from gem_jax.train.setup import Training

THREADS_ENV_VAR = "GEM_COMPILE_THREADS"


def batch_capacity(lengths: np.ndarray, num_shards: int, buckets: TokenBuckets) -> int:
    """The token capacity the placement packs a global batch into.

    Args:
      lengths: int `[B]` history rows of each example in device order (0 for padding).
      num_shards: D, the devices the batch is split over (D divides B).
      buckets: the data set's token buckets.

    Returns:
      The smallest of `buckets.capacities(B/D)` holding the fullest device's rows.
    """
    per = lengths.shape[0] // num_shards
    return pick_capacity(int(lengths.reshape(num_shards, per).sum(axis=1).max()), buckets.capacities(per))


def run_capacities(
    indices, lengths: Callable[[np.ndarray], np.ndarray], batches: Iterable[int], batch_size: int, num_shards: int, buckets: TokenBuckets
) -> tuple[int, ...]:
    """The sorted token capacities the batches `batches` of `indices` take.

    Args:
      indices: a grain `MapDataset` of each batch's example indices (int64 `[<= B]`,
        `Dataset.train_indices()` or `eval_indices()`).
      lengths: example indices -> their history rows (`Dataset.train_lengths` / `eval_lengths`).
      batches: positions in `indices` (the steps a run takes).
      batch_size: B (a short batch is padded with examples of no rows).
      num_shards: D.
      buckets: the data set's token buckets.
    """
    taken = set()
    padded = np.zeros(batch_size, np.int64)
    for k in batches:
        idx = np.asarray(indices[k], np.int64)
        padded[:] = 0
        padded[: idx.shape[0]] = lengths(idx)
        taken.add(batch_capacity(padded, num_shards, buckets))
    return tuple(sorted(taken))


@dataclasses.dataclass
class Programs:
    """The compiled train and eval steps of a run, by token capacity.

    Call `train_step(state, batch)` and `eval_step(params, batch)` as the jitted steps of
    `Training`; each picks the executable of the batch's capacity (`batch.history.values`
    `[D, T_local, F]`: `T_local`). A capacity without one is compiled then, in `chrono`'s
    `compile_after_start` bucket with the reason named.

    Attributes:
      training: the job whose `train_step` / `eval_step` these are.
      train: capacity -> compiled train step.
      eval: capacity -> compiled eval step.
      lowering_s, compile_s: wall seconds of the ahead-of-time lowering and compiling
        (loading from the executable cache included).
      chrono: where late compiles are counted (None: not counted).
      loaded: how many of the programs came from the executable cache.
    """

    training: Training
    train: dict[int, jax.stages.Compiled]
    eval: dict[int, jax.stages.Compiled]
    lowering_s: float = 0.0
    compile_s: float = 0.0
    chrono: goodput.Chrono | None = None
    loaded: int = 0

    def train_step(self, state, batch: Batch):
        """`(state, placed batch) -> (state, metrics)`, donating `state` (`gem_jax.train.step.make_train_step`)."""
        capacity = batch.history.values.shape[1]
        if capacity not in self.train:
            self.train[capacity] = self._late(f"train step, token capacity {capacity}", self.training.train_step, self.training.state.abstract, batch)
        return self.train[capacity](state, batch)

    def eval_step(self, params, batch: Batch) -> dict:
        """`(params, placed batch) -> dict` (`gem_jax.train.step.make_eval_step`)."""
        capacity = batch.history.values.shape[1]
        if capacity not in self.eval:
            self.eval[capacity] = self._late(f"eval step, token capacity {capacity}", self.training.eval_step, self.training.state.abstract.params, batch)
        return self.eval[capacity](params, batch)

    def _late(self, reason: str, step, *args) -> jax.stages.Compiled:
        print(f"gem-train: compiling the {reason}: no batch of the planned steps took it", flush=True)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args)
        with self.chrono.late_compile(reason) if self.chrono is not None else contextlib.nullcontext():
            return step.lower(*abstract).compile()

    @property
    def eval_capacity(self) -> int | None:
        """The token capacity every eval batch is placed at (`Training.evaluate(capacity=...)`); None: no eval step."""
        return max(self.eval) if self.eval else None

    def describe(self) -> str:
        """One line: how many programs, for which capacities, lowering and compile seconds."""
        parts = [f"{len(self.train)} train step(s) (token capacities {sorted(self.train)})" if self.train else "no train step"]
        parts.append(f"{len(self.eval)} eval step(s) (token capacities {sorted(self.eval)})" if self.eval else "no eval step")
        return (
            f"compiled {len(self.train) + len(self.eval)} programs before the first step ({self.loaded} loaded from the "
            f"executable cache): {', '.join(parts)}; lowering {self.lowering_s:.1f} s, compile {self.compile_s:.1f} s"
        )


def planned_capacities(training: Training, train_steps: range, evaluates: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token capacities of the train batches of `train_steps`, and, if `evaluates`, the eval step's:
    the largest any eval batch takes (all of them are placed at it)."""
    dataset, num_shards, buckets = training.dataset, training.placement.num_shards, training.dataset.token_buckets
    train = run_capacities(dataset.train_indices(), dataset.train_lengths, train_steps, dataset.batch_size, num_shards, buckets)
    evals = (
        run_capacities(dataset.eval_indices(), dataset.eval_lengths, range(dataset.num_eval_batches), dataset.batch_size, num_shards, buckets)[-1:]
        if evaluates
        else ()
    )
    return train, evals


def program_job(training: Training) -> dict:
    """What shapes a run's programs besides their arguments, for `ExecutableCache` keys: the resolved config
    without the loop and checkpoint settings (they change no program: a restart with more steps finds its
    programs) and the feature spec."""
    config = config_tree.to_tree(training.config)
    return {"config": {k: v for k, v in config.items() if k not in ("loop", "checkpoint")}, "spec": repr(training.dataset.spec)}


def compile_programs(
    training: Training,
    train_capacities: Iterable[int],
    eval_capacities: Iterable[int],
    *,
    chrono: goodput.Chrono | None = None,
    threads: int | None = None,
    cache: ExecutableCache | None = None,
) -> Programs:
    """The train and eval steps at the given capacities: loaded from `cache`, else lowered one after the
    other and compiled in `threads` parallel threads (and stored in `cache`).

    Args:
      training: the job (`setup_training`); its jitted steps are lowered on abstract
        arguments (`training.state.abstract`, `BatchPlacement.abstract`).
      train_capacities, eval_capacities: token capacities (rows per device).
      chrono: lowering goes to its `startup/lowering` bucket, loading, compiling and storing
        to `startup/compile`.
      threads: compile threads (default: `$GEM_COMPILE_THREADS`, else one per program,
        at most the CPU count). On a GPU, XLA autotunes while it compiles, on the device:
        fewer threads trade start-up time for undisturbed autotuning.
      cache: compiled programs on disk under a key known before tracing
        (`gem_jax.train.executable_cache`); a hit skips lowering and compiling.
    """
    dataset, placement = training.dataset, training.placement
    cache = ExecutableCache(None) if cache is None else cache
    template = dataset.train_batch(range(min(dataset.batch_size, dataset.info.num_train_examples)))
    jobs = [("train", c, training.train_step, (training.state.abstract, placement.abstract(template, c))) for c in sorted(set(train_capacities))]
    jobs += [("eval", c, training.eval_step, (training.state.abstract.params, placement.abstract(template, c))) for c in sorted(set(eval_capacities))]
    measure = chrono.measure if chrono is not None else lambda bucket: contextlib.nullcontext()
    job = program_job(training)
    began = time.perf_counter()
    with measure(goodput.COMPILE):
        paths = [cache.path(f"{kind}_step", args, job) for kind, _, _, args in jobs]
        compiled = [cache.load(path) for path in paths]
    missing = [i for i, c in enumerate(compiled) if c is None]
    loading_s = time.perf_counter() - began
    began = time.perf_counter()
    with measure(goodput.LOWERING):
        lowered = {i: jobs[i][2].lower(*jobs[i][3]) for i in missing}
    lowering_s = time.perf_counter() - began
    began = time.perf_counter()
    with measure(goodput.COMPILE):
        if missing:
            workers = max(1, min(len(missing), threads or int(os.environ.get(THREADS_ENV_VAR, 0)) or os.cpu_count() or 1))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                for i, program in zip(missing, pool.map(lambda i: lowered[i].compile(), missing)):
                    compiled[i] = program
                    note = cache.store(paths[i], program)
                    if note:
                        print(f"gem-train: the {jobs[i][0]} step at token capacity {jobs[i][1]} was {note}", flush=True)
    compile_s = loading_s + time.perf_counter() - began
    train = {capacity: c for (kind, capacity, _, _), c in zip(jobs, compiled) if kind == "train"}
    evals = {capacity: c for (kind, capacity, _, _), c in zip(jobs, compiled) if kind == "eval"}
    return Programs(training, train, evals, lowering_s, compile_s, chrono, loaded=len(jobs) - len(missing))
