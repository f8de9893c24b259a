"""The work lists' integer helpers (`pallas_kernels/_src/work_list.py`) and the lists they build, in
both forms: all pairs in one fusion (while their work fits `OPS_LIMIT`) and the scan and sort forms past it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._src import work_list
from pallas_kernels.gdpa import schedule as gdpa_schedule
from pallas_kernels.jagged_flash_attention import schedule as jfa_schedule


@pytest.fixture(params=["pairs", "scans"])
def form(request, monkeypatch):
    if request.param == "scans":
        monkeypatch.setattr(work_list, "OPS_LIMIT", 0)
    return request.param


@pytest.mark.parametrize("n", [1, 7, 300])
def test_running_total_is_cumsum(form, n):
    x = np.random.default_rng().integers(0, 50, size=n)
    np.testing.assert_array_equal(work_list.running_total(jnp.asarray(x, jnp.int32)), np.cumsum(x))


@pytest.mark.parametrize("m", [1, 64, 501])
def test_counts_at_or_below_matches_searchsorted(form, m):
    values = np.sort(np.random.default_rng().integers(-3, m + 5, size=40))
    got = work_list.counts_at_or_below(jnp.asarray(values, jnp.int32), m)
    np.testing.assert_array_equal(got, np.searchsorted(values, np.arange(m), side="right"))


@pytest.mark.parametrize("n, top", [(1, 3), (50, 3), (777, 1000)])
def test_heaviest_first_is_a_stable_descending_sort(form, n, top):
    """Many ties (top = 3) and few (top = 1000), empty items (-1) among them; records of two columns."""
    rng = np.random.default_rng()
    work = rng.integers(-1, top + 1, size=n)
    records = np.stack([np.arange(n), rng.integers(0, 9, size=n)], axis=1)
    got = work_list.heaviest_first(jnp.asarray(records, jnp.int32), jnp.asarray(work, jnp.int32))
    np.testing.assert_array_equal(got, records[np.argsort(-work, kind="stable")])


@pytest.mark.parametrize("n, sorts", [(2189, False), (2190, True)])
def test_ops_limit_picks_the_form_by_static_size(n, sorts):
    """Up to 2189 items (2189^2 pairs x 7 operations <= 2^25) the sort is one compare-and-sum; past that,
    XLA's sort. Read from the lowered program, so it is the form that runs."""
    hlo = jax.jit(work_list.heaviest_first).lower(jnp.zeros((n, 3), jnp.int32), jnp.zeros((n,), jnp.int32)).as_text()
    assert ("stablehlo.sort" in hlo) == sorts


def _gdpa_reference(row_lens, col_lens, row_delta, col_delta, *, out_rows, heads, rows_per_tile, tiles_per_item,
                    block_cols, max_col_steps, num_ctas, causal):
    """`gdpa.schedule.build`'s `sched`, item by item in numpy (the module docstring's statement of the list)."""
    per_head = gdpa_schedule.items_per_head_bound(out_rows, len(row_lens) - 1, rows_per_tile * tiles_per_item)
    items = []
    for b, (n, d) in enumerate(zip(row_lens, row_delta)):
        tiles = -(-(n + d) // rows_per_tile) if n else 0
        col_steps = min(-(-(col_lens[b] + col_delta[b]) // block_cols) if col_lens[b] else 0, max_col_steps)
        for t0 in range(0, tiles, tiles_per_item):
            t1 = min(t0 + tiles_per_item, tiles)
            if causal is None:
                work = (t1 - t0) * (col_steps + 1)
            else:
                work = sum(int(gdpa_schedule.causal_col_steps(causal, t, col_steps, rows_per_tile, block_cols)) + 1
                           for t in range(t0, t1))
            items.append((b, t0, t1, work))
    assert len(items) <= per_head
    items += [(len(row_lens) - 1, 0, 0, -1)] * (per_head - len(items))  # the empty items
    records = [(b, h, t0, t1, work) for b, t0, t1, work in items for h in range(heads)]
    order = np.argsort([-r[4] for r in records], kind="stable")
    slots = -(-len(records) // num_ctas)
    sched = np.zeros((num_ctas, slots, 4), np.int32)
    for rnd in range(slots):
        for c in range(num_ctas):
            p = rnd * num_ctas + c
            if p < len(records):
                sched[c if rnd % 2 == 0 else num_ctas - 1 - c, rnd] = records[order[p]][:4]
    return sched


@pytest.mark.parametrize("causal", [None, gdpa_schedule.Causal.KEYS_UP_TO_ROW, gdpa_schedule.Causal.QUERIES_FROM_ROW])
@pytest.mark.parametrize("heads, num_ctas", [(1, 1), (2, 3), (4, 7)])
@pytest.mark.parametrize("block_cols, max_col_steps", [(64, 6), (8, 200)])
def test_gdpa_work_list_matches_its_statement(form, causal, heads, num_ctas, block_cols, max_col_steps):
    """Fresh random lengths (empty sequences and long ones among them), deltas and slack rows. 8-column
    steps give items of up to 2 x 126 steps: the order stays exact past 128 work values."""
    rng = np.random.default_rng()
    batch = 9
    row_lens = rng.choice([0, 1, 5, 64, 127, 128, 129, 300, 700], size=batch)
    row_lens[0] = 700  # with 8-column steps, items of more than 128 work values
    col_lens = row_lens if causal else rng.choice([0, 1, 40, 200, 1000], size=batch)
    if not causal:
        col_lens[0] = 1000
    row_delta = rng.integers(0, 8, size=batch + 1)
    col_delta = row_delta if causal else rng.integers(0, 8, size=batch + 1)
    out_rows = int(row_lens.sum()) + int(rng.integers(0, 150))
    row_lens = np.append(row_lens, out_rows - row_lens.sum())  # the slack pseudo-sequence
    col_lens = np.append(col_lens, 0)
    geometry = dict(out_rows=out_rows, heads=heads, rows_per_tile=64, tiles_per_item=2, block_cols=block_cols,
                    max_col_steps=max_col_steps, num_ctas=num_ctas, causal=causal)
    plan = gdpa_schedule.build(
        *(jnp.asarray(x, jnp.int32) for x in (row_lens, col_lens, row_delta, col_delta)),
        jnp.zeros((batch + 1, 1), jnp.int32), **geometry,
    )
    np.testing.assert_array_equal(plan.sched, _gdpa_reference(row_lens, col_lens, row_delta, col_delta, **geometry))


@pytest.mark.parametrize("causal", [False, True])
def test_jfa_work_list_is_the_same_in_both_forms(monkeypatch, causal):
    lengths = np.random.default_rng().choice([0, 1, 7, 128, 129, 300, 1000], size=23)
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    capacity = int(lengths.sum()) + 77
    pairs = jfa_schedule.build_plan(offsets, capacity, causal=causal)
    monkeypatch.setattr(work_list, "OPS_LIMIT", 0)
    scans = jfa_schedule.build_plan(offsets, capacity, causal=causal)
    for a, b in zip(pairs, scans):
        np.testing.assert_array_equal(a, b)
