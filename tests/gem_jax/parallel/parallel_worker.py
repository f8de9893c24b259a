"""Multi-device checks, run in a subprocess with fake CPU devices (the test process has one device).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python parallel_worker.py MODE OUT.json

MODE:
  equivalence  sharded lookup (gen 1/2/3, with and without buffer overflow), the
               expert layer, and the whole model's forward, loss and gradients on
               meshes (2,2,2) and (1,2,4), against single-device references.
  reshard      a checkpoint written on 8 devices restored onto 4 (with the tables' row-wise
               Adagrad accumulators' shardings on both), and a state of bfloat16 weights alike.
  process      one of two `jax.distributed` processes (GEM_* env): train, save, restore.
  loop         `train_and_evaluate` of one uneven epoch and an uneven eval set, alone or as one
               of two processes (GEM_* env), recording the examples this process built; of the
               synthetic source, or of a converted event log (`Source.EVENTS`) given as the
               argument after the workdir.

Writes a JSON report to OUT.json; the pytest files assert on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ.get("GEM_TEST_JAX_CACHE", "/tmp/gem-jax-test-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from gem_jax.train.config import load_config  # noqa: E402
from gem_jax.data.pipeline import load_dataset  # noqa: E402
from gem_jax.data.sources.synthetic import TRAIN_STREAM, SyntheticBatchBuilder, synthetic_spec  # noqa: E402
from gem_jax.jagged import Jagged  # noqa: E402
from gem_jax.model.cross_tower import MLPExperts  # noqa: E402
from gem_jax.model.gem import GEMModel  # noqa: E402
from gem_jax import shard_context as context  # noqa: E402
from gem_jax.parallel.placement import BatchPlacement  # noqa: E402
from gem_jax.nn.embeddings import Generation, OutOfRange, TableSharding, lookup, place_table  # noqa: E402
from gem_jax.mesh import Topology, make_mesh  # noqa: E402
from gem_jax.pytree import path_keys, path_str  # noqa: E402
from gem_jax.parallel.rules import HSDP_RULES, ShardingRules, plan_sharding, spec_from_axes  # noqa: E402
from gem_jax.parallel.spmd import gather_param, live_axes, param_roles  # noqa: E402
from gem_jax.train import metrics  # noqa: E402
from gem_jax.train.optimizer import make_optimizer  # noqa: E402
from gem_jax.train.state import create_train_state, state_setup  # noqa: E402
from gem_jax.train.step import make_train_step  # noqa: E402

P = jax.sharding.PartitionSpec
TINY = REPO / "configs" / "gem_sharded_tiny.py"
MESHES = {"2x2x2": Topology(2, 2, 2, experts_per_node=2), "1x2x4": Topology(1, 2, 4, experts_per_node=2)}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def tree_rel_err(got, want) -> float:
    return max(jax.tree.leaves(jax.tree.map(rel_err, got, want)))


def worst_leaf(got, want) -> str:
    errs = jax.tree_util.tree_leaves_with_path(jax.tree.map(rel_err, got, want))
    path, err = max(errs, key=lambda kv: kv[1])
    return f"{jax.tree_util.keystr(path)}: {err:.2e}"


# ---------------------------------------------------------------- lookup


LOOKUP_CASES = [(g, f) for g in (Generation.GLOBAL, Generation.GROUP, Generation.NODE_SPLIT) for f in (None, 0.5)]


def check_lookups(mesh, rng) -> list[dict]:
    """Sharded lookups of skewed ids (with out-of-range ones, ZERO policy) vs `table[ids]`: rows and
    table gradients, for every generation with worst-case and with overflowing buffers (one program)."""
    sizes = dict(mesh.shape)
    num_rows, dim, per_device, devices = 60, 4, 24, mesh.devices.size
    axes = live_axes(sizes)
    placements = [place_table(f"t{k}", num_rows, 64, TableSharding(g, OutOfRange.ZERO, f), sizes) for k, (g, f) in enumerate(LOOKUP_CASES)]
    tables = [rng.normal(size=(64, dim)).astype(np.float32) for _ in LOOKUP_CASES]
    ids = np.where(
        rng.random((len(LOOKUP_CASES), devices, per_device)) < 0.5,
        rng.integers(0, 8, (len(LOOKUP_CASES), devices, per_device)),
        rng.integers(0, num_rows, (len(LOOKUP_CASES), devices, per_device)),
    )
    ids[:, 0, :3] = [num_rows, -5, 10**6]  # out of range: zero rows, no gradient
    ids[:, 1, :] = 3  # every id of one device to one owner: overflows a balanced buffer
    weights = rng.normal(size=(len(LOOKUP_CASES), devices, per_device, dim)).astype(np.float32)
    table_specs = [spec_from_axes(p.row_axes, 2) for p in placements]

    def body(tables, i, w):
        with context.shard_context(sizes) as ctx:
            rows = [lookup(t, i[k, 0], num_rows, p) for k, (t, p) in enumerate(zip(tables, placements))]
        loss = jax.lax.psum(sum(jnp.sum(r * w[k, 0]) for k, r in enumerate(rows)), axes)
        stats = {k: jax.lax.psum(v, axes) for k, v in ctx.stats.items()}
        return loss, jnp.stack(rows)[:, None], stats

    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(table_specs, P(None, axes), P(None, axes)), out_specs=(P(), P(None, axes), P())
    )
    (_, (rows, stats)), grads = jax.jit(
        jax.value_and_grad(lambda t: (lambda loss, r, s: (loss, (r, s)))(*sharded(t, ids, weights)), has_aux=True)
    )(tables)
    report = []
    for k, ((generation, factor), placement) in enumerate(zip(LOOKUP_CASES, placements)):
        valid = (ids[k] >= 0) & (ids[k] < num_rows)
        want_rows = np.where(valid[..., None], tables[k][np.where(valid, ids[k], 0)], 0.0)
        want_grad = np.zeros_like(tables[k])
        np.add.at(want_grad, ids[k][valid], weights[k][valid])
        report.append(
            {
                "generation": generation.name,
                "effective": placement.generation.name,
                "capacity_factor": factor,
                "rows_err": rel_err(rows[k], want_rows),
                "grad_err": rel_err(grads[k], want_grad),
                "overflow": int(stats[f"t{k}/overflow"]),
                "out_of_range": int(stats[f"t{k}/out_of_range"]),
                "finite": bool(np.isfinite(np.asarray(rows[k])).all()),
            }
        )
    return report


# ---------------------------------------------------------------- expert layer


def check_experts(mesh, rng) -> dict:
    """The DHEN MLP expert group spread over the expert axis vs on one device: output and parameter gradients."""
    sizes = dict(mesh.shape)
    width, hidden, per_device = 16, 32, 3
    with nnx.use_eager_sharding(False):
        module = MLPExperts(4, width, hidden, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
        abstract = nnx.eval_shape(lambda: MLPExperts(4, width, hidden, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(module)
    params = nnx.to_pure_dict(state)
    plan = plan_sharding(abstract, sizes, HSDP_RULES)
    roles = param_roles(plan)
    axes = live_axes(sizes)
    x = rng.normal(size=(mesh.devices.size, per_device, width)).astype(np.float32)
    w = rng.normal(size=x.shape).astype(np.float32)

    def body(p, x, w):
        full = jax.tree.map(
            lambda a, s, n, r: gather_param(a, s, n, r, sizes, None), p, plan.specs, plan.logical, roles,
            is_leaf=lambda v: isinstance(v, P) or not isinstance(v, dict),
        )
        with context.shard_context(sizes):
            y = nnx.merge(graphdef, full)(x[0])
        return jax.lax.psum(jnp.sum(y * w[0]), axes), y[None]

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(plan.specs, P(axes), P(axes)), out_specs=(P(), P(axes)))
    (loss, y), grads = jax.jit(jax.value_and_grad(lambda p: sharded(p, x, w), has_aux=True))(params)

    def reference(p):
        y = nnx.merge(graphdef, p)(x.reshape(-1, width))
        return jnp.sum(y * w.reshape(-1, width)), y

    (want_loss, want_y), want_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    local = jax.tree.map(lambda g: g.addressable_shards[0].data.shape, grads)
    return {
        # sum(y * w) of zero-mean terms cancels: measure its error against the sum of |terms|.
        "loss_err": float(abs(loss - want_loss) / np.abs(np.asarray(want_y) * w.reshape(-1, width)).sum()),
        "out_err": rel_err(np.asarray(y).reshape(-1, width), want_y),
        "grad_err": tree_rel_err(grads, want_grads),
        "local_experts": int(local["up_kernel"][0]),
        "up_kernel_spec": str(plan.specs["up_kernel"]),
    }


# ---------------------------------------------------------------- whole model


def tiny_setup():
    config = load_config(TINY)
    data = config.data
    spec = synthetic_spec(data.synthetic, data.max_seq_len, data.num_time_buckets)
    return config, spec


def global_batch(config, spec, start: int):
    data = config.data
    build = SyntheticBatchBuilder(data.synthetic, spec, data.batch_size, data.seed, TRAIN_STREAM)
    return build(range(start, start + data.batch_size))


def with_empty_and_poisoned(batch, spec):
    """Empties example 5's history; adds 8 slack rows, all slack filled with a valid non-zero id (slack must change nothing)."""
    offsets = np.asarray(batch.history.offsets).copy()
    values = np.asarray(batch.history.values).copy()
    lo, hi = offsets[5], offsets[6]
    values = np.concatenate([values[:lo], values[hi:], np.zeros((hi - lo + 8,) + values.shape[1:], values.dtype)])
    offsets[6:] -= hi - lo
    values[offsets[-1] :] = 7
    return dataclasses.replace(batch, history=Jagged(values, offsets, batch.history.max_seq_len))


CATEGORY = "category"  # the MEAN item feature `with_history_features` adds (3 values, vocabulary 50)


def with_history_features(spec, batch, rng: np.random.Generator):
    """The spec with a multi-valued MEAN item feature added and `history_item_features` on, and the batch
    with the candidates' new feature and every history row's item-feature columns (random ids, some rows
    PAD only); the slack rows' new columns are junk ids outside every vocabulary (never looked up)."""
    from gem_jax.batch import CategoricalFeature

    spec = dataclasses.replace(spec, item_features=spec.item_features + (CategoricalFeature(CATEGORY, 50, 3),), history_item_features=True)
    values = np.asarray(batch.history.values)
    real = int(np.asarray(batch.history.offsets)[-1])
    columns = [values]
    for feature in spec.item_features:
        ids = np.where(rng.random((values.shape[0], feature.max_values)) < 0.6, rng.integers(1, feature.vocab_size, (values.shape[0], feature.max_values)), 0)
        ids[::5] = 0
        ids[real:] = 10**6
        columns.append(ids)
    candidate = np.where(rng.random((batch.batch_size, 3)) < 0.6, rng.integers(1, 25, (batch.batch_size, 3)), 0)  # ids 25-49: history rows only
    batch = dataclasses.replace(
        batch,
        history=batch.history.replace_values(np.concatenate(columns, axis=1).astype(np.int32)),
        candidate_features={**batch.candidate_features, CATEGORY: candidate.astype(np.int32)},
    )
    return spec, batch


def host_params(config, spec):
    """The tiny model's parameters, initialised eagerly on the host (seed 0), and its graphdef."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(GEMModel(spec, config.model, rngs=nnx.Rngs(0)))
    return graphdef, jax.device_get(nnx.to_pure_dict(state))


def reference_model(graphdef, params, batch):
    """Single-device loss, gradients and logits of the plain model on the global batch."""
    b = jax.tree.map(jnp.asarray, batch)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p)(b)
        return metrics.weighted_bce(logits, b.labels, b.weights).sum(), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return float(loss), np.asarray(logits), jax.device_get(grads)


def check_model(mesh, rules: ShardingRules, batch, params, reference, config, spec) -> dict:
    setup = state_setup(lambda rngs: GEMModel(spec, config.model, rngs=rngs), make_optimizer(config.optim), mesh, rules)
    model = setup.sharded_model()
    sharded_params = jax.device_put(params, setup.shardings.params)
    stacked = BatchPlacement(mesh, load_dataset(config.data).token_buckets).put(batch)

    (loss, (_, stats, logits)), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(sharded_params, stacked)
    want_loss, want_logits, want_grads = reference
    return {
        "loss_err": rel_err(loss, want_loss),
        "logits_err": rel_err(logits, want_logits),
        "grad_err": tree_rel_err(jax.device_get(grads), want_grads),
        "worst_grad": worst_leaf(jax.device_get(grads), want_grads),
        "grad_shardings_match": all(jax.tree.leaves(jax.tree.map(lambda g, s: g.sharding.is_equivalent_to(s, g.ndim), grads, setup.shardings.params))),
        "tables": {k: p.generation.name for k, p in setup.plan.tables.items()},
        "overflow": {k: int(v) for k, v in stats.items() if k.endswith("overflow")},
        "out_of_range": sum(int(v) for k, v in stats.items() if k.endswith("out_of_range")),
        "expert_local": int(sharded_params["cross_tower"]["dhen"][0]["mlp_expert"]["up_kernel"].addressable_shards[0].data.shape[0]),
    }


def timed(label, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    print(f"{label}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return out


def equivalence(out: Path) -> None:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    config, spec = tiny_setup()
    # The model check runs with history item features: its category table's history lookups cross the exchange too.
    spec, batch = with_history_features(spec, with_empty_and_poisoned(global_batch(config, spec, 0), spec), rng)
    category = (f"embed/item_features/{CATEGORY}", TableSharding(Generation.GLOBAL, capacity_factor=0.05))
    overflowing = ShardingRules(
        HSDP_RULES.logical,
        # capacity factor 0.05: 1-2 ids per owner per round, so the item and category lookups run several rounds
        tables=(("embed/item", TableSharding(Generation.GLOBAL, capacity_factor=0.05)), ("embed/user/user", TableSharding(Generation.GLOBAL)), category),
        default_table=TableSharding(Generation.REPLICATED),
    )
    plans = {"2x2x2": config.rules, "1x2x4": overflowing}
    graphdef, params = host_params(config, spec)
    reference = timed("reference", reference_model, graphdef, params, batch)
    report = {}
    for name, topology in MESHES.items():
        mesh = make_mesh(topology)
        report[name] = {
            "experts": timed(f"{name} experts", check_experts, mesh, rng),
            "lookup": timed(f"{name} lookups", check_lookups, mesh, rng),
            "model": timed(f"{name} model", check_model, mesh, plans[name], batch, params, reference, config, spec),
        }
    out.write_text(json.dumps(report, indent=1))


def sparse(out: Path) -> None:
    """2 train steps on mesh 2x2x2 with row-wise and with dense table updates (the user table replicated, the others sharded)."""
    from gem_jax.train import sparse_tables
    from gem_jax.train.setup import setup_training

    config, _ = tiny_setup()
    rules = dataclasses.replace(config.rules, tables=config.rules.tables + (("embed/user/user", TableSharding(Generation.REPLICATED, OutOfRange.HASH)),))
    report = {}
    for mode in (True, False):
        optim = dataclasses.replace(config.optim, sparse_embedding_updates=mode)
        training, state = setup_training(dataclasses.replace(config, rules=rules, optim=optim))
        iterator = training.dataset.train_iterator()
        batches = [training.placement.put(next(iterator)) for _ in range(2)]
        model = training.state.sharded_model()
        probe = jax.eval_shape(lambda p, b: model.loss_with_rows(p, b)[1][3], state.params, batches[0])
        norms = []
        for batch in batches:
            state, m = timed(f"sparse={mode} step", training.train_step, state, batch)
            norms.append(float(m["grad_norm"]))
        report[mode] = {
            "state": jax.device_get(state),
            "norms": norms,
            "row_wise": sorted(sparse_tables.row_wise_tables(state.params, probe).values()),
            "tables": {k: p.generation.name for k, p in training.state.plan.tables.items()},
        }
    out.write_text(
        json.dumps(
            {
                "state_err": tree_rel_err(report[True]["state"], report[False]["state"]),
                "worst": worst_leaf(report[True]["state"], report[False]["state"]),
                "norms": [report[True]["norms"], report[False]["norms"]],
                "row_wise": report[True]["row_wise"],
                "tables": report[True]["tables"],
            },
            indent=1,
        )
    )


# ---------------------------------------------------------------- checkpoints


def reshard(out: Path, workdir: Path) -> None:
    """A train state checkpointed on 8 devices (2,2,2), restored onto 4 devices (1,2,2) with target shardings."""
    from gem_jax.train.checkpoint import CheckpointConfig, Checkpointer

    config, spec = tiny_setup()
    optimizer = make_optimizer(config.optim)
    factory = lambda rngs: GEMModel(spec, config.model, rngs=rngs)  # noqa: E731
    big = make_mesh(Topology(2, 2, 2, experts_per_node=2))
    state, _ = create_train_state(factory, optimizer, big, config.rules, 0)
    iterator = load_dataset(config.data).train_iterator()
    next(iterator)
    ckpt = Checkpointer(workdir, CheckpointConfig(every_steps=1, async_save=True))
    ckpt.save(2, state, iterator, force=True)
    ckpt.close()

    small = make_mesh(Topology(1, 2, 2, experts_per_node=2), jax.devices()[:4])
    small_setup = state_setup(factory, optimizer, small, config.rules)  # shapes and target shardings only
    fresh = load_dataset(config.data).train_iterator()
    restored = Checkpointer(workdir, CheckpointConfig()).restore(2, small_setup.abstract, fresh)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), jax.device_get(state), jax.device_get(restored))
    on_small = jax.tree.map(lambda a, s: a.sharding == s, restored, small_setup.shardings)
    item = restored.params["embed"]["item"]["embedding"]
    out.write_text(
        json.dumps(
            {
                "bf16_weights": reshard_bf16_weights(workdir / "bf16_weights", config, spec, big, state, small, iterator),
                "accumulators": {"8 devices": row_accumulators(state), "4 devices": row_accumulators(restored)},
                "equal": all(jax.tree.leaves(same)),
                "target_shardings": all(jax.tree.leaves(on_small)),
                "restored_devices": sorted({d.id for d in item.sharding.device_set}),
                "item_spec": str(item.sharding.spec),
                "iterator_resumed": bool(np.array_equal(np.asarray(next(fresh).candidate_item), np.asarray(next(iterator).candidate_item))),
            }
        )
    )


def reshard_bf16_weights(workdir: Path, config, spec, big, master, small, iterator) -> dict:
    """A state of bfloat16 weight matrices (`OptimConfig.weights_dtype`) checkpointed on `big` and restored onto
    `small`: its dtypes and shardings against the float32 state `master` of the same mesh, and the restore."""
    from gem_jax.train.checkpoint import CheckpointConfig, Checkpointer

    model = dataclasses.replace(config.model, compute_dtype="bfloat16")
    optim = dataclasses.replace(config.optim, weights_dtype="bfloat16")
    optimizer = make_optimizer(optim)
    factory = lambda rngs: GEMModel(spec, model, rngs=rngs)  # noqa: E731
    kwargs = dict(compute_dtype="bfloat16", keep_compute_params=True, weights_dtype="bfloat16")
    state, setup = create_train_state(factory, optimizer, big, config.rules, 0, **kwargs)
    ckpt = Checkpointer(workdir, CheckpointConfig(every_steps=1, async_save=True))
    ckpt.save(2, state, iterator, force=True)
    ckpt.close()
    small_setup = state_setup(factory, optimizer, small, config.rules, **kwargs)
    restored = Checkpointer(workdir, CheckpointConfig()).restore_state(2, small_setup.abstract)
    leaves = lambda tree: {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}  # noqa: E731
    params, masters = leaves(state.params), leaves(master.params)
    narrow = set(setup.narrow_weights)
    return {
        "narrow": len(narrow),
        "sharded_narrow": sum(any(e is not None for e in params[p].sharding.spec) for p in narrow),
        "dtypes": all((x.dtype == jnp.bfloat16) == (p in narrow) for p, x in params.items()),
        "shardings_as_float32": all(x.sharding.is_equivalent_to(masters[p].sharding, x.ndim) for p, x in params.items()),
        "values_as_float32_cast": all(np.array_equal(np.asarray(params[p]), np.asarray(masters[p].astype(jnp.bfloat16))) for p in narrow),
        "expert_biases_float32": sorted(p for p in params if "/mlp_expert/" in p and p.endswith("_bias") and params[p].dtype == jnp.float32),
        "restored_equal": all(jax.tree.leaves(jax.tree.map(lambda a, b: a.dtype == b.dtype and bool(np.array_equal(np.asarray(a), np.asarray(b))),
                                                            jax.device_get(state), jax.device_get(restored)))),
        "restored_target_shardings": all(jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding == s, restored, small_setup.shardings))),
    }


def row_accumulators(state) -> dict:
    """Per embedding table: its spec, its row-wise Adagrad accumulator's spec and shape, and whether
    each device holds the accumulators of exactly the rows of its table shard."""
    accumulators = state.opt_state.inner_states["embedding"].inner_state[0].sum_of_squares
    report = {}
    for path, acc in jax.tree_util.tree_leaves_with_path(accumulators):
        table = state.params
        for key in path_keys(path):
            table = table[key]
        table_rows = table.sharding.addressable_devices_indices_map(table.shape)
        spec = tuple(table.sharding.spec) + (None,) * (table.ndim - len(table.sharding.spec))
        report[path_str(path)] = {
            "table_spec": str(table.sharding.spec),
            "table_row_spec": str(jax.sharding.PartitionSpec(*spec[:-1])),
            "spec": str(acc.sharding.spec),
            "shape": [list(acc.shape), list(table.shape)],
            "dtype": str(acc.dtype),
            "rows_follow_table": all(s.index[0] == table_rows[s.device][0] for s in acc.addressable_shards),
        }
    return report


def barrier(name: str) -> None:
    """Waits for every process at a coordination-service barrier (not a device collective).

    Gloo gives up on a collective after 30 s; on a busy CPU one process can finish
    compiling a train step much later than the other, so both meet here first.
    """
    from jax._src import distributed as jax_distributed

    jax_distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=900_000)


def process(out: Path, workdir: Path) -> None:
    """One of two processes: train 3 steps (checkpoint after 2), restore step 2, replay step 3 bit-exactly; in
    bfloat16 with the state's bfloat16 weights (`TrainState.compute_params`), which the restore rebuilds."""
    from gem_jax.parallel import distributed
    from gem_jax.train.checkpoint import CheckpointConfig, Checkpointer

    layout = distributed.initialize()
    config, spec = tiny_setup()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, compute_dtype="bfloat16"))
    optimizer = make_optimizer(config.optim)
    factory = lambda rngs: GEMModel(spec, config.model, rngs=rngs)  # noqa: E731
    mesh = make_mesh(Topology(1, 2, 2, experts_per_node=2))
    dataset = load_dataset(config.data)
    placement = BatchPlacement(mesh, dataset.token_buckets)
    state, setup = create_train_state(factory, optimizer, mesh, config.rules, 0, compute_dtype="bfloat16", keep_compute_params=True)
    assert state.compute_params, "a bfloat16 state keeps its copy"
    iterator = dataset.train_iterator()
    batch = placement.put(next(iterator))
    step = make_train_step(setup, optimizer, placement).lower(state, batch).compile()  # every batch has this shape
    barrier("compiled")

    losses = []
    for i in range(3):
        if i == 2:
            ckpt = Checkpointer(workdir, CheckpointConfig(every_steps=1))
            ckpt.save(2, state, iterator, force=True)
            ckpt.close()
        state, m = step(state, batch if i == 0 else placement.put(next(iterator)))
        losses.append(float(m["loss"]))

    fresh = load_dataset(config.data).train_iterator()
    restored = Checkpointer(workdir, CheckpointConfig()).restore(2, setup.abstract, fresh)
    _, m = step(restored, placement.put(next(fresh)))
    out.write_text(
        json.dumps(
            {
                "source": layout.source if layout else None,
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
                "devices": jax.device_count(),
                "local_devices": jax.local_device_count(),
                "losses": losses,
                "replay": [float(m["loss"])],
            }
        )
    )


class Recorder:
    """Wraps a batch builder and records the example indices of every call that builds a step's batch
    (not the shape template of the ahead-of-time compile, `gem_jax.train.programs`, which leaves `batch_size` at B)."""

    def __init__(self, build):
        self.build, self.calls = build, []

    def __call__(self, indices, batch_size=None):
        if batch_size is not None:
            self.calls.append(np.asarray(indices, np.int64).tolist())
        return self.build(indices, batch_size=batch_size)


LOOP_OVERRIDES = [  # 4 devices in 1 or 2 processes; 70 = 32 + 32 + 6 train examples, 52 = 32 + 20 eval examples
    "topology.zones=1",
    "data.synthetic.num_train_examples=70",
    "data.synthetic.num_eval_examples=52",
    "data.bbs.minibatch_size=8",
    "loop.num_steps=3",
]


def loop(out: Path, workdir: Path, events: Path | None = None) -> None:
    """`train_and_evaluate` of the tiny sharded config for one epoch (its last batch uneven) and a final eval,
    on the synthetic source or (with `events`, 70 train and 52 eval events) on a converted event log."""
    import dataclasses

    from gem_jax.data.events import DEMOGRAPHICS
    from gem_jax.parallel import distributed
    from gem_jax.train import loop as loop_lib
    from gem_jax.train.config_tree import apply_overrides

    jax.config.update("jax_disable_most_optimizations", True)  # tiny shapes: compile time dominates
    distributed.initialize()
    config = apply_overrides(load_config(TINY), LOOP_OVERRIDES)
    if events is not None:  # the log's user features are its own: no sharding rules for the synthetic demographics
        config = apply_overrides(config, ["data.source=EVENTS", f"data.path={events}"])
        tables = tuple((name, sharding) for name, sharding in config.rules.tables if name.removeprefix("embed/user/") not in DEMOGRAPHICS)
        config = dataclasses.replace(config, rules=dataclasses.replace(config.rules, tables=tables))
    recorders = {}

    def recording_load(data_config):
        dataset = load_dataset(data_config)
        recorders.update(train=Recorder(dataset.train_batch), eval=Recorder(dataset.eval_batch))
        return dataclasses.replace(dataset, train_batch=recorders["train"], eval_batch=recorders["eval"])

    loop_lib.load_dataset = recording_load
    summary = loop_lib.train_and_evaluate(config, workdir, progress=False)
    out.write_text(
        json.dumps(
            {
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
                "train": recorders["train"].calls,
                "eval": recorders["eval"].calls,
                "summary": summary,
            }
        )
    )


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "equivalence":
        equivalence(out)
    elif mode == "sparse":
        sparse(out)
    elif mode == "reshard":
        reshard(out, Path(sys.argv[3]))
    elif mode == "process":
        process(out, Path(sys.argv[3]))
    elif mode == "loop":
        loop(out, Path(sys.argv[3]), *map(Path, sys.argv[4:5]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
