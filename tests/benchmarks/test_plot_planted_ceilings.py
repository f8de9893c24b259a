"""benchmarks/plot_planted_ceilings.py: its bars are the records' lift shares and NE above the oracle's."""

import json

import pytest

CEILINGS = "benchmarks/results/planted_ceilings_long_range.json"
RUN = "benchmarks/results/planted_gem_tied_qk_long_range_h200_20261205.json"


def test_bars_are_the_ceilings_shares_and_the_runs_against_the_same_oracle(load_benchmark, repo_root):
    plot = load_benchmark("plot_planted_ceilings")
    ceilings = json.loads((repo_root / CEILINGS).read_text())
    got = {label: (lift, ne) for label, lift, ne in plot.bars(ceilings, {"GEM": json.loads((repo_root / RUN).read_text())})}
    assert len(got) == len(plot.ROWS) + 1
    fitted = got["fit, given the category vectors"]
    assert fitted[0] == pytest.approx(100 * ceilings["lift_share"]["fitted"])
    assert fitted[1] == pytest.approx(100 * (ceilings["ne"]["fitted"] / ceilings["ne"]["oracle"] - 1))
    assert got["GEM"] == pytest.approx((78.2, 5.84), abs=0.05)  # eval AUC 0.7372, NE 0.8701 at step 1800


def test_a_run_of_another_eval_set_is_refused_and_the_figure_is_written(load_benchmark, repo_root, tmp_path):
    plot = load_benchmark("plot_planted_ceilings")
    ceilings = json.loads((repo_root / CEILINGS).read_text())
    run = json.loads((repo_root / RUN).read_text())
    run["planted"]["oracle_report"]["eval_events"] = 1000
    with pytest.raises(ValueError, match="scored on 1000 eval events"):
        plot.bars(ceilings, {"other": run})
    with pytest.raises(ValueError, match="holds no final_eval"):
        plot.bars(ceilings, {"empty": {"final_eval": {}}})
    out = tmp_path / "ceilings.png"
    plot.main([str(repo_root / CEILINGS), f"GEM width={repo_root / RUN}", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
