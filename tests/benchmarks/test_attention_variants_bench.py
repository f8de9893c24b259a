"""benchmarks/attention_variants_bench.py's `--only`: with `--only block_local` only the block-local checks
run and only block_local_pallas and full_jfa_pallas are timed, forward+backward and forward alone; without it,
everything, forward+backward only. The checks and layers
are replaced by cheap stand-ins that record their names; the selection and the report are the script's own."""

import json
import sys

import numpy as np
import pytest

EVERY_CHECK = ["block_local_rope", "block_local_rope_positions", "block_local_plain", "window_causal_w100",
               "window_two_sided_70_5", "window_causal_w1", "causal_silu_gdpa", "block_einsum_peer"]


@pytest.mark.parametrize("only", ["block_local", None])
def test_only_selects_the_checks_and_timed_layers(load_benchmark, repo_root, monkeypatch, tmp_path, only):
    monkeypatch.syspath_prepend(str(repo_root))
    bench = load_benchmark("attention_variants_bench")
    checked = []

    def fake_check(name, kernel_fn, reference_fn, q, k, v, dout, end):
        checked.append(name)
        return {"ok": True, **{t: {"rel_err": 0.0, "finite": True, "slack_zero": True} for t in ("out", "dq", "dk", "dv")}}

    real_layers = bench.layers
    monkeypatch.setattr(bench, "check", fake_check)
    monkeypatch.setattr(bench, "layers", lambda *a: {name: ((lambda q, k, v: q * k * v), work)
                                                     for name, (_, work) in real_layers(*a).items()})
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["attention_variants_bench.py", "--cpu-smoke", "--out", str(out),
                                      *(["--only", only] if only else [])])
    bench.main()
    report = json.loads(out.read_text())
    timed = {name for name, r in report["timing"].items() if "tflops" in r}
    assert report["only"] == only
    if only == "block_local":
        assert checked == ["block_local_rope", "block_local_rope_positions", "block_local_plain"]
        assert timed == set(report["timing"]) == {"block_local_pallas", "full_jfa_pallas"}
        assert set(report["ratios"]) == {"block_local_pallas/full_jfa_pallas"}
        assert np.isfinite(report["ratios"]["block_local_pallas/full_jfa_pallas"]["time_speedup"])
        for r in report["timing"].values():
            # forward_ms and kernels_us are CUPTI's (None on the CPU, as device_ms), beside the fwd+bwd device_ms.
            assert "device_ms" in r and "forward_ms" in r and "kernels_us" in r and r["forward_wall_ms"] > 0
        assert report["timing"]["block_local_pallas"]["forward_gb_per_s"] > 0
    else:
        assert checked == EVERY_CHECK
        assert timed == {"block_local_pallas", "block_local_xla", "window_pallas", "full_jfa_pallas",
                         "causal_silu_pallas"}  # window_cudnn: skipped on the CPU
        assert not any("forward_ms" in r or "kernels_us" in r for r in report["timing"].values())
    assert set(report["correctness"]) == set(checked)
    meta = report["timing_meta"]
    least = 11 * meta["tokens"] * meta["heads"] * meta["dim"] * 2  # bf16: q, k, v, out forward; q, k, v, dout, dq, dk, dv backward
    assert report["timing"]["block_local_pallas"]["least_hbm_bytes"] == least
    assert report["timing"]["block_local_pallas"]["gb_per_s"] > 0 and "gb_per_s" not in report["timing"]["full_jfa_pallas"]
