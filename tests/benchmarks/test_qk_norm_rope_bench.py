"""benchmarks/qk_norm_rope_bench.py on the CPU, its kernels in the Pallas interpreter: the checks, the timings'
layout and the JSON; a broken bound exits 1 with no timings."""

import json

import pytest


@pytest.fixture
def bench(load_benchmark, repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    return load_benchmark("qk_norm_rope_bench")


def test_interpret_run_checks_times_and_writes_json(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("GEM_GIT_COMMIT", "abc123")
    out = tmp_path / "qk.json"
    argv = ["--interpret", "--tokens", "40", "--heads", "2", "--head-dim", "16", "--iters", "1", "--bound-tokens", "30", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["interpret"] and record["checks_ok"] and record["git_commit"] == "abc123"
    assert record["shapes"]["qkv"] == [40, 96] and record["config"]["positions"] == "arange(T) % 1024"
    # 70 tokens and T - 13 with the default tile, then 70 with each other tile; bounds on 30 random tokens.
    checks = [(c["tokens"], c["tile"], c["bound_tokens"]) for c in record["checks"]]
    assert checks == [(70, [16, 4], 30), (27, [16, 4], 27), (70, [32, 4], 30), (70, [16, 8], 30)]
    for c in record["checks"]:
        assert c["ok"] and c["nan_confined"]
        assert set(c["errors"]) == {"q", "k", "v", "dq", "dk", "dv", "dq_scale", "dk_scale"}
        assert all(0 <= e["bound_fraction"] <= 1 for e in c["errors"].values())
        assert c["errors"]["v"]["max_abs_err"] == c["errors"]["dv"]["max_abs_err"] == 0  # copies
    # T=40, H=2, D=16, bf16: each of q, k, v 2560 bytes, cos+sin 2560, scales 128, scale partials 3 tiles of 16 rows x 128.
    assert record["bytes_moved"] == {"fwd": 6 * 2560 + 2560 + 128, "fwd_bwd": 6 * 2560 + 2560 + 128 + 8 * 2560 + 2560 + 128 + 384}
    for mode in ("fwd", "fwd_bwd"):
        row = record["timing"][mode]
        assert set(row) == {"pallas", "pallas_32x4", "pallas_16x8", "xla", "xla_over_pallas"}
        assert row["pallas_32x4"]["wall_ms"] > 0 and row["pallas_16x8"]["wall_ms"] > 0
        assert row["pallas"]["wall_ms"] > 0 and row["xla"]["wall_ms"] > 0 and row["pallas"]["device_ms"] is None  # no CUPTI
        assert row["xla_over_pallas"] == {"wall_ms": pytest.approx(row["xla"]["wall_ms"] / row["pallas"]["wall_ms"])}
        assert row["xla"]["wall_gb_per_s"] == pytest.approx(record["bytes_moved"][mode] / row["xla"]["wall_ms"] / 1e6)


def test_without_a_gpu_only_the_tail_case_is_checked(bench, tmp_path, capsys):
    out = tmp_path / "qk.json"
    assert bench.main(["--heads", "1", "--head-dim", "16", "--out", str(out)]) == 0
    assert "no GPU here (cpu)" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert [c["tokens"] for c in record["checks"]] == [70] and record["checks_ok"]
    assert "timing" not in record and record["gpu"] is None


def test_a_broken_bound_exits_1_without_timings(bench, tmp_path, monkeypatch):
    real = bench.bound_fractions
    monkeypatch.setattr(bench, "bound_fractions", lambda *a, **kw: {**real(*a, **kw), "dk": (0.5, 1.01)})
    out = tmp_path / "qk.json"
    assert bench.main(["--interpret", "--tokens", "33", "--heads", "1", "--head-dim", "16", "--tiles", "", "--out", str(out)]) == 1
    record = json.loads(out.read_text())
    assert not record["checks_ok"] and [c["ok"] for c in record["checks"]] == [False, False]
    assert record["checks"][0]["errors"]["dk"] == {"max_abs_err": 0.5, "bound_fraction": 1.01}
    assert "timing" not in record and "bytes_moved" not in record
