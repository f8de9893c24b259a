"""What the model keeps for its backward: the saved residuals of a config's model, bytes per history token.

Traces `jax.vjp` of the model's loss on an abstract batch of `--tokens` history rows (shapes
only: nothing runs, so GEM-width models list in seconds on a CPU) and lists every residual
grouped by the line that made it, with bytes per history token and its leading axis
(history rows T, examples B, or neither); `--fp8-saved-activations` lists the model with `ModelConfig.fp8_saved_activations`
next to it. `--attention pallas` traces the Pallas kernels' own custom VJPs (JFA saves
q, k, v, out and the log-sum-exp), in Mosaic GPU interpret mode when no GPU is present.

These are the residuals of the traced program, before XLA: XLA fuses elementwise
producers into their backward consumers and keeps fewer buffers (compare the compiled
temp size with `--compile` on the GPU, or the step's peak with benchmarks/train_bench.py).

    PYTHONPATH=. python3 benchmarks/saved_residuals.py --config configs/gem_h200.py \
        --tokens 8192 --batch 64 --dtype bfloat16 --attention pallas --fp8-saved-activations
    # on the H200, with the compiled program's memory (temp bytes) of the model's gradient:
    PYTHONPATH=. python3 benchmarks/saved_residuals.py --config configs/gem_h200.py \
        --tokens 173000 --batch 1024 --attention pallas --fp8-saved-activations --compile --out residuals.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from jax.experimental.pallas import mosaic_gpu as plgpu

from gem_jax.batch import Batch, CategoricalFeature, FeatureSpec, HistoryField, Pooling
from gem_jax.jagged import Jagged
from gem_jax.model.config import ModelConfig
from gem_jax.model.gem import GEMModel
from gem_jax.model.loss import weighted_bce
from gem_jax.train import config_tree
from gem_jax.train.config import load_config


def abstract_inputs(model: ModelConfig, tokens: int, batch: int, max_seq_len: int):
    """`(graphdef, abstract params, abstract batch)`: shapes only; vocabularies are small (tables do not scale with T)."""
    spec = FeatureSpec(
        num_items=1000,
        num_actions=11,
        num_time_buckets=8,
        tasks=("click", "convert"),
        user_features=tuple(CategoricalFeature(name, size) for name, size in (("user", 100), ("age", 4), ("gender", 3), ("occupation", 6))),
        item_features=(CategoricalFeature("genres", 9, 8, Pooling.MULTI_HOT),),
        max_seq_len=max_seq_len,
    )
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: GEMModel(spec, model, rngs=nnx.Rngs(0))))
    s = jax.ShapeDtypeStruct
    history = Jagged(values=s((tokens, len(HistoryField)), jnp.int32), offsets=s((batch + 1,), jnp.int32), max_seq_len=max_seq_len)
    data = Batch(
        history=history,
        user={f.name: s((batch, f.max_values), jnp.int32) for f in spec.user_features},
        candidate_item=s((batch,), jnp.int32),
        candidate_features={f.name: s((batch, f.max_values), jnp.int32) for f in spec.item_features},
        labels=s((batch, spec.num_tasks), jnp.float32),
        weights=s((batch,), jnp.float32),
    )
    return graphdef, params, data


def loss_fn(graphdef):
    def loss(params, batch):
        logits = nnx.merge(graphdef, params)(batch)
        return weighted_bce(logits, batch.labels, batch.weights).sum()

    return loss


def _where(source: str) -> str:
    """`"output of mul from .../gem_jax/nn/layers.py:124:25 (MLP.__call__)"` -> `"mul gem_jax/nn/layers.py:124 (MLP.__call__)"`."""
    m = re.match(r"output of (.*?) from (\S+?):(\d+):\d+ \((.*)\)", source)
    if not m:
        return source
    op, path, line, fn = m.groups()
    short = re.sub(r"^.*?/(gem_jax|pallas_kernels|flax|jax)/", r"\1/", path)
    return f"{op} {short}:{line} ({fn})"


def list_residuals(model: ModelConfig, tokens: int, batch: int, max_seq_len: int) -> list[dict]:
    """Every saved residual but the arguments, grouped by (source, dtype, shape): count and bytes per history token.

    `axis` says what the leading axis is: "T" (history rows), "B" (examples; the jnp
    attention references' padded `[B, N, ...]` buffers among them) or "-" (neither:
    casts of weights, constants).
    """
    graphdef, params, data = abstract_inputs(model, tokens, batch, max_seq_len)
    groups = collections.Counter()
    for aval, source in saved_residuals(loss_fn(graphdef), params, data):
        if "from the argument" not in source:
            axis = {tokens: "T", batch: "B"}.get(aval.shape[0] if aval.ndim else None, "-")
            groups[(axis, _where(source), str(aval.dtype), tuple(aval.shape))] += 1
    rows = [
        {"axis": axis, "source": src, "dtype": dtype, "shape": list(shape), "count": n,
         "bytes_per_token": n * int(np.prod(shape)) * jnp.dtype(dtype).itemsize / tokens}
        for (axis, src, dtype, shape), n in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["bytes_per_token"])


def compiled_temp_bytes(model: ModelConfig, tokens: int, batch: int, max_seq_len: int) -> dict:
    """XLA's memory analysis of the jitted gradient of the model's loss on this backend."""
    graphdef, params, data = abstract_inputs(model, tokens, batch, max_seq_len)
    analysis = jax.jit(jax.grad(loss_fn(graphdef))).lower(params, data).compile().memory_analysis()
    return {k: getattr(analysis, k) for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--tokens", type=int, default=8192, help="history rows T (a multiple of 128, so the kernels pad nothing, that no model dimension equals)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the config's)")
    parser.add_argument("--attention", default=None, help="ModelConfig.attention_implementation (default: the config's)")
    parser.add_argument("--fp8-saved-activations", action="store_true", help="also list the model with fp8_saved_activations")
    parser.add_argument("--compile", action="store_true", help="also compile the gradient and report XLA's memory analysis")
    parser.add_argument("--out", type=Path, default=None, help="JSON output")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    base = dataclasses.replace(
        config.model,
        compute_dtype=args.dtype or config.model.compute_dtype,
        attention_implementation=args.attention or config.model.attention_implementation,
    )
    variants = {"bf16_residuals": base}
    if args.fp8_saved_activations:
        variants["fp8_saved_activations"] = dataclasses.replace(base, fp8_saved_activations=True)
    interpret = base.attention_implementation == "pallas" and jax.devices()[0].platform != "gpu"
    record = {"config": args.config, "tokens": args.tokens, "batch": args.batch, "model": config_tree.to_tree(base), "device": jax.devices()[0].device_kind, "jax": jax.__version__, "variants": {}}
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()) if interpret else contextlib.nullcontext():
        for name, model in variants.items():
            rows = list_residuals(model, args.tokens, args.batch, config.data.max_seq_len)
            totals = {axis: sum(r["bytes_per_token"] for r in rows if r["axis"] == axis) for axis in ("T", "B", "-")}
            entry = {"bytes_per_token_by_leading_axis": totals, "residuals": rows}
            if args.compile:
                entry["compiled"] = compiled_temp_bytes(model, args.tokens, args.batch, config.data.max_seq_len)
            record["variants"][name] = entry
            print(f"\n== {name}: bytes per history token of the traced residuals, by leading axis: "
                  + ", ".join(f"{axis}: {v:,.0f}" for axis, v in totals.items()))
            for r in rows:
                print(f"{r['bytes_per_token']:>11,.1f} B/token {r['axis']} {r['count']:>3} x {r['dtype']:>14} {str(r['shape']):>20}  {r['source']}")
            if args.compile:
                print(f"compiled: {entry['compiled']}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
