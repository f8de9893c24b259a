"""How the train step's Python lowering time grows with the layer stack (sequence and DHEN layers).

A warm start (persistent compilation cache) still traces and lowers every program in
Python; this measures that cost per layer, to judge whether a scanned layer stack (one
traced layer body for all layers) would pay. For each `(num_seq_layers, num_dhen_layers)`
it builds the job (`setup_training`, no state), then times `jax.jit(train_step).lower`
on abstract arguments at one token capacity (`--repeats` times after clearing jax's caches;
the minimum is kept), in wall and in process CPU seconds (lowering is single-threaded
Python, so its CPU time stays meaningful on a busy machine), and the XLA compile of the
last lowering. A first, discarded lowering of the first configuration warms jax up.

    PYTHONPATH=. python3 benchmarks/lowering_bench.py --config configs/gem_h200_tiny.py --out lowering_cpu.json
    PYTHONPATH=. python3 benchmarks/lowering_bench.py --config configs/gem_h200.py --layers 1,1 2,1 4,1 4,2 --out lowering_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from gem_jax.train import config_tree
from gem_jax.train.config import load_config
from gem_jax.train.programs import planned_capacities
from gem_jax.train.setup import setup_training


def lower_and_compile(config, repeats: int, compile_too: bool) -> dict:
    training, _ = setup_training(config, init_state=False)
    capacity = planned_capacities(training, range(1), evaluates=False)[0][0]
    dataset = training.dataset
    template = dataset.train_batch(range(min(dataset.batch_size, dataset.info.num_train_examples)))
    batch = training.placement.abstract(template, capacity)
    times, cpu = [], []
    for _ in range(repeats):
        jax.clear_caches()
        began, began_cpu = time.perf_counter(), time.process_time()
        lowered = training.train_step.lower(training.state.abstract, batch)
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    if not compile_too:
        return {"lowering_s": min(times), "lowering_cpu_s": min(cpu), "capacity": capacity}
    began, began_cpu = time.perf_counter(), time.process_time()
    lowered.compile()
    return {
        "lowering_s": min(times), "lowering_cpu_s": min(cpu), "compile_s": time.perf_counter() - began,
        "compile_cpu_s": time.process_time() - began_cpu, "capacity": capacity,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", nargs="+", default=["1,1", "2,1", "4,1", "1,2", "1,4"], metavar="SEQ,DHEN")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="time the lowering only")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="PATH=VALUE")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    base = config_tree.apply_overrides(load_config(args.config), args.overrides)
    runs = []
    first = args.layers[0].split(",")
    lower_and_compile(config_tree.apply_overrides(base, [f"model.num_seq_layers={first[0]}", f"model.num_dhen_layers={first[1]}"]), 1, False)
    for layers in args.layers:
        seq, dhen = (int(x) for x in layers.split(","))
        config = config_tree.apply_overrides(base, [f"model.num_seq_layers={seq}", f"model.num_dhen_layers={dhen}"])
        run = {"num_seq_layers": seq, "num_dhen_layers": dhen, **lower_and_compile(config, args.repeats, not args.no_compile)}
        print(json.dumps(run), flush=True)
        runs.append(run)
    record = {"benchmark": "lowering", "config": args.config, "overrides": args.overrides, "device_kind": jax.devices()[0].device_kind, "jax_version": jax.__version__, "runs": runs}
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
