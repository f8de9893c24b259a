"""Memory of one sharded table's embedding exchange, from the lowered program on fake CPU devices.

The lookup of one device's expected history rows (`B/D x` the data set's mean history
length, packed into the token capacity the batch placement picks) is lowered with its
gradient, under `shard_map` on the config's topology (as many fake CPU devices as it
has GPUs). Reported, per device:

- `collectives`: every collective of the lowered HLO with its result type and bytes
  (before the CPU compiler widens bf16 collectives to float32, as a GPU would not);
  `largest_exchange_bytes` is the largest buffer of the exchange itself (every
  collective but the replica sync over zones), forward or backward;
  `largest_collective_bytes` the largest of any collective (for gen 2 / 3 tables on
  several zones, the backward's all-gather of touched-row gradients over zones);
- each as a ratio to `rows_bytes`, the bytes of the rows actually looked up (the real
  rows, in the exchange dtype).

Target of the exchange (`configs/gem_sharded.py`): `largest_exchange_bytes` at most 2x
`rows_bytes`.

    PYTHONPATH=. python3 benchmarks/exchange_memory.py --config configs/gem_sharded.py \
        --table embed/item --out benchmarks/results/exchange_memory_gem_sharded.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math


def expected_history_rows(config) -> tuple[int, int]:
    """`(real rows, token capacity)` of one device's history at the data set's mean length."""
    from gem_jax.data.pipeline import load_dataset
    from gem_jax.jagged import pick_capacity

    buckets = load_dataset(config.data).token_buckets
    per_device = config.data.batch_size // config.topology.num_devices
    real = math.ceil(per_device * buckets.mean_length)
    return real, pick_capacity(real, buckets.capacities(per_device))


def measure(config, table: str, real: int, capacity: int) -> dict:
    """The exchange memory of a lookup of `capacity` ids per device, `real` of them real (the rest slack)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from benchmarks._lowered import collectives
    from gem_jax.mesh import live_axes, make_mesh
    from gem_jax.model.gem import GEMModel
    from gem_jax.data.sources.synthetic import synthetic_spec
    from gem_jax import shard_context as context
    from gem_jax.nn.embeddings import describe_exchange, lookup
    from gem_jax.nn.layers import EmbeddingTable
    from gem_jax.parallel.rules import plan_sharding, spec_from_axes
    from gem_jax.train.run_record import code_version

    data = config.data
    spec = synthetic_spec(data.synthetic, data.max_seq_len, data.num_time_buckets)
    mesh = make_mesh(config.topology)
    sizes = dict(mesh.shape)
    abstract = nnx.eval_shape(lambda: GEMModel(spec, config.model, rngs=nnx.Rngs(0)))
    placement = plan_sharding(abstract, sizes, config.rules).tables[table]
    module = next(node for _, node in nnx.iter_graph(abstract) if isinstance(node, EmbeddingTable) and node.path == table)
    dim = config.model.embed_dim
    dtype = jnp.dtype(jnp.float32 if module.exchange_dtype is None else module.exchange_dtype)  # what the model sends
    axes = live_axes(sizes)
    devices = mesh.devices.size

    def body(shard, ids, mask):
        with context.shard_context(sizes):
            rows = lookup(shard, ids[0], placement.num_rows, placement, mask=mask[0], exchange_dtype=dtype)
        return jax.lax.psum(jnp.sum(rows.astype(jnp.float32)), axes)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec_from_axes(placement.row_axes, 2), P(axes), P(axes)), out_specs=P())
    args = (
        jax.ShapeDtypeStruct((placement.padded_rows, dim), jnp.float32, sharding=NamedSharding(mesh, spec_from_axes(placement.row_axes, 2))),
        jax.ShapeDtypeStruct((devices, capacity), jnp.int32, sharding=NamedSharding(mesh, P(axes))),
        jax.ShapeDtypeStruct((devices, capacity), jnp.bool_, sharding=NamedSharding(mesh, P(axes))),
    )
    # The program's own collectives: the CPU compiler would widen bf16 collectives to float32.
    found = collectives(jax.jit(jax.value_and_grad(mapped)).lower(*args).as_text(dialect="hlo"))
    rows_bytes = real * dim * dtype.itemsize
    exchange = max((c["bytes"] for c in found if tuple(c["axes"]) != placement.sync_axes), default=0)
    largest = max((c["bytes"] for c in found), default=0)
    return {
        "benchmark": "exchange_memory",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": code_version()["commit"],
        "jax_version": jax.__version__,
        "table": table,
        "generation": placement.generation.name,
        "capacity_factor": placement.capacity_factor,
        "devices": devices,
        "ids_per_device": capacity,
        "real_rows_per_device": real,
        "dim": dim,
        "exchange_dtype": dtype.name,
        "description": describe_exchange(placement, capacity, dim, dtype),
        "rows_bytes": rows_bytes,
        "largest_exchange_bytes": exchange,
        "largest_exchange_ratio": exchange / rows_bytes,
        "largest_collective_bytes": largest,
        "largest_collective_ratio": largest / rows_bytes,
        "collectives": found,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gem_sharded.py")
    parser.add_argument("--table", default="embed/item")
    parser.add_argument("--set", nargs="*", action="extend", default=[], dest="overrides", help="config overrides, as gem-train --set")
    parser.add_argument("--out", help="JSON report path (default: stdout only)")
    args = parser.parse_args(argv)
    from benchmarks._lowered import restart_with_fake_devices
    from gem_jax.train import config_tree
    from gem_jax.train.config import load_config

    config = config_tree.apply_overrides(load_config(args.config), args.overrides)
    restart_with_fake_devices(config.topology.num_devices)
    real, capacity = expected_history_rows(config)
    report = measure(config, args.table, real, capacity)
    summary = {k: v for k, v in report.items() if k != "collectives"}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
