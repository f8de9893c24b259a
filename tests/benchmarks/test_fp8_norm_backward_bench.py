"""benchmarks/fp8_norm_backward_bench.py on the CPU, its kernels in the Pallas interpreter: the checks, the timings'
layout and the JSON; a broken bound exits 1 with no timings."""

import json

import pytest


@pytest.fixture
def bench(load_benchmark, repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    return load_benchmark("fp8_norm_backward_bench")


def test_interpret_run_checks_times_and_writes_json(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("GEM_GIT_COMMIT", "abc123")
    out = tmp_path / "fp8_norm.json"
    argv = ["--interpret", "--rows", "40", "--width", "128", "--out-features", "128", "--iters", "1", "--bound-rows", "30", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["interpret"] and record["checks_ok"] and record["git_commit"] == "abc123" and record["benchmark"] == "fp8_norm_backward"
    assert [(c["rows"], c["ok"], c["nan_confined"]) for c in record["checks"]] == [(70, True, True), (27, True, True)]
    for c in record["checks"]:
        assert set(c["errors"]) == {"dx", "dscale"} and all(0 <= e["bound_fraction"] <= 1 for e in c["errors"].values())
        layer = c["layer"]
        # reported only; on the CPU both programs reduce alike
        assert layer["y_elements_differing"] == layer["dw_elements_differing"] == 0
        assert layer["y_max_diff_of_max"] == layer["dw_max_diff_of_max"] == 0.0
        assert 0 < layer["dx_max_rel_diff"] <= 4 * 2.0**-8 and layer["dscale_rel_diff"] <= 1e-3
    # N=40, d=128, bf16: x, dy, the residual's cotangent and dx 10240 bytes each, the gain 512, 10 programs' partials of 512.
    assert record["bytes_moved"] == {"backward": 4 * 10240 + 512 + 10 * 512, "layer": None}
    for mode in ("backward", "layer_fwd_bwd"):
        row = record["timing"][mode]
        assert set(row) == {"pallas", "xla", "xla_over_pallas"} and row["pallas"]["wall_ms"] > 0 and row["pallas"]["device_ms"] is None
    assert record["timing"]["backward"]["xla"]["wall_gb_per_s"] == pytest.approx(record["bytes_moved"]["backward"] / record["timing"]["backward"]["xla"]["wall_ms"] / 1e6)
    assert record["timing"]["layer_fwd_bwd"]["xla"]["wall_gb_per_s"] is None  # the layer's traffic is not counted


def test_a_broken_bound_exits_1_without_timings(bench, tmp_path, monkeypatch):
    real = bench.bound_fractions
    monkeypatch.setattr(bench, "bound_fractions", lambda *a, **kw: {**real(*a, **kw), "dx": (0.5, 1.01)})
    out = tmp_path / "fp8_norm.json"
    assert bench.main(["--interpret", "--rows", "33", "--width", "128", "--out-features", "128", "--out", str(out)]) == 1
    record = json.loads(out.read_text())
    assert not record["checks_ok"] and "timing" not in record

