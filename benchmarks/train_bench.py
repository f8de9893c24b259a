"""Training throughput of the GEM-like sharded config on 1 and N GPUs of one host; scaling ratio.

Weak scaling: every GPU gets the same number of examples per step
(`--per-device-batch`), so perfect scaling doubles the throughput from 1 to 2 GPUs.
Scaling ratio = throughput(N) / (N x throughput(1)); GEM reports
E2E MFU = Local MFU x Scaling Ratio. FLOPs are the jagged-aware model count of
`gem_jax.model.flops` (real tokens only); MFU is per GPU against the dense bf16 peak.

The job is built by the trainer's own `gem_jax.train.setup_training`. The data are the
synthetic source's batches (`gem_jax.data.sources.synthetic`, long-tailed lengths, built
directly, without grain): a few global batches are built on the host and
put on the devices once, then cycled, so the timing is the device step (host pipeline
excluded). Each step is timed on its own (dispatch to
`block_until_ready`); the median is reported (`median_step_s`, and `mfu_per_device` from it).
Then the same number of steps is dispatched back to back, as `gem-train` runs the steps of a log
window, with one wait at the end for the last step's state (a thread of its own notes when the
first step's metrics are ready): `pipelined_step_s` is their mean, in which the host dispatches the next step
while the device runs this one (`pipelined_mfu_per_device`, `local_mfu_pipelined`,
`speedup_vs_padded_peer_pipelined`); `pipelined_steady_step_s` times them from the end of the first
to the end of the last (None for one step), the pace once the device runs. It is a job's step when
the job's host work between dispatches (the next batch, its checks and transfer) keeps ahead of the
device, the host pipeline excluded as above. The difference from `median_step_s` is what a step run
alone waits for its own dispatch and its result's return. `pipelined_dispatch_s` is the median time
the host spends in one of those dispatches (until the call returns): near the step time, the host
waits, on the device or on its own launches; `pipelined_dispatch_min_s`, the shortest, is the
host's own cost of a dispatch while it is ahead of the device.

`--attention` names one or more modes, run one after the other in this process; the first
is reported at the top level of the JSON, the others under `peers`:
`auto` (the Pallas kernels on Hopper; the jnp references if they fail), `pallas`, `xla`
(the jnp references), and `padded`, the peer a JAX user has without jagged kernels: cuDNN
flash attention on the padded layout with sequence lengths for the softmax attention and
the jnp reference for the GELU attention (`ModelConfig.attention_implementation="cudnn"`,
`gem_jax.model.config.attention_implementations`). `xla`, `padded` and `auto`'s fallback
also run flax's RMSNorm (`ModelConfig.norm_implementation="xla"`); `auto` and `pallas` keep
the config's norms (by default the kernels on Hopper). With a `padded` peer each run records
`speedup_vs_padded_peer` = the peer's median step time / this mode's, on as many devices.

`--profile` adds the CUPTI kernel breakdown of one warm step (after the timed steps) to
each run: milliseconds per kernel group and the 60 longest kernels (`benchmarks/_profile.py`),
each fusion with the model lines it runs (`benchmarks/_hlo_sources.py`); and, from three more
warm steps dispatched back to back under the profiler's trace, the device's idle time between
kernels, inside the steps and between them (`profile.idle`: `steps_traced`, the span, busy and
idle time, the gaps by the kind of kernel each precedes, the longest named, and the memsets' and
copies' count and time). It needs a GPU; elsewhere
the run says it was skipped.

Start-up: `time_to_first_step_s` (top level) runs from the process start to the end of
the first run's first step; each run has `setup_to_first_step_s` (from building the job)
and `compile_s` (the first step's time less the median step). `--compile-cache DIR`
points jax's persistent compilation cache at DIR (default: `$GEM_COMPILE_CACHE_DIR`, else
none): run the same command twice with the same DIR for a cold and a warm start; each run's
`compile_cache` counts the cache's hits and misses.

`--set PATH=VALUE ...` overrides config fields as `gem-train --set` does (e.g.
`model.remat.budget_gb=80`); each run records its rematerialization plan under
`remat_plan` (None without one; `gem_jax.train.remat_plan`).

`--fit-batch`: a mode whose step runs out of device memory (XLA's RESOURCE_EXHAUSTED) at
`--per-device-batch` is run again at the largest per-device batch that should fit, derived
from the bytes the failed allocation asked (`benchmarks/_fit_batch.py`), and once more from
the next message if that also runs out: `MAX_TRIES` tries in all, each a set-up and a
compile. Each run records the batch it ran (`per_device_batch`) and the tries that failed
before it (`failed_tries`: batch, bytes asked, the batch derived from them); a mode whose
tries all fail records them with its error. `examples_per_s_vs_padded_peer` = this mode's
examples/s / the peer's, each at the batch it ran; `speedup_vs_padded_peer` compares step
times only where both ran the same batch (None elsewhere).

    PYTHONPATH=. python3 benchmarks/train_bench.py --devices 1 2 --out results.json
    PYTHONPATH=. python3 benchmarks/train_bench.py --config configs/gem_h200.py --devices 1 \
        --attention auto padded --profile --compile-cache /tmp/jax_cache --out step.json
    PYTHONPATH=. python3 benchmarks/train_bench.py --config configs/gem_h200_seq4096.py --devices 1 \
        --attention auto padded --fit-batch --out seq4096.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from benchmarks import _hlo_sources, _profile, _timing
from benchmarks._fit_batch import MAX_TRIES, BatchFitError, StepOutOfMemory, failed_try, memory_before_step
from gem_jax.device_memory import MEMORY_FRACTION_VARIABLES, claim_device_memory, is_out_of_memory
from gem_jax.mesh import Topology
from gem_jax.model import flops as flops_lib
from pallas_kernels import Implementation
from gem_jax.nn.embeddings import check_lookup_stats
from gem_jax.train import compile_cache, config_tree, remat_plan
from gem_jax.train.config import TrainConfig, load_config
from gem_jax.train.run_record import code_version
from gem_jax.train.setup import setup_training
from gem_jax import xla_options

REPO = Path(__file__).resolve().parent.parent

# Each mode's attention implementations, tried in order until one runs.
MODES = {"auto": (None, "xla"), "pallas": ("pallas",), "xla": ("xla",), "padded": (Implementation.CUDNN,)}
# Attention implementations whose runs also take flax's RMSNorm: the references and the padded peer.
WITH_FLAX_NORMS = ("xla", Implementation.CUDNN)
PEER = "padded"

# jax's persistent-cache events ("/jax/compilation_cache/cache_hits", ".../cache_misses").
CACHE_EVENTS: collections.Counter = collections.Counter()


def _count_cache_event(event: str, **_) -> None:
    if event.startswith("/jax/compilation_cache/"):
        CACHE_EVENTS[event.rsplit("/", 1)[-1]] += 1


def process_age_s() -> float | None:
    """Seconds since this process started (None where psutil cannot tell)."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # psutil missing or the platform hides process times
        return None


def topology_for(num_devices: int, experts_per_node: int) -> Topology:
    """One zone, one node of `num_devices` GPUs; as many expert slots as the config asks, if they fit."""
    slots = experts_per_node if num_devices % experts_per_node == 0 else 1
    return Topology(zones=1, nodes_per_zone=1, gpus_per_node=num_devices, experts_per_node=slots)


def profile_step(train_step, state, batch, hlo_text: str) -> tuple:
    """One warm step under CUPTI: `(state, kernel breakdown)`.

    The longest fusion kernels name the source lines they run (`sources`, from the compiled
    step's optimized HLO `hlo_text`). The breakdown says why when it is skipped (no GPU, no
    CUPTI) or failed; the state is then not to be used again (the step may have consumed it).
    """
    kind = jax.devices()[0].platform
    if kind != "gpu":
        print(f"  --profile skipped: CUPTI kernel times need a GPU, this is {kind}", flush=True)
        return train_step(state, batch)[0], {"skipped": f"CUPTI kernel times need a GPU; the platform is {kind}"}
    try:
        (state, _), kernels = _timing.cupti_kernels(lambda: train_step(state, batch))
    except Exception as exc:  # the timed steps stand without their breakdown
        traceback.print_exc()
        return state, {"error": repr(exc)[:2000]}
    if not kernels:
        return state, {"skipped": "CUPTI reported no kernels (see the message above)"}
    result = _profile.breakdown(kernels, top=60)
    result["top_kernels"] = _hlo_sources.attribute(result["top_kernels"], hlo_text)
    print(_profile.format_breakdown(result), flush=True)
    return state, result


PROFILE_COMMAND_BUFFERS = "--xla_enable_command_buffers_during_profiling=true"


def time_when_ready(tree) -> Callable[[], float]:
    """Waits for `tree` in a thread of its own, so the caller keeps dispatching meanwhile (the wait,
    `jax.block_until_ready`, releases the GIL).

    Args:
      tree: a pytree of jax arrays, e.g. a step's metrics still being computed.

    Returns:
      A function that joins the thread and gives when `tree` was ready, in `time.perf_counter()`
      seconds (float).

    Raises:
      Through the returned function: whatever the wait raised (a failed step's error).
    """
    ready: list = []

    def wait():
        try:
            jax.block_until_ready(tree)
            ready.append(time.perf_counter())
        except Exception as exc:  # handed to the caller by the join
            ready.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()

    def join() -> float:
        waiter.join()
        if isinstance(ready[0], Exception):
            raise ready[0]
        return ready[0]

    return join


IDLE_STEPS = 3


def idle_step(train_step, state, batches: list) -> tuple:
    """`IDLE_STEPS` warm steps dispatched back to back under the profiler's trace: `(state, where the device sat idle)`.

    The trace's timeline, unlike CUPTI's durations, has each kernel's start: the gaps between
    kernels and what runs after each are the device's idle time (`_profile.idle_between_kernels`),
    inside the steps and between them, where the next step's first kernel waits on its
    dispatch (`steps_traced`; `span_ms` covers all of them). `main` compiles with
    `PROFILE_COMMAND_BUFFERS` under `--profile`, so the traced steps keep their CUDA graphs
    (`command_buffers_under_trace` records it). Says why when skipped (no GPU timeline) or
    failed, as `profile_step` does; after a failure the state returned is the last one the steps
    wrote, which may be unusable (a failed step's donated input).
    """
    latest = [state]  # each step donates the one before it

    def steps():
        for i in range(IDLE_STEPS):
            latest.append(train_step(latest[-1], batches[i % len(batches)])[0])
        return latest[-1]

    try:
        _, activities = _timing.traced_device_activities(steps)
        if not activities:
            return latest[-1], {"skipped": "the profiler trace has no GPU timeline"}
        result = {"steps_traced": IDLE_STEPS, **_profile.idle_between_kernels(activities)}
        print(f"{IDLE_STEPS} steps back to back:", _profile.format_idle(result), flush=True)
    except Exception as exc:  # the timed steps stand without it
        traceback.print_exc()
        return latest[-1], {"error": repr(exc)[:2000]}
    result["command_buffers_under_trace"] = xla_options.flag_in_effect(PROFILE_COMMAND_BUFFERS)  # set before the backends started
    return latest[-1], result


def run(config: TrainConfig, num_devices: int, per_device_batch: int, steps: int, warmup: int, num_batches: int, profile: bool) -> dict:
    """Trains `warmup` + `steps` steps on the first `num_devices` devices; returns the measurements.

    Raises:
      StepOutOfMemory: the device ran out of memory once the state was built (placing the
        batches, compiling, stepping).
    """
    topology = topology_for(num_devices, config.topology.experts_per_node)
    batch_size = per_device_batch * num_devices
    config = dataclasses.replace(config, topology=topology, data=dataclasses.replace(config.data, batch_size=batch_size))
    cache_before = collections.Counter(CACHE_EVENTS)
    t_setup = time.perf_counter()
    training, state = setup_training(config, devices=jax.devices()[:num_devices])
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t_setup
    mesh, placement, train_step, workload, setup = training.mesh, training.placement, training.train_step, training.workload, training.state
    device_mem = memory_before_step(training)
    build = training.dataset.train_batch

    host = [build(range(i * batch_size, (i + 1) * batch_size)) for i in range(num_batches)]
    flops, examples, tokens = [], [], []
    for b in host:
        real = np.asarray(b.weights) > 0
        lengths = np.diff(np.asarray(b.history.offsets))[real]
        flops.append(workload.total(lengths))
        examples.append(int(real.sum()))
        tokens.append(int(lengths.sum()))
    try:
        batches = [placement.put(b) for b in host]
        local_capacities = sorted({int(b.history.values.shape[1]) for b in batches})
        rows = [int(np.prod(b.history.values.shape[:2])) for b in batches]  # token rows over all devices
        slack = [1.0 - t / r for t, r in zip(tokens, rows)]

        t_first = time.perf_counter()
        lowered = train_step.lower(state, batches[0])  # trace + lower (Python; Mosaic GPU kernels lower here)
        lower_end = time.perf_counter()
        compiled = lowered.compile()  # XLA compile, or a load from the persistent cache
        compile_end = time.perf_counter()
        memory = compiled_memory(compiled)
        print(f"  compiled step memory (bytes per device): {memory}", flush=True)
        state, metrics = train_step(state, batches[0])  # same program: cached trace, cached executable
        jax.block_until_ready(state)
        first_step_end = time.perf_counter()
        process_age = process_age_s()
        for i in range(1, max(warmup, num_batches)):  # every batch once: each capacity compiles before the timing
            state, metrics = train_step(state, batches[i % num_batches])
        jax.block_until_ready(state)
        warmup_s = time.perf_counter() - t_first
        check_lookup_stats(jax.device_get(metrics), setup.plan.tables, where="warm-up")

        times, losses = [], []
        for i in range(steps):
            batch = batches[i % num_batches]
            t0 = time.perf_counter()
            state, metrics = train_step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
        fetched = jax.device_get(metrics)
        check_lookup_stats(fetched, setup.plan.tables, where="timed steps")
        # The same steps dispatched back to back with one block at the end, as gem-train runs a log window:
        # the host launches step i + 1 while the device runs step i, so no step waits on its own dispatch.
        # A thread notes when step 0's metrics are ready: the steps after it are the steady pace.
        t0, dispatch = time.perf_counter(), []
        for i in range(steps):
            t_call = time.perf_counter()
            state, metrics = train_step(state, batches[i % num_batches])
            dispatch.append(time.perf_counter() - t_call)
            if i == 0:
                first_done = time_when_ready(metrics)
        jax.block_until_ready(state)
        end = time.perf_counter()
        pipelined = (end - t0) / steps
        steady = (end - first_done()) / (steps - 1) if steps > 1 else None
        check_lookup_stats(jax.device_get(metrics), setup.plan.tables, where="pipelined steps")
        breakdown = None
        if profile:
            state, breakdown = profile_step(train_step, state, batches[steps % num_batches], compiled.as_text())
            if jax.devices()[0].platform == "gpu" and "error" not in breakdown:  # after an error the state may be gone
                state, breakdown["idle"] = idle_step(train_step, state, batches)
    except jax.errors.JaxRuntimeError as error:
        if not is_out_of_memory(error):
            raise
        raise StepOutOfMemory(per_device_batch, str(error), device_mem) from error
    order = [i % num_batches for i in range(steps)]
    step_flops = float(np.mean([flops[i] for i in order]))
    step_examples = float(np.mean([examples[i] for i in order]))
    median = float(np.median(times))
    peak = flops_lib.peak_flops(mesh.devices.flat[0])
    result = {
        "num_devices": num_devices,
        "topology": dataclasses.asdict(topology),
        "mesh_shape": dict(mesh.shape),
        "per_device_batch": per_device_batch,
        "global_batch": batch_size,
        "mean_tokens_per_step": float(np.mean(tokens)),
        "local_capacities": local_capacities,
        "slack_fraction_mean": float(np.mean(slack)),
        "slack_fraction_max": float(np.max(slack)),
        "init_s": init_s,
        "first_step_s": first_step_end - t_first,
        # where the first step's time goes: tracing and lowering, the XLA compile (or cache load),
        # then the first call (what runs once per process: kernel loading, autotuning leftovers).
        "first_step_parts_s": {"lower": lower_end - t_first, "compile": compile_end - lower_end, "first_call": first_step_end - compile_end},
        "compile_s": first_step_end - t_first - median,
        "setup_to_first_step_s": first_step_end - t_setup,
        "process_age_at_first_step_s": process_age,
        "compile_and_warmup_s": warmup_s,
        "compile_cache": {k: CACHE_EVENTS[k] - cache_before[k] for k in ("cache_hits", "cache_misses")},
        "step_times_s": times,
        "median_step_s": median,
        "examples_per_s": step_examples / median,
        "history_tokens_per_s": float(np.mean([tokens[i] for i in order])) / median,
        "model_tflops_per_step": step_flops / 1e12,
        "tflops_per_s_per_device": step_flops / median / num_devices / 1e12,
        "mfu_per_device": (step_flops / median / num_devices / peak) if peak else None,
        "pipelined_step_s": pipelined,
        "pipelined_dispatch_s": float(np.median(dispatch)),
        "pipelined_dispatch_min_s": float(np.min(dispatch)),
        "pipelined_steady_step_s": steady,
        "pipelined_mfu_per_device": (step_flops / pipelined / num_devices / peak) if peak else None,
        "loss_first_last": [losses[0], losses[-1]],
        "overflow": {k: int(v) for k, v in fetched.items() if k.endswith("/overflow")},
        "tables": {k: p.generation.name for k, p in setup.plan.tables.items()},
    }
    stats = mesh.devices.flat[0].memory_stats() or {}
    result["peak_bytes_in_use_device0"] = stats.get("peak_bytes_in_use")
    result["compiled_memory_bytes"] = memory
    result["device_memory_bytes"] = dataclasses.asdict(device_mem)
    result["remat_plan"] = remat_plan.record(training.remat_plan)
    if profile:
        result["profile"] = breakdown
    del state, batches, train_step
    gc.collect()
    return result


def compiled_memory(compiled) -> dict[str, int] | None:
    """XLA's buffer assignment of the compiled step, per device: arguments, outputs, aliased, temporaries.

    `temp` is what the step allocates beyond its inputs and outputs (activations kept for
    the backward, workspace); `peak_estimate = argument + output - alias + temp`. None where
    the backend gives no analysis.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    sizes = {
        name: int(getattr(analysis, f"{name}_size_in_bytes"))
        for name in ("argument", "output", "alias", "temp", "generated_code")
    }
    sizes["peak_estimate"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    return sizes


def run_fitting_batch(config: TrainConfig, num_devices: int, args) -> dict:
    """`run` at `--per-device-batch`; with `--fit-batch`, a try that runs out of device memory is
    followed by one at the batch `failed_try` derives, up to `MAX_TRIES` tries in all.

    Returns:
      the run's measurements, with `failed_tries` (`failed_try` records, [] when the first try ran).

    Raises:
      BatchFitError: every try ran out of memory, or no next batch could be derived.
    """
    batch, failed = args.per_device_batch, []
    tries = MAX_TRIES if args.fit_batch else 1
    while True:
        try:
            result = run(config, num_devices, batch, args.steps, args.warmup, args.num_batches, args.profile)
        except StepOutOfMemory as oom:
            failed.append(failed_try(oom, num_devices, config.data))
        else:
            result["failed_tries"] = failed
            return result
        gc.collect()  # the failed try's arrays, held by the error's traceback until now
        batch = failed[-1]["derived_per_device_batch"]
        if batch is None or len(failed) == tries:
            raise BatchFitError(failed)
        print(f"  out of device memory at a per-device batch of {failed[-1]['per_device_batch']}: trying {batch}", flush=True)


def run_mode(base: TrainConfig, mode: str, args) -> dict:
    """Every device count of one `--attention` mode: `{attention, attention_implementation, model, runs, errors}`.

    A failed or non-finite implementation is recorded under `errors` (with its runs and, when
    it ran out of device memory, its `failed_tries`) and the mode's next implementation is tried.
    """
    section = {"attention": mode, "attention_implementation": None, "model": None, "runs": [], "errors": []}
    for impl in MODES[mode]:
        norms = Implementation.XLA if impl in WITH_FLAX_NORMS else base.model.norm_implementation
        config = dataclasses.replace(base, model=dataclasses.replace(base.model, attention_implementation=impl, norm_implementation=norms))
        section.update(attention_implementation=impl or "auto (pallas on Hopper)", model=config_tree.to_tree(config.model), runs=[])
        try:
            for n in args.devices:
                print(f"--- {n} device(s), attention {mode} ({impl or 'auto'})", flush=True)
                result = run_fitting_batch(config, n, args)
                print(json.dumps({k: v for k, v in result.items() if k not in ("step_times_s", "profile")}), flush=True)
                section["runs"].append(result)
                if not all(np.isfinite(result["loss_first_last"])):
                    raise FloatingPointError(f"non-finite loss on {n} device(s): {result['loss_first_last']}")
            break
        except Exception as exc:  # a kernel that does not compile or run: try the next implementation
            failed = exc.failed_tries if isinstance(exc, BatchFitError) else []
            section["errors"].append({"attention_implementation": impl, "error": repr(exc)[:2000], "runs": section["runs"], "failed_tries": failed})
            section["runs"] = []
            traceback.print_exc()
            gc.collect()
    return section


def by_device_count(ours: list[dict], peer: list[dict], ratio: Callable[[dict, dict], float | None]) -> dict[str, float | None]:
    """`{num_devices: ratio(our run, the peer's run)}` for the device counts both ran."""
    peer_by_n = {r["num_devices"]: r for r in peer}
    return {str(r["num_devices"]): ratio(r, peer_by_n[r["num_devices"]]) for r in ours if r["num_devices"] in peer_by_n}


def speedups(ours: list[dict], peer: list[dict], key: str = "median_step_s") -> dict[str, float | None]:
    """`{num_devices: peer step / our step}` of the step time `key`; None where the two ran different batches."""
    return by_device_count(ours, peer, lambda o, p: p[key] / o[key] if o["global_batch"] == p["global_batch"] else None)


def throughput_ratios(ours: list[dict], peer: list[dict]) -> dict[str, float]:
    """`{num_devices: our examples/s / the peer's}`, each at the batch it ran."""
    return by_device_count(ours, peer, lambda o, p: o["examples_per_s"] / p["examples_per_s"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "gem_sharded.py"))
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--per-device-batch", type=int, default=1024, help="examples per device (with --fit-batch, the first try's)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="override the config's history bound")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1, and at least one per built batch; the first one compiles)")
    parser.add_argument("--num-batches", type=int, default=4)
    parser.add_argument(
        "--attention", choices=list(MODES), nargs="+", default=["auto"],
        help="modes run in this order; the first is reported at the top level, the rest under 'peers' "
        "(auto: pallas on Hopper, falls back to xla if it fails; padded: cuDNN softmax + jnp GELU attention)",
    )
    parser.add_argument("--profile", action="store_true", help="CUPTI kernel breakdown of one warm step per run (GPU only)")
    parser.add_argument(
        "--fit-batch", action="store_true",
        help="a mode whose step runs out of device memory at --per-device-batch runs again at the largest batch that "
        f"should fit, derived from the bytes XLA's message says it asked ({MAX_TRIES} tries at most, each a compile); "
        "the JSON records each run's batch, the failed tries and examples_per_s_vs_padded_peer",
    )
    parser.add_argument(
        "--compile-cache", default=None, metavar="DIR|off",
        help=f"jax's persistent compilation cache (default: ${compile_cache.ENV_VAR}, else off)",
    )
    parser.add_argument(
        "--set", dest="overrides", nargs="+", action="extend", default=[], metavar="PATH=VALUE",
        help="config overrides, as gem-train's --set (e.g. model.fp8=True model.fp8_block=128)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.num_batches < 1:
        parser.error(f"--steps, --warmup and --num-batches must be >= 1, got {args.steps}, {args.warmup}, {args.num_batches}")
    if len(set(args.attention)) != len(args.attention):
        parser.error(f"--attention names a mode twice: {args.attention}")

    claim_device_memory()  # gem-train's share of a GPU (90%) unless the environment gives one; before any device use
    xla_options.add_project_flags()  # gem-train's XLA flags unless the environment gives them; before any device use
    if args.profile:
        # The idle measurement's step runs under the profiler's trace, where XLA runs every CUDA graph's kernels one
        # launch at a time unless told otherwise: with this flag the traced step launches as the timed ones do. It
        # changes no executable outside a trace (only the compile cache key); a value the environment gives stays.
        xla_options.add_project_flags(flags=(PROFILE_COMMAND_BUFFERS,))
    cache = compile_cache.enable(compile_cache.cache_dir(None, args.compile_cache or os.environ.get(compile_cache.ENV_VAR) or compile_cache.OFF))
    jax.monitoring.register_event_listener(_count_cache_event)
    base = config_tree.apply_overrides(load_config(args.config), args.overrides)
    if args.max_seq_len is not None:
        base = dataclasses.replace(base, data=dataclasses.replace(base.data, max_seq_len=args.max_seq_len))
    version = code_version()
    record = {
        "benchmark": "train_scaling",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": os.environ.get("GEM_GIT_COMMIT") or version["commit"],  # $GEM_GIT_COMMIT names a copied tree run elsewhere
        "jax_version": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "num_visible_devices": jax.device_count(),
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "environment": {k: os.environ[k] for k in (*MEMORY_FRACTION_VARIABLES, "NCCL_NVLS_ENABLE") if k in os.environ},
        "compile_cache_dir": str(cache) if cache else None,
        "config": args.config,
        "per_device_batch": args.per_device_batch,
        "fit_batch": args.fit_batch,
        "max_seq_len": base.data.max_seq_len,
        "overrides": args.overrides,
        "synthetic": dataclasses.asdict(base.data.synthetic),
        "steps": args.steps,
        "warmup": args.warmup,
        "profile": args.profile,
        "notes": "peak_bytes_in_use_device0 is the process's peak so far: a later mode's includes the earlier ones'.",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ours, *others = args.attention
    record.update(run_mode(base, ours, args))
    runs = record["runs"]
    if runs:
        record["time_to_first_step_s"] = runs[0]["process_age_at_first_step_s"]
    add_scaling(record)
    record["peers"] = {}
    out.write_text(json.dumps(record, indent=2))  # kept if a peer is cut short
    for mode in others:
        record["peers"][mode] = run_mode(base, mode, args)
        if mode == PEER and ours != PEER:
            peer_runs = record["peers"][PEER]["runs"]
            record["speedup_vs_padded_peer"] = speedups(runs, peer_runs)
            record["speedup_vs_padded_peer_pipelined"] = speedups(runs, peer_runs, "pipelined_step_s")
            record["examples_per_s_vs_padded_peer"] = throughput_ratios(runs, peer_runs)
            for r in runs:
                for key in ("speedup_vs_padded_peer", "speedup_vs_padded_peer_pipelined", "examples_per_s_vs_padded_peer"):
                    r[key] = record[key].get(str(r["num_devices"]))
        out.write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k not in ("runs", "model", "synthetic", "peers")}, indent=2))
    if not runs:
        sys.exit(1)


def add_scaling(record: dict) -> None:
    """Local MFU (1 device), scaling ratio and E2E MFU (N devices) of the top-level runs; the ratio and
    E2E MFU are None where `--fit-batch` ran N devices at another per-device batch than one device."""
    by_n = {r["num_devices"]: r for r in record["runs"]}
    if 1 in by_n:
        one = by_n[1]
        record["local_mfu"] = one["mfu_per_device"]
        record["local_mfu_pipelined"] = one["pipelined_mfu_per_device"]
        for n, r in by_n.items():
            if n > 1:
                same_batch = r["per_device_batch"] == one["per_device_batch"]
                ratio = r["examples_per_s"] / (n * one["examples_per_s"]) if same_batch else None
                record[f"scaling_ratio_{n}"] = ratio
                if one["mfu_per_device"] is not None:
                    record[f"e2e_mfu_{n}"] = None if ratio is None else one["mfu_per_device"] * ratio


if __name__ == "__main__":
    main()
