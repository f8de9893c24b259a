"""What a causal GDPA forward's work list asks of the GPU, read from the list alone (no GPU).

For each causal SiLU case of `hstu_bench.py` (H = 4, D = 128, bf16; 132 persistent CTAs, the SM
count of an H100 SXM and an H200) and each tiling of `gdpa_bench.FORWARD_VARIANTS` that changes
only the list (row tiles a work item, `group_sequences`), the list is built as the forward
builds it (`config.choose`'s tiling for the causal forward with the overrides, then
`schedule.build`) and read:

  round r      the items `sched[:, r]`, the r-th item of every CTA (CTAs drift apart in time,
               so a round is only roughly what runs at once)
  working set  per round, the K and V bytes of every (sequence, head) that an item of the round
               streams, up to the last key its last row tile sees: `2 * D * itemsize` a key
  balance      each CTA's work, the list's own estimate (a row tile costs its column steps + 1),
               as max / mean over the CTAs: the last CTA finishes that much after the average

A working set above the L2 (50 MB on both cards) streams keys from HBM more than once; a
balance of 1.5 leaves a third of the GPU idle at the end. `benchmarks/gdpa.md` ("Why ours loses
more on the H100") has the numbers and the predictions made from them.

    PYTHONPATH=. python3 benchmarks/gdpa_schedule_stats.py --out stats.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: `benchmarks` and `pallas_kernels` from this tree
    sys.path.insert(0, str(REPO))

from benchmarks import gdpa_bench, hstu_bench  # noqa: E402
from pallas_kernels.gdpa import config, schedule  # noqa: E402

NUM_CTAS = 132
ITEMSIZE = 2  # bf16
LIST_FIELDS = ("row_tiles_per_item", "group_sequences")  # the tiling fields that change only the work list


def list_variants() -> dict:
    """The `gdpa_bench.FORWARD_VARIANTS` that change only the work list (the default first)."""
    return {name: over for name, over in gdpa_bench.FORWARD_VARIANTS.items() if set(over) <= set(LIST_FIELDS)}


def list_stats(lengths, cfg: config.TileConfig, *, heads: int, dim: int, itemsize: int = ITEMSIZE) -> dict:
    """Rounds, per-round K/V working set (MB) and CTA work balance of the causal forward's list.

    lengths: int `[B]`, the sequences packed back to back from row 0 (as hstu_bench lays them out);
    cfg: the forward's tiling (`cfg.num_ctas` CTAs).
    """
    lengths = np.asarray(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    delta = (starts % config.ALIGN).astype(np.int32)
    rows = jnp.asarray(np.append(lengths, 0), jnp.int32)  # the slack pseudo-sequence: no rows here
    deltas = jnp.asarray(np.append(delta, 0), jnp.int32)
    plan = schedule.build(
        rows, rows, deltas, deltas, jnp.zeros((len(lengths) + 1, 1), jnp.int32),
        out_rows=int(lengths.sum()), heads=heads, rows_per_tile=cfg.rows_per_tile, tiles_per_item=cfg.row_tiles_per_item,
        block_cols=cfg.block_cols, max_col_steps=cfg.max_col_tiles, num_ctas=cfg.num_ctas,
        causal=schedule.Causal.KEYS_UP_TO_ROW, group_sequences=cfg.group_sequences,
    )
    sched = np.asarray(plan.sched)  # [C, S, 4]: sequence, head, t0, t1
    b, h, t0, t1 = (sched[..., k] for k in range(4))
    live = t1 > t0
    lens, dlt = np.append(lengths, 0)[b], np.append(delta, 0)[b]
    r = cfg.rows_per_tile
    # Working set: per round, each (sequence, head)'s keys up to the most any of the round's items sees.
    keys = np.where(live, np.minimum(t1 * r - dlt, lens), 0)
    n_pairs = (len(lengths) + 1) * heads
    most = np.zeros((sched.shape[1], n_pairs), np.int64)
    np.maximum.at(most, (np.broadcast_to(np.arange(sched.shape[1]), b.shape), b * heads + h), keys)
    ws = most.sum(axis=1)[live.any(axis=0)] * 2 * dim * itemsize / 1e6  # MB a round with work
    # Work: the list's own estimate, a row tile's visited column steps + 1 (`schedule.causal_col_steps`).
    col_steps = np.asarray(schedule.steps(jnp.asarray(lens), jnp.asarray(dlt), cfg.block_cols))
    work = np.zeros(cfg.num_ctas)
    for k in range(cfg.row_tiles_per_item):
        t = t0 + k
        visited = np.asarray(schedule.causal_col_steps(schedule.Causal.KEYS_UP_TO_ROW, jnp.asarray(t), jnp.asarray(col_steps),
                                                       r, cfg.block_cols))
        work += np.where(live & (t < t1), visited + 1, 0).sum(axis=1)
    return {
        "rounds": len(ws),
        "working_set_mb": {"median": float(np.median(ws)), "p90": float(np.percentile(ws, 90)), "max": float(ws.max())},
        "cta_work_max_over_mean": float(work.max() / work.mean()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    heads, dim = hstu_bench.HEADS, hstu_bench.DIM
    report = {"benchmark": "gdpa_schedule_stats", "date": datetime.date.today().isoformat(), "num_ctas": NUM_CTAS,
              "heads": heads, "dim": dim, "itemsize": ITEMSIZE, "cases": {}}
    for name, case in hstu_bench.CASES.items():
        lengths = hstu_bench.draw_lengths(case)
        n = int(case["high"])
        chosen = config.choose(max_rows=n, max_cols=n, head_dim=dim, itemsize=ITEMSIZE, n_row_inputs=1, n_col_inputs=2,
                               num_ctas=NUM_CTAS, causal_forward_rows=hstu_bench.capacity_of(lengths) * heads)
        report["cases"][name] = rows = {}
        for variant, overrides in list_variants().items():
            cfg = dataclasses.replace(chosen, **overrides)
            rows[variant] = s = {"tiling": dataclasses.asdict(cfg), **list_stats(lengths, cfg, heads=heads, dim=dim)}
            w = s["working_set_mb"]
            print(f"{name:12s} {variant:15s} rounds {s['rounds']:4d}  K/V working set per round (MB) median {w['median']:6.1f}"
                  f" p90 {w['p90']:6.1f} max {w['max']:6.1f}  CTA work max/mean {s['cta_work_max_over_mean']:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
