"""Ahead-of-time programs: the replayed capacities are the placement's, and a run compiles nothing after step 1."""

import collections
import concurrent.futures
import json
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from gem_jax.cli import train_main
from gem_jax.data.pipeline import load_dataset
from gem_jax.jagged import TokenBuckets
from gem_jax.parallel.placement import stack_batch
from gem_jax.train import capacity_plan, goodput, programs
from gem_jax.train.config import load_config
from gem_jax.train.config_tree import apply_overrides
from gem_jax.train.loop import dry_run, train_and_evaluate
from gem_jax.train.run_record import RunMismatchError
from gem_jax.train import disk_space
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.setup import Training, setup_training
from gem_jax.train.state import TrainState
from tolerances import sum_worst

# ml-latest-small, 16 examples of up to 64 events: its first 6 train batches take 3 token capacities.
SEVERAL_CAPACITIES = ["data.capacity_step=1.05", "data.max_seq_len=64", "data.batch_size=16", "loop.num_steps=50", "loop.log_every=2"]


@pytest.fixture(scope="module")
def config(repo_root):
    return apply_overrides(load_config(repo_root / "configs" / "movielens_tiny.py"), SEVERAL_CAPACITIES)


@pytest.mark.parametrize("num_shards", [1, 4])
def test_replayed_capacities_are_those_the_placement_takes(config, num_shards):
    dataset = load_dataset(config.data)
    buckets = dataset.token_buckets
    train = dataset.train_iterator()
    placed = collections.Counter(stack_batch(next(train), num_shards, buckets).history.values.shape[1] for _ in range(12))
    replayed = capacity_plan.run_capacities(dataset.train_indices(), dataset.train_lengths, range(12), 16, num_shards, buckets)
    assert replayed == dict(placed) and list(replayed) == sorted(placed)
    assert len(placed) >= (3 if num_shards == 1 else 1)
    evals = collections.Counter(stack_batch(b, num_shards, buckets).history.values.shape[1] for b in dataset.eval_batches())
    got = capacity_plan.run_capacities(dataset.eval_indices(), dataset.eval_lengths, range(dataset.num_eval_batches), 16, num_shards, buckets)
    assert got == dict(evals)


def test_batch_capacity_is_the_fullest_device_rounded_up():
    buckets = TokenBuckets(mean_length=10.0, std_length=2.0, max_seq_len=64, step=1.25)
    lengths = np.array([10, 10, 30, 2])  # devices: 20 and 32 rows
    assert capacity_plan.batch_capacity(lengths, 2, buckets) == min(c for c in buckets.capacities(2) if c >= 32)


def test_a_run_over_three_capacities_compiles_nothing_after_step_1(config, tmp_path, capsys):
    compiles = []

    def listen(event, duration, **kwargs):
        if event == goodput.BACKEND_COMPILE_EVENT:
            compiles.append((time.perf_counter(), kwargs.get("fun_name")))

    monitoring.register_event_duration_secs_listener(listen)
    began = time.time()
    try:
        summary = train_and_evaluate(config, tmp_path, stop_after_steps=6, progress=False)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    elapsed = time.time() - began
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert summary["compiles_after_start"] == 0
    # the step programs were compiled (or loaded from the suite's executable cache) ahead of time, one per capacity
    assert "compiled 3 programs before the first step" in capsys.readouterr().out
    assert len([name for _, name in compiles if "train_step" in (name or "")]) <= 3, compiles
    buckets = {k: v for k, v in summary.items() if k.startswith("time_")}
    assert sum(buckets.values()) == pytest.approx(summary["wall_s"], rel=1e-9)
    # the wall clock covers the whole call but the writing of the summary itself (tenths of a second under load)
    assert elapsed - 1.5 < summary["wall_s"] <= elapsed
    assert 0 < summary["goodput"] == pytest.approx(summary["time_train_step_s"] / summary["wall_s"])
    assert summary["time_startup_compile_s"] > 0 and summary["time_startup_lowering_s"] > 0
    summary_record = records[-1]
    assert summary_record["kind"] == "summary" and summary_record["goodput"] == summary["goodput"]
    assert all("goodput" in r and "data_wait_s" in r for r in train)


@pytest.mark.parametrize("slowed", ["init", "restore"])
def test_the_programs_compile_while_the_state_is_initialised_or_restored(config, tmp_path, monkeypatch, capsys, slowed):
    """Init (a fresh run) or restore (a resumed one) and every compile slowed by 2 s: the init or the
    restore runs in a thread beside the plan and the lowering, the compiles beside its rest, and only
    the rest of their waits are `startup/init` (or `restore`) and `startup/compile`."""
    pause = 2.0
    if slowed == "restore":
        train_and_evaluate(config, tmp_path, stop_after_steps=2, progress=False)
    compiles = []  # (start, seconds) of each compile in a compile thread, the pause left out
    compile = jax.stages.Lowered.compile

    def slow_compile(lowered, *args, **kwargs):
        time.sleep(pause)
        began = time.perf_counter()
        try:
            return compile(lowered, *args, **kwargs)
        finally:
            if threading.current_thread().name.startswith("gem-compile"):
                compiles.append((began, time.perf_counter() - began))

    foreground = {"init": (Training, "initial_state"), "restore": (Checkpointer, "restore_latest")}[slowed]
    work = getattr(*foreground)
    worked = []  # (thread name, start, seconds) of the slowed work

    def slow_work(*args, **kwargs):
        began = time.perf_counter()
        time.sleep(pause)
        try:
            return work(*args, **kwargs)
        finally:
            worked.append((threading.current_thread().name, began, time.perf_counter() - began))

    monkeypatch.setattr(*foreground, slow_work)
    monkeypatch.setattr(jax.stages.Lowered, "compile", slow_compile)
    capsys.readouterr()
    summary = train_and_evaluate(config, tmp_path, stop_after_steps=2, progress=False)
    buckets = {k: v for k, v in summary.items() if k.startswith("time_")}
    assert sum(buckets.values()) == pytest.approx(summary["wall_s"], rel=1e-6)
    assert summary["programs_before_first_step"] == len(compiles) >= 1 and summary["compiles_after_start"] == 0
    assert summary["programs_compile_s"] >= pause + max(seconds for _, seconds in compiles)
    # The compiles ran partly beside other start-up work (the next program's lowering, the wait for the slowed
    # work): that part is `programs_compile_overlapped_s`, the rest the trainer waited for (`startup/compile`).
    # How the two split depends on the machine's speed (lowering against the pause), so neither is pinned.
    overlapped = summary["programs_compile_overlapped_s"]
    assert 0 < overlapped <= summary["programs_compile_s"]
    assert overlapped + summary["time_startup_compile_s"] >= summary["programs_compile_s"]
    last = max(compiles)[1]
    (thread, began, seconds), = worked
    # In a thread from before the first lowering: the state's bucket (init or restore) and the compile bucket
    # hold less than the slowed work and the last compile one after the other (plus the learning-rate
    # schedule's first use).
    assert thread.startswith("gem-state") and began < min(compiles)[0]
    bucket = {"init": "time_startup_init_s", "restore": "time_restore_s"}[slowed]
    assert summary[bucket] + summary["time_startup_compile_s"] < seconds + pause + last
    assert "of it beside other start-up work" in capsys.readouterr().out


def test_array_bytes_counts_params_and_optimizer_state_from_shapes():
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params={"w": jax.ShapeDtypeStruct((3, 4), jnp.float32)},
        opt_state=(jax.ShapeDtypeStruct((3, 4), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32)),
    )
    sizes = [disk_space.array_bytes(tree) for tree in (abstract.params, abstract.opt_state, abstract)]
    assert sizes == [48, 28, 80]


def test_dry_run_names_the_programs_and_the_checkpoint_size_and_writes_nothing(repo_root, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GEM_COMPILE_CACHE_DIR", raising=False)  # the default cache, WORKDIR/jax_cache: not made either
    workdir = tmp_path / "run"
    train_main(["--config", str(repo_root / "configs" / "movielens_tiny.py"), "--workdir", str(workdir), "--dry-run", "--set", *SEVERAL_CAPACITIES])
    out = capsys.readouterr().out
    assert '"capacity_step": 1.05' in out  # the resolved config
    assert re.search(r"would compile \d+ programs: train steps at token capacities \d+ \(\d+ steps\)", out)
    assert "a checkpoint holds" in out
    assert f"gem-train: compilation cache {workdir / 'jax_cache'} (unused: --dry-run compiles nothing)" in out
    assert not workdir.exists() and list(tmp_path.iterdir()) == []


def test_a_dry_run_on_a_workdir_says_where_the_run_resumes_or_why_it_would_be_refused(config, ahead_run, capsys):
    workdir = ahead_run[2]
    before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
    capsys.readouterr()
    assert dry_run(config, workdir)["start_step"] == 6
    out = capsys.readouterr().out
    assert f"{workdir} holds this run: it would resume from its newest checkpoint, step 6" in out
    assert f"(the batches of steps 7 to {config.loop.num_steps})" in out
    with pytest.raises(RunMismatchError, match=r"optim.learning_rate: recorded 0.01, now 0.005"):
        dry_run(apply_overrides(config, ["optim.learning_rate=0.005"]), workdir)
    with pytest.raises(RunMismatchError, match="loop.num_steps=4 is below the newest checkpoint, step 6"):
        dry_run(apply_overrides(config, ["loop.num_steps=4"]), workdir)
    assert dry_run(apply_overrides(config, ["optim.learning_rate=0.005"]), workdir, force_new=True)["start_step"] == 0
    assert f"--force-new: the run in {workdir} would be moved to {workdir / 'previous_runs'}/<time>" in capsys.readouterr().out
    assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == before  # nothing written or moved


@pytest.fixture(scope="module")
def ahead_run(config, tmp_path_factory):
    """6 steps with every program built before step 1: (summary, train losses, workdir)."""
    workdir = tmp_path_factory.mktemp("ahead")
    summary = train_and_evaluate(config, workdir, stop_after_steps=6, progress=False)
    return summary, _losses(workdir), workdir


def _losses(workdir):
    return [r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


@pytest.mark.parametrize("pays", [False, True])
def test_a_run_compiling_in_the_background_starts_after_the_largest_program_and_learns_as_the_ahead_run(
    config, ahead_run, tmp_path, capsys, monkeypatch, pays
):
    ahead, ahead_losses, _ = ahead_run
    capsys.readouterr()
    if pays:  # as if a long run: every capacity saves more than its build
        monkeypatch.setattr(programs, "capacities_worth_building", lambda counts, ready, *_: [c for c in counts if c not in set(ready)])
    background = apply_overrides(config, ["loop.compile_in_background=True"])
    summary = train_and_evaluate(background, tmp_path / "background", stop_after_steps=6, progress=False)
    out = capsys.readouterr().out
    assert "compiled 1 programs before the first step" in out and "2 more build in the background" in out
    assert summary["programs_before_first_step"] == 1 and summary["programs_in_background"] == 2
    assert summary["background_step_s"] > 0
    if pays:
        assert summary["programs_not_built"] == 0 and "not building" not in out  # built (or still building when the run ended)
        assert 0 <= summary["steps_at_larger_capacity"] <= 6
    else:
        # 3 steps left after the timed ones save milliseconds; each build took seconds: steps 4-6 run at the largest
        assert summary["programs_not_built"] == 2 and "not building the train steps at token capacities" in out
        assert "all programs ready" not in out  # two never will be: the end of the builds says so ("background builds done")
        assert summary["steps_at_larger_capacity"] >= 3
        assert summary["compiles_after_start"] == 0  # nothing built in the background, nothing waited for at the end
    buckets = {k: v for k, v in summary.items() if k.startswith("time_")}
    assert sum(buckets.values()) == pytest.approx(summary["wall_s"], rel=1e-9)

    # The same examples and labels, with more slack rows in the steps placed above their own capacity:
    # only float32 summation order differs (attention sums over at most the largest capacity's keys).
    bound = sum_worst(max(capacity_plan.planned_capacities(setup_training(config, init_state=False)[0], range(6), False)[0]))
    np.testing.assert_allclose(_losses(tmp_path / "background"), ahead_losses, rtol=bound)
    assert summary["loss"] == pytest.approx(ahead["loss"], rel=bound)


def test_a_batch_whose_program_is_building_is_placed_at_the_smallest_ready_capacity_above_it(config):
    training, _ = setup_training(config, init_state=False)
    buckets, num_shards = training.dataset.token_buckets, training.placement.num_shards
    batches = training.dataset.local_train_iterator(training.placement.shard)
    local = min((next(batches) for _ in range(12)), key=lambda b: capacity_plan.batch_capacity(np.asarray(b.lengths), num_shards, buckets))
    needed = capacity_plan.batch_capacity(np.asarray(local.lengths), num_shards, buckets)
    above = [c for c in buckets.capacities(local.global_batch_size // num_shards) if c > needed][:2]
    assert len(above) == 2
    built = programs.Programs(training, None, None, programs.ExecutableCache(None))
    assert built.train_capacity(local) is None  # nothing building: the placement's own choice
    built._pending = {("train", needed): concurrent.futures.Future(), ("train", above[0]): concurrent.futures.Future()}
    built.train[above[1]] = object()
    assert built.train_capacity(local) == above[1]  # its own and the next are building: the smallest ready above
    built.train[needed] = object()
    assert built.train_capacity(local) == needed
    assert built.report()["programs_in_background"] == 0
    del built.train[needed]
    built._step_s, built._counts, built._first, built.build_s = 0.2, {above[1]: 1}, above[1], {("train", above[1]): 78.0}  # what a skip's line reports
    for never_built in ("_skip", "_fail"):  # not built (it would not have paid) or its build failed: the smallest ready above, for good
        built._run_larger, built._pending = set(), {("train", needed): concurrent.futures.Future(), ("train", above[0]): concurrent.futures.Future()}
        for capacity in (needed, above[0]):
            job = programs._Job("train", capacity, None, (), None)
            built._skip(job) if never_built == "_skip" else built._fail(job, RuntimeError("compile failed"))
        assert built.train_capacity(local) == above[1]


def test_a_run_too_short_to_time_a_step_builds_its_eval_step_and_no_other_train_step(config, tmp_path, capsys):
    short = apply_overrides(config, ["loop.compile_in_background=True", "loop.num_steps=2"])
    summary = train_and_evaluate(short, tmp_path / "short", progress=False)
    out = capsys.readouterr().out
    assert summary["finished"] and "auc_like" in summary  # the final eval waited for its program
    assert summary["programs_in_background"] >= 2 and "background_step_s" not in summary
    assert summary["compiles_after_start"] >= 1 and "compile after start: waiting for the background build of the eval step" in out
    assert "not building" not in out and "all programs ready" not in out  # the train steps were never weighed: the run ended


def test_a_warm_start_weighs_the_other_programs_against_the_build_the_cache_recorded(config, tmp_path):
    training, _ = setup_training(config, init_state=False)
    counts, _ = capacity_plan.planned_capacities(training, range(6), False)
    cache = programs.ExecutableCache(tmp_path)
    cold = programs.start_programs(training, counts, [], cache=cache, background=True).finish()
    cold.close()
    largest = max(counts)
    built_s = cold.build_s[("train", largest)]
    assert cold.loaded == 0 and built_s > 0 and cold._first_build_s == built_s
    warm = programs.start_programs(training, counts, [], cache=cache, background=True).finish()
    warm.close()
    assert warm.loaded >= 1 and warm.build_s[("train", largest)] == built_s and warm._first_build_s == built_s
    # A restart whose batches stop short of the largest capacity loads the cached larger program
    # rather than building its own largest, which it weighs in the background like the others.
    short = {c: n for c, n in counts.items() if c != largest}
    restart = programs.start_programs(training, short, [], cache=cache, background=True)
    assert restart._first == largest and restart.loaded == 1 and restart.lowering_s == 0
    assert ("train", max(short)) in {(job.kind, job.capacity) for job in restart._later}
    restart.close()
    assert restart._first_build_s == built_s
    # Its own largest cached as well (an ahead build stores it): that one, not the larger.
    programs.start_programs(training, {max(short): 1}, [], cache=cache).finish().close()
    again = programs.start_programs(training, short, [], cache=cache, background=True)
    again.close()
    assert again._first == max(short) and again.loaded == 1


def test_a_capacity_is_built_when_its_steps_save_more_than_its_build():
    counts = {100: 400, 120: 300, 150: 300}
    # Without 100 and 120 every step runs at 150: 0.3 s. Adding 120 saves (30 * 700) / 150 * 0.3 = 42 s over the
    # whole run, adding 100 instead (50 * 400) / 150 * 0.3 = 40 s; with 120 built, 100 saves 20 * 400 / 150 * 0.3 = 16 s.
    assert capacity_plan.capacities_worth_building(counts, [150], 0.3, build_s=15.0, steps_left=1000 + 50) == [120, 100]
    ahead = (1000 - 20 / 0.3) / 1000  # the share of the run left once a 20 s build is done
    assert 16 * ahead <= 20 < 42 * ahead
    assert capacity_plan.capacities_worth_building(counts, [150], 0.3, build_s=20.0, steps_left=1000) == [120]
    assert capacity_plan.capacities_worth_building(counts, [150], 0.3, build_s=45.0, steps_left=1000) == []
    assert capacity_plan.capacities_worth_building(counts, [150], 0.3, build_s=15.0, steps_left=40) == []  # the run ends first
    assert capacity_plan.capacities_worth_building(counts, [120, 150], 0.3, build_s=15.0, steps_left=1000) == [100]
    assert capacity_plan.capacities_worth_building({}, [150], 0.3, build_s=1.0, steps_left=10) == []
    with pytest.raises(ValueError, match="no ready capacity holds the largest batch"):
        capacity_plan.capacities_worth_building(counts, [120], 0.3, build_s=1.0, steps_left=1000)
