"""All-gather bytes of the FP8 layers' kernels in the sharded train step: quantized on the shard vs gathered first.

The config's model with `fp8=True` in every `Fp8Region` is lowered (forward and gradient, `ShardedModel.loss`)
on its topology, on as many fake CPU devices as it has GPUs, twice: as the step runs it
(each FP8 kernel quantized on its shard, 8-bit data and scales all-gathered;
`ShardingPlan.fp8`) and with every kernel all-gathered in the compute dtype first
(`fp8={}`, the step before on-shard quantization). Every other collective is the same
in both programs, so the all-gathers only one of them has are the FP8 kernels': per
device, `gathered_first` (bf16 kernels) against `on_shard` (8-bit data and scales, plus
the compute-dtype gathers over the inner axes of kernels whose shards are smaller than
a quantization block). Bytes are those of each all-gather's result.

    PYTHONPATH=. python3 benchmarks/fp8_gather_bytes.py --config configs/gem_sharded.py \
        --out benchmarks/results/fp8_gather_bytes_gem_sharded.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json


def _key(c: dict) -> tuple[str, tuple[str, ...]]:
    return c["type"], tuple(c["axes"])


def measure(config) -> dict:
    """The FP8 kernels' all-gathers of `config`'s sharded step with `model.fp8=True` in every `Fp8Region`, on the shard and gathered first."""
    import jax
    import numpy as np

    from benchmarks._lowered import collectives
    from gem_jax.data.pipeline import load_dataset
    from gem_jax.data.sources.synthetic import TRAIN_STREAM, SyntheticBatchBuilder
    from gem_jax.mesh import make_mesh
    from gem_jax.model.config import Fp8Region
    from gem_jax.model.gem import GEMModel
    from gem_jax.parallel.placement import BatchPlacement, stack_batch
    from gem_jax.parallel.spmd import ShardedModel
    from gem_jax.train.optimizer import make_optimizer
    from gem_jax.train.run_record import code_version
    from gem_jax.train.state import state_setup

    config = dataclasses.replace(config, model=dataclasses.replace(config.model, fp8=True, fp8_regions=tuple(Fp8Region)))
    mesh = make_mesh(config.topology)
    dataset = load_dataset(config.data)
    factory = lambda rngs: GEMModel(dataset.spec, config.model, rngs=rngs)  # noqa: E731
    setup = state_setup(factory, make_optimizer(config.optim), mesh, config.rules, compute_dtype=config.model.compute_dtype)
    sharding = BatchPlacement(mesh, dataset.token_buckets).sharding
    host = SyntheticBatchBuilder(config.data.synthetic, dataset.spec, config.data.batch_size, config.data.seed, TRAIN_STREAM)(
        range(config.data.batch_size)
    )
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding),
        stack_batch(host, mesh.devices.size, dataset.token_buckets),
    )

    def all_gathers(plan) -> list[dict]:
        model = ShardedModel(setup.graphdef, plan, mesh, setup.compute_dtype)
        hlo = jax.jit(jax.value_and_grad(model.loss, has_aux=True)).lower(setup.abstract.params, batch).as_text(dialect="hlo")
        return [c for c in collectives(hlo) if c["op"] == "all-gather"]

    on_shard = all_gathers(setup.plan)
    gathered_first = all_gathers(dataclasses.replace(setup.plan, fp8={}))
    # The all-gathers only one program has (a multiset difference): the FP8 kernels'.
    only_on_shard = collections.Counter(map(_key, on_shard)) - collections.Counter(map(_key, gathered_first))
    only_gathered_first = collections.Counter(map(_key, gathered_first)) - collections.Counter(map(_key, on_shard))
    bytes_of = {_key(c): c["bytes"] for c in on_shard + gathered_first}

    def summary(only: collections.Counter) -> dict:
        groups = collections.defaultdict(lambda: [0, 0])
        for key, count in only.items():
            dtype, axes = key[0].split("[")[0], "/".join(key[1])
            groups[f"{dtype} over {axes}"][0] += count
            groups[f"{dtype} over {axes}"][1] += count * bytes_of[key]
        return {"bytes": sum(count * bytes_of[key] for key, count in only.items()), "by_type": {k: {"count": c, "bytes": b} for k, (c, b) in sorted(groups.items())}}

    first, shard = summary(only_gathered_first), summary(only_on_shard)
    return {
        "benchmark": "fp8_gather_bytes",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": code_version()["commit"],
        "jax_version": jax.__version__,
        "devices": mesh.devices.size,
        "compute_dtype": config.model.compute_dtype,
        "fp8_block": config.model.fp8_block,
        "fp8_layers_on_shard": {name: {"dim": g.dim, "axes": list(g.axes)} for name, g in sorted(setup.plan.fp8.items())},
        "gathered_first": first,
        "on_shard": shard,
        "ratio": shard["bytes"] / first["bytes"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gem_sharded.py")
    parser.add_argument("--out", help="JSON report path (default: stdout only)")
    args = parser.parse_args(argv)
    from benchmarks._lowered import restart_with_fake_devices
    from gem_jax.train.config import load_config

    config = load_config(args.config)
    restart_with_fake_devices(config.topology.num_devices)
    report = measure(config)
    print(json.dumps({k: v for k, v in report.items() if k != "fp8_layers_on_shard"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
