"""benchmarks/plot_gdpa_peers.py: the ratios it draws are the records' peer time over ours, for both benchmarks."""

import json

import pytest

RESULTS = "benchmarks/results/{}_silu_tanh_output_scale_5669e21_20261205.json"


def test_ratios_are_peer_device_time_over_ours(load_benchmark, repo_root):
    plot = load_benchmark("plot_gdpa_peers")
    gdpa = json.loads((repo_root / RESULTS.format("gdpa_h200")).read_text())
    cross = next(case for case in gdpa["cases"] if case["shape"] == "cross")
    got = plot.ratios(gdpa)
    assert set(got) == {"GELU\ncross\nvs cuDNN", "GELU\npooled\nvs cuDNN"}
    assert got["GELU\ncross\nvs cuDNN"] == cross["cudnn_softmax"]["fwd_device_ms"] / cross["pallas"]["fwd_device_ms"]
    assert got["GELU\ncross\nvs cuDNN"] == pytest.approx(1.094, abs=1e-3)
    hstu = plot.ratios(json.loads((repo_root / RESULTS.format("hstu_h200")).read_text()))
    assert set(hstu) == {"causal SiLU\nlong-tailed\nvs HSTU", "causal SiLU\ngem-like\nvs HSTU"}  # "long" was skipped
    assert hstu["causal SiLU\ngem-like\nvs HSTU"] == pytest.approx(1.248, abs=1e-3)


def test_a_record_of_another_benchmark_is_refused_and_the_figure_is_written(load_benchmark, repo_root, tmp_path):
    plot = load_benchmark("plot_gdpa_peers")
    with pytest.raises(ValueError, match="not a gdpa_bench or hstu_bench record"):
        plot.ratios({"benchmark": "jfa_bench", "cases": {}})
    out = tmp_path / "peers.png"
    plot.main([f"H100={repo_root / RESULTS.format('hstu_h100')}", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
