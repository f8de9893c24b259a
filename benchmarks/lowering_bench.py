"""Where a warm start's seconds go before the first step: tracing and lowering by layer count.

jax's persistent compilation cache skips the XLA compile on a warm start, but not the Python
work before it: tracing the model into a jaxpr and lowering it to StableHLO (the Mosaic GPU
kernels lower here too). Both grow with the number of layers the Python code unrolls. This
benchmark builds the trainer's own job (`gem_jax.train.setup.setup_training`, abstract state:
nothing is initialised) at each `(num_seq_layers, num_dhen_layers)` and times, for one train
step program: `trace` (`jit(...).trace`), `lower` (`Traced.lower`) and, for the first setting
only with `--compile`, `compile`. A per-layer cost that dominates the total is what a scanned
layer stack (`nnx.scan`: one layer traced and lowered, whatever the depth) would remove.

    PYTHONPATH=. python3 benchmarks/lowering_bench.py --config configs/gem_h200.py \
        --layers 1,1 2,1 4,1 4,2 --out lowering.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

T_PROCESS = time.perf_counter()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from gem_jax.train import config_tree  # noqa: E402
from gem_jax.train.config import load_config  # noqa: E402
from gem_jax.train.run_record import code_version  # noqa: E402
from gem_jax.train.setup import setup_training  # noqa: E402

IMPORT_S = time.perf_counter() - T_PROCESS


def abstract(tree):
    """ShapeDtypeStructs carrying each array's sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def measure(config, seq_layers: int, dhen_layers: int, compile_too: bool) -> dict:
    config = config_tree.apply_overrides(config, [f"model.num_seq_layers={seq_layers}", f"model.num_dhen_layers={dhen_layers}"])
    t0 = time.perf_counter()
    training, _ = setup_training(config, init_state=False)
    setup_s = time.perf_counter() - t0
    batch_size = training.dataset.batch_size
    host = training.dataset.train_batch(range(batch_size))
    batch = abstract(training.placement.put(host))
    t1 = time.perf_counter()
    traced = training.train_step.trace(training.state.abstract, batch)
    t2 = time.perf_counter()
    lowered = traced.lower()
    t3 = time.perf_counter()
    result = {
        "num_seq_layers": seq_layers,
        "num_dhen_layers": dhen_layers,
        "setup_s": setup_s,
        "trace_s": t2 - t1,
        "lower_s": t3 - t2,
        "capacity": int(np.prod(batch.history.values.shape[:2])),
    }
    if compile_too:
        lowered.compile()
        result["compile_s"] = time.perf_counter() - t3
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gem_h200.py")
    parser.add_argument("--set", nargs="*", action="extend", default=[], dest="overrides")
    parser.add_argument("--layers", nargs="+", default=["1,1", "2,1", "4,1", "4,2"], help="num_seq_layers,num_dhen_layers pairs")
    parser.add_argument("--compile", action="store_true", help="also compile the first setting's program")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = config_tree.apply_overrides(load_config(args.config), args.overrides)
    runs = []
    for i, pair in enumerate(args.layers):
        seq, dhen = (int(v) for v in pair.split(","))
        runs.append(measure(config, seq, dhen, args.compile and i == 0))
    record = {
        "benchmark": "lowering_bench",
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "host": platform.node(),
        "jax": jax.__version__,
        "code": code_version(),
        "config": args.config,
        "overrides": args.overrides,
        "import_s": IMPORT_S,
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
