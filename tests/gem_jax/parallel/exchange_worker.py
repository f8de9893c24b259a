"""Embedding-exchange and FP8-on-shard checks, run in a subprocess with 8 fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python exchange_worker.py MODE OUT.json

MODE:
  exchange  sharded lookups (gen 1/2/3) on meshes (2,2,2) and (1,2,4): slack rows and
            padding ids never sent, no overflow at capacity factor 1 when the real ids
            fit, bounded rounds equal to the worst-case exchange.
  fp8       the FP8 model (d = 128) in the sharded step on the same meshes: kernels
            quantized on the shard and gathered in 8 bits (checked in the HLO), against
            the unsharded FP8 model, the float32 model (both), and (on (1,2,4)) the sharded
            step that gathers first; and what E4M3 rounding noise on the FP8 kernels does
            to the float32 step (the scale of the FP8 steps' bounds).

Writes a JSON report to OUT.json; `test_parallel_exchange_ids.py` (exchange) and
`test_parallel_exchange.py` (fp8) assert on it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))
jax.config.update("jax_default_matmul_precision", "highest")
# The test suite's compile settings (tests/conftest.py), which this subprocess does not load: tiny shapes, so
# compile time dominates; the persistent cache is shared with the suite's other processes.
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update("jax_compilation_cache_dir", os.environ.get("GEM_TEST_JAX_CACHE", "/tmp/gem-jax-test-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import dataclasses  # noqa: E402

from flax import nnx  # noqa: E402

from benchmarks._lowered import collectives  # noqa: E402
from gem_jax.data.pipeline import load_dataset  # noqa: E402
from gem_jax.data.sources.synthetic import TRAIN_STREAM, SyntheticBatchBuilder, synthetic_spec  # noqa: E402
from gem_jax.mesh import Topology, live_axes, make_mesh  # noqa: E402
from gem_jax.model.config import Fp8Region  # noqa: E402
from gem_jax.model.gem import GEMModel  # noqa: E402
from gem_jax import shard_context as context  # noqa: E402
from gem_jax.nn.embeddings import Generation, OutOfRange, TableSharding, exchange_buffer, lookup, place_table  # noqa: E402
from gem_jax.parallel.placement import BatchPlacement  # noqa: E402
from gem_jax.parallel.rules import spec_from_axes  # noqa: E402
from gem_jax.parallel.spmd import ShardedModel  # noqa: E402
from gem_jax.pytree import path_keys  # noqa: E402
from gem_jax.quant import Fp8Linear  # noqa: E402
from gem_jax.train import metrics  # noqa: E402
from gem_jax.train.config import load_config  # noqa: E402
from gem_jax.train.optimizer import make_optimizer  # noqa: E402
from gem_jax.train.state import state_setup  # noqa: E402
from tolerances import E4M3  # noqa: E402

P = jax.sharding.PartitionSpec
MESHES = {"2x2x2": Topology(2, 2, 2, experts_per_node=2), "1x2x4": Topology(1, 2, 4, experts_per_node=2)}
GENERATIONS = (Generation.GLOBAL, Generation.GROUP, Generation.NODE_SPLIT)
NUM_ROWS, PADDED, DIM, N = 60, 64, 4, 128  # N ids per device


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def slack_heavy_ids(placement, devices: int, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """Per device: real ids spread over every owner, then `C + 1` padding ids and `C + 1` slack rows.

    The slack rows carry valid non-zero ids of owner 0 (a poisoned slack), so sending
    either the padding ids (whose row owner 0 holds) or the slack would overflow
    owner 0's buffer of `C` ids at capacity factor 1. Returns `(ids, mask, spread)`
    with `spread` real non-padding ids per device.
    """
    owners, capacity = exchange_buffer(placement, N)
    r = placement.rows_per_shard
    spread = N - 2 * (capacity + 1)
    assert spread >= owners, (spread, owners)
    ids = np.empty((devices, N), np.int64)
    for d in range(devices):
        owner = np.arange(spread) % owners
        real = np.minimum(owner * r + rng.integers(1, r, spread), NUM_ROWS - 1)  # never 0, still the owner's
        body = np.concatenate([real, np.zeros(capacity + 1, np.int64)])
        ids[d] = np.concatenate([rng.permutation(body), rng.integers(1, r, capacity + 1)])
    mask = np.arange(N) < N - (capacity + 1)
    return ids, np.broadcast_to(mask, ids.shape).copy(), spread


def skewed_ids(devices: int, rng) -> np.ndarray:
    """Half the ids of every device in rows 0..7 (owner 0 for every mesh here), the rest uniform, some padding."""
    ids = np.where(rng.random((devices, N)) < 0.5, rng.integers(0, 8, (devices, N)), rng.integers(0, NUM_ROWS, (devices, N)))
    ids[1] = 3  # every id of one device to one owner
    return ids


def run_lookups(mesh, placements, tables, ids, masks, weights):
    """`(rows, table gradients, stats)` of one sharded program with a lookup per placement."""
    sizes = dict(mesh.shape)
    axes = live_axes(sizes)

    def body(tables, ids, masks, w):
        with context.shard_context(sizes) as ctx:
            rows = [lookup(t, ids[k, 0], NUM_ROWS, p, mask=masks[k, 0]) for k, (t, p) in enumerate(zip(tables, placements))]
        loss = jax.lax.psum(sum(jnp.sum(r * w[k, 0]) for k, r in enumerate(rows)), axes)
        return loss, jnp.stack(rows)[:, None], {k: jax.lax.psum(v, axes) for k, v in ctx.stats.items()}

    specs = [spec_from_axes(p.row_axes, 2) for p in placements]
    per_device = P(None, axes)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(specs, per_device, per_device, per_device), out_specs=(P(), per_device, P()))
    fn = jax.value_and_grad(lambda t: (lambda loss, r, s: (loss, (r, s)))(*sharded(t, ids, masks, weights)), has_aux=True)
    (_, (rows, stats)), grads = jax.jit(fn)(tables)
    return np.asarray(rows), [np.asarray(g) for g in grads], {k: float(v) for k, v in stats.items()}


def expected(table, ids, mask, weights):
    rows = np.where(mask[..., None], table[ids], 0.0)
    grad = np.zeros_like(table)
    np.add.at(grad, ids[mask], weights[mask])
    return rows, grad


def check_mesh(mesh, rng) -> dict:
    sizes = dict(mesh.shape)
    devices = mesh.devices.size
    report = {"slack": [], "rounds": []}

    # Slack rows and padding ids stay home: capacity factor 1, real ids that fit.
    placements = [place_table(f"t{k}", NUM_ROWS, PADDED, TableSharding(g, OutOfRange.ZERO, 1.0), sizes) for k, g in enumerate(GENERATIONS)]
    cases = [slack_heavy_ids(p, devices, rng) for p in placements]
    ids = np.stack([c[0] for c in cases])
    masks = np.stack([c[1] for c in cases])
    tables = [rng.normal(size=(PADDED, DIM)).astype(np.float32) for _ in placements]
    weights = rng.normal(size=ids.shape + (DIM,)).astype(np.float32)
    rows, grads, stats = run_lookups(mesh, placements, tables, ids, masks, weights)
    for k, (p, (_, _, spread)) in enumerate(zip(placements, cases)):
        want_rows, want_grad = expected(tables[k], ids[k], masks[k], weights[k])
        owners, capacity = exchange_buffer(p, N)
        report["slack"].append(
            {
                "generation": p.generation.name,
                "rows_equal": bool(np.array_equal(rows[k], want_rows)),
                "grad_err": rel_err(grads[k], want_grad),
                "overflow": stats[f"t{k}/overflow"],
                "out_of_range": stats[f"t{k}/out_of_range"],
                "sent_rows": stats[f"t{k}/sent_rows"],
                "real_non_padding_rows": devices * spread,
                "slack_rows": int((~masks[k]).sum()),
                "sent_bytes": stats[f"t{k}/sent_bytes"],
                "one_round_bytes": devices * owners * capacity * (4 + DIM * 4),
            }
        )

    # Bounded rounds equal the worst-case exchange, for skewed ids that overflow.
    cases = [(g, f) for g in GENERATIONS for f in (0.25, None)]
    placements = [place_table(f"t{k}", NUM_ROWS, PADDED, TableSharding(g, OutOfRange.ZERO, f), sizes) for k, (g, f) in enumerate(cases)]
    skewed = [skewed_ids(devices, rng) for _ in GENERATIONS]
    ids = np.stack([skewed[k // 2] for k in range(len(cases))])
    masks = np.ones(ids.shape, bool)
    masks[:, :, -9:] = False  # a few slack rows
    base_tables = [rng.normal(size=(PADDED, DIM)).astype(np.float32) for _ in GENERATIONS]
    tables = [base_tables[k // 2] for k in range(len(cases))]
    base_weights = rng.normal(size=(len(GENERATIONS), devices, N, DIM)).astype(np.float32)
    weights = np.stack([base_weights[k // 2] for k in range(len(cases))])
    rows, grads, stats = run_lookups(mesh, placements, tables, ids, masks, weights)
    for k in range(0, len(cases), 2):
        bounded = placements[k]  # placements[k + 1]: the same table with worst-case buffers
        want_rows, want_grad = expected(tables[k], ids[k], masks[k], weights[k])
        owners, capacity = exchange_buffer(bounded, N)
        sent = masks[k] & (ids[k] != 0)
        counts = np.stack([np.bincount(ids[k][d][sent[d]] // bounded.rows_per_shard, minlength=owners) for d in range(devices)])
        report["rounds"].append(
            {
                "generation": bounded.generation.name,
                "capacity": capacity,
                "rows_equal_worst_case": bool(np.array_equal(rows[k], rows[k + 1])),
                "rows_equal_gather": bool(np.array_equal(rows[k], want_rows)),
                "grad_err_worst_case": rel_err(grads[k], grads[k + 1]),
                "grad_err": rel_err(grads[k], want_grad),
                "overflow": stats[f"t{k}/overflow"],
                "expected_overflow": int(np.maximum(counts - capacity, 0).sum()),
                "worst_case_overflow": stats[f"t{k + 1}/overflow"],
                "sent_rows": stats[f"t{k}/sent_rows"],
                "expected_sent_rows": int(sent.sum()),
                "sent_bytes": stats[f"t{k}/sent_bytes"],
                "expected_sent_bytes": int(-(-counts.max() // capacity)) * devices * owners * capacity * (4 + DIM * 4),
            }
        )
    return report


def timed(label, fn):
    start = time.perf_counter()
    out = fn()
    print(f"{label}: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return out


def tree_rel_err(got, want) -> float:
    """The largest relative error of one leaf."""
    return max(jax.tree.leaves(jax.tree.map(rel_err, got, want)))


def global_rel_err(got, want) -> float:
    """The relative error of the whole tree as one vector."""
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])  # noqa: E731
    return rel_err(flat(got), flat(want))


def step_errors(got, want) -> dict:
    """`{loss, logits, grad, grad_leaf}` relative errors of one step `(loss, logits, grads)` against another."""
    return {
        "loss": rel_err(got[0], want[0]),
        "logits": rel_err(got[1], want[1]),
        "grad": global_rel_err(got[2], want[2]),
        "grad_leaf": tree_rel_err(got[2], want[2]),
    }


def check_fp8(mesh, config, spec, batch, params, graphdef, reference, float32, gathered_first: bool) -> dict:
    """The sharded FP8 step (kernels quantized on the shard) against the unsharded FP8 model (`reference`), the
    float32 model (`float32`) and, if `gathered_first`, the sharded step that gathers every kernel first; the 8-bit
    gathers in its HLO. `reference` and `float32` are `(loss, logits, grads)` on one device."""
    setup = state_setup(lambda rngs: GEMModel(spec, config.model, rngs=rngs), make_optimizer(config.optim), mesh, config.rules)
    sharded_params = jax.device_put(params, setup.shardings.params)
    stacked = BatchPlacement(mesh, load_dataset(config.data).token_buckets).put(batch)

    def run(plan, label):
        lowered = jax.jit(jax.value_and_grad(ShardedModel(setup.graphdef, plan, mesh, setup.compute_dtype).loss, has_aux=True)).lower(
            sharded_params, stacked
        )
        (loss, (_, _, logits)), grads = timed(label, lambda: lowered.compile()(sharded_params, stacked))
        return float(loss), np.asarray(logits), jax.device_get(grads), lowered.as_text(dialect="hlo")

    loss, logits, grads, hlo = run(setup.plan, "fp8 on the shard")
    step = (loss, logits, grads)
    gathers = [c for c in collectives(hlo) if c["op"] == "all-gather"]
    kernels = fp8_kernel_shapes(graphdef, params, setup.plan.fp8)
    shape = lambda t: t.split("[")[1].rstrip("]")  # noqa: E731
    float_shapes = {shape(c["type"]) for c in gathers if c["type"].startswith(("f32", "bf16"))}
    u8_gathers = {(shape(c["type"]), tuple(c["axes"])) for c in gathers if c["type"].startswith("u8")}
    # A float gather of an FP8 kernel's full shape would be its gather-first path, unless another parameter has that shape.
    kernel_keys = {(*name.split("/"), "kernel") for name in kernels}
    other_shapes = {
        ",".join(map(str, leaf.shape))
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if tuple(str(k) for k in path_keys(path)) not in kernel_keys
    }
    unambiguous = {name: v for name, v in kernels.items() if ",".join(map(str, v[0])) not in other_shapes}
    report = {
        "fp8_layers": len(kernels),
        "gathers": {name: {"dim": g.dim, "axes": list(g.axes)} for name, g in setup.plan.fp8.items()},
        "against_unsharded": step_errors(step, reference),
        "against_float32": step_errors(step, float32),
        "kernels_gathered_in_8_bits": sorted(
            name for name, (shape, axes) in kernels.items() if (",".join(map(str, shape)), axes) in u8_gathers
        ),
        "kernels_checked_for_float_gathers": len(unambiguous),
        "kernels_gathered_in_float": sorted(n for n, (s, _) in unambiguous.items() if ",".join(map(str, s)) in float_shapes),
        "u8_all_gathers": len([c for c in gathers if c["type"].startswith("u8")]),
    }
    if gathered_first:
        loss0, logits0, grads0, _ = run(dataclasses.replace(setup.plan, fp8={}), "fp8 gathered first")
        report |= {
            "logits_equal_gathered_first": bool(np.array_equal(logits, logits0)),
            "loss_equal_gathered_first": loss == loss0,
            "grad_err_gathered_first": tree_rel_err(grads, grads0),
        }
    return report


def fp8_kernel_shapes(graphdef, params, gathers) -> dict:
    """`{layer: (kernel shape, 8-bit gather axes)}` of the FP8 layers the plan quantizes on the shard."""
    model = nnx.merge(graphdef, params)
    out = {}
    for path, module in nnx.iter_modules(model):
        name = "/".join(map(str, path))
        if name in gathers:
            out[name] = (list(module.kernel.shape), tuple(gathers[name].axes))
    return out


def fp8_layer_names(graphdef, params) -> set[str]:
    """The `Fp8Linear` layers of the model, as `a/b/c` paths."""
    return {"/".join(map(str, path)) for path, module in nnx.iter_modules(nnx.merge(graphdef, params)) if isinstance(module, Fp8Linear)}


def fp8(out: Path) -> None:
    config = load_config(REPO / "configs" / "gem_sharded_tiny.py")
    # Every region in FP8: the cross tower's kernels are sharded over other axes than the sequence tower's.
    model = dataclasses.replace(config.model, embed_dim=128, fp8=True, fp8_regions=tuple(Fp8Region))
    config = dataclasses.replace(config, model=model)
    data = config.data
    spec = synthetic_spec(data.synthetic, data.max_seq_len, data.num_time_buckets)
    batch = SyntheticBatchBuilder(data.synthetic, spec, data.batch_size, data.seed, TRAIN_STREAM)(range(data.batch_size))
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(GEMModel(spec, config.model, rngs=nnx.Rngs(0)))
        graphdef32 = nnx.graphdef(GEMModel(spec, dataclasses.replace(model, fp8=False), rngs=nnx.Rngs(0)))
    params = jax.device_get(nnx.to_pure_dict(state))
    device_batch = jax.tree.map(jnp.asarray, batch)

    def one_device_step(graphdef):
        """`params -> (loss, logits, grads)` of `graphdef`'s model on the whole batch, on one device."""

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(device_batch)
            return metrics.weighted_bce(logits, device_batch.labels, device_batch.weights).sum(), logits

        step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

        def run(p):
            (loss, logits), grads = step(p)
            return float(loss), np.asarray(logits), jax.device_get(grads)

        return run

    reference = timed("fp8 one device", lambda: one_device_step(graphdef)(params))
    step32 = one_device_step(graphdef32)
    float32 = timed("float32 one device", lambda: step32(params))
    # The float32 step with the FP8 layers' kernels perturbed by the E4M3 rounding noise (relative rms
    # tolerances.E4M3.rms): what one rounded operand per GEMM does to this model's loss, logits and gradients.
    kernels = fp8_layer_names(graphdef, params)
    rng = np.random.default_rng(0)

    def perturb(path, leaf):
        keys = tuple(str(k) for k in path_keys(path))
        if keys[-1] == "kernel" and "/".join(keys[:-1]) in kernels:
            return leaf * (1 + E4M3.rms * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
        return leaf

    noisy = step32(jax.tree_util.tree_map_with_path(perturb, params))
    report = {
        "fp8_layers_perturbed": len(kernels),
        "kernel_rounding_noise": step_errors(noisy, float32),
        "unsharded_against_float32": step_errors(reference, float32),
    }
    # The bit-identity with the gather-first step on (1,2,4) only, where kernels take both paths (8-bit over all or part of their axes).
    for name, t in MESHES.items():
        report[name] = check_fp8(make_mesh(t), config, spec, batch, params, graphdef, reference, float32, name == "1x2x4")
    out.write_text(json.dumps(report, indent=1))


def exchange(out: Path) -> None:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    out.write_text(json.dumps({name: check_mesh(make_mesh(topology), rng) for name, topology in MESHES.items()}, indent=1))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "exchange":
        exchange(out)
    elif mode == "fp8":
        fp8(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
