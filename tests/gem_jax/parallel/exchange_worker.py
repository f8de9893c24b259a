"""Embedding-exchange and FP8-on-shard checks, run in a subprocess with 8 fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python exchange_worker.py MODE OUT.json

MODE:
  exchange  sharded lookups (gen 1/2/3) on meshes (2,2,2) and (1,2,4): slack rows and
            padding ids never sent, no overflow at capacity factor 1 when the real ids
            fit, bounded rounds equal to the worst-case exchange.

Writes a JSON report to OUT.json; `test_parallel_exchange.py` asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
jax.config.update("jax_default_matmul_precision", "highest")

from gem_jax.mesh import Topology, live_axes, make_mesh  # noqa: E402
from gem_jax.nn import shard_context as context  # noqa: E402
from gem_jax.nn.embeddings import Generation, OutOfRange, TableSharding, exchange_buffer, lookup, place_table  # noqa: E402
from gem_jax.parallel.rules import spec_from_axes  # noqa: E402

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
        bounded, worst = placements[k], placements[k + 1]
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


def exchange(out: Path) -> None:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    out.write_text(json.dumps({name: check_mesh(make_mesh(topology), rng) for name, topology in MESHES.items()}, indent=1))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "exchange":
        exchange(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
