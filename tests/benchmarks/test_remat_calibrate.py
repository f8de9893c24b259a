"""benchmarks/remat_calibrate.py on synthetic train_bench records whose step times follow the cost model exactly."""

import json


def record(path, step_s, peak, regions=None, estimate=None):
    plan = None if regions is None else {"regions": regions, "recompute_ms": 1.0, "peak_bytes_estimate": estimate}
    path.write_text(json.dumps({"runs": [{"median_step_s": step_s, "peak_bytes_in_use_device0": peak, "remat_plan": plan}]}))
    return str(path)


def test_fits_the_cost_models_rates_and_compares_peaks(repo_root, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks import remat_calibrate

    flops_rate, byte_rate = 5e14, 3e12
    runs = []
    for i, (flops, freed) in enumerate([(1e12, 1e9), (3e12, 2e10), (0.0, 5e9)]):
        regions = [{"recompute_flops": flops / 2, "freed_bytes": freed / 2}] * 2
        added = flops / flops_rate + 2 * freed / byte_rate
        runs.append(record(tmp_path / f"run{i}.json", 0.1 + added, 80e9, regions, estimate=100e9))
    out = tmp_path / "calibration.json"
    remat_calibrate.main([record(tmp_path / "base.json", 0.1, 90e9), *runs, "--out", str(out)])
    result = json.loads(out.read_text())
    assert abs(result["fitted_matmul_flops_per_s"] / flops_rate - 1) < 1e-6
    assert abs(result["fitted_bytes_per_s"] / byte_rate - 1) < 1e-6
    assert [r["peak_over_estimate"] for r in result["runs"]] == [0.8] * 3
