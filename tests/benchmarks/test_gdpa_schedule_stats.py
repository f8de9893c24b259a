"""benchmarks/gdpa_schedule_stats.py on the CPU: the working set and balance of a work list worked out by hand."""

import dataclasses

import pytest

from pallas_kernels.gdpa import config


@pytest.fixture
def stats(load_benchmark, repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    return load_benchmark("gdpa_schedule_stats")


def _tiling(**overrides):
    base = config.TileConfig(split=config.Split.ROWS, block_cols=128, col_slots=2, row_slots=2, max_col_tiles=8,
                             row_tiles_per_item=1, num_ctas=4)
    return dataclasses.replace(base, **overrides)


def test_one_sequence_two_heads_one_round(stats):
    """256 rows, 2 heads, items of one 128-row tile, 4 CTAs: one round of the 4 items. Each head's keys are
    streamed up to row 256 (tile 1 sees them all): 2 heads x 256 keys x (K and V) x 16 x 2 bytes. Tile 0 costs
    1 column step + 1, tile 1 2 + 1: CTA works 3, 3, 2, 2, max / mean 1.2."""
    s = stats.list_stats([256], _tiling(), heads=2, dim=16)
    assert s["rounds"] == 1
    assert s["working_set_mb"] == {k: pytest.approx(2 * 256 * 2 * 16 * 2 / 1e6) for k in ("median", "p90", "max")}
    assert s["cta_work_max_over_mean"] == pytest.approx(1.2)


def test_grouping_keeps_a_sequence_in_one_round(stats):
    """Three sequences of 256 rows (2 tiles each) and one of 128, one head, 2 CTAs. By the items' own work the
    heavy second tiles of sequences 0-2 are dealt first, so round 0 streams two sequences and round 1 a third
    with another; grouped, round 0 holds both tiles of sequence 0, round 1 both of sequence 1, and so on: one
    sequence's keys a round."""
    lengths = [256, 256, 256, 128]  # packed from row 0: every start a multiple of 8
    by_work = stats.list_stats(lengths, _tiling(num_ctas=2), heads=1, dim=16)
    grouped = stats.list_stats(lengths, _tiling(num_ctas=2, group_sequences=True), heads=1, dim=16)
    one_sequence = 256 * 2 * 16 * 2 / 1e6
    assert grouped["rounds"] == by_work["rounds"] == 4
    assert grouped["working_set_mb"]["max"] == pytest.approx(one_sequence)
    assert by_work["working_set_mb"]["max"] == pytest.approx(2 * one_sequence)


def test_list_variants_are_the_sweeps_list_only_tilings(stats):
    variants = stats.list_variants()
    assert next(iter(variants)) == "default" and variants["default"] == {}
    assert {"items2", "items4", "grouped_items1", "grouped_items2"} <= set(variants)
    assert all(set(v) <= {"row_tiles_per_item", "group_sequences"} for v in variants.values())
