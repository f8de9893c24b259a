"""benchmarks/rms_norm_bench.py on the CPU, its kernels in the Pallas interpreter: the checks, the timings' layout
and the JSON; a broken bound exits 1 with no timings."""

import json
import re

import pytest


@pytest.fixture
def bench(load_benchmark, repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    return load_benchmark("rms_norm_bench")


def test_interpret_run_checks_times_and_writes_json(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("GEM_GIT_COMMIT", "abc123")
    out = tmp_path / "norm.json"
    argv = ["--interpret", "--rows", "40", "--width", "32", "--iters", "1", "--tiles", "8x4", "--bound-rows", "30", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["interpret"] and record["checks_ok"] and record["git_commit"] == "abc123" and record["benchmark"] == "rms_norm"
    assert record["shapes"]["x, y, dx"] == [40, 32]
    # 70 rows with and without the residual, N - 13 likewise, then 70 with each other tile (residual); bounds on 30 rows.
    checks = [(c["rows"], c["tile"], c["residual"], c["bound_rows"]) for c in record["checks"]]
    assert checks == [(70, [4, 4], False, 30), (70, [4, 4], True, 30), (27, [4, 4], False, 27), (27, [4, 4], True, 27), (70, [8, 4], True, 30)]
    for c in record["checks"]:
        assert c["ok"] and c["nan_confined"] and set(c["errors"]) == {"y", "dx", "dscale"}
        assert all(0 <= e["bound_fraction"] <= 1 for e in c["errors"].values())
    # N=40, d=32, bf16: x, y, dx, dy, dx_in 2560 bytes each, the scale 128, 10 programs' scale partials of 128.
    assert record["bytes_moved"] == {"fwd": 2 * 2560 + 128, "fwd_bwd": 5 * 2560 + 2 * 128 + 1280, "fwd_bwd_residual": 6 * 2560 + 2 * 128 + 1280}
    for mode in ("fwd", "fwd_bwd", "fwd_bwd_residual"):
        row = record["timing"][mode]
        assert set(row) == {"pallas", "pallas_8x4", "xla", "xla_over_pallas"}
        assert row["pallas"]["wall_ms"] > 0 and row["xla"]["wall_ms"] > 0 and row["pallas"]["device_ms"] is None  # no CUPTI
        assert row["xla_over_pallas"] == {"wall_ms": pytest.approx(row["xla"]["wall_ms"] / row["pallas"]["wall_ms"])}
        assert row["xla"]["wall_gb_per_s"] == pytest.approx(record["bytes_moved"][mode] / row["xla"]["wall_ms"] / 1e6)


def test_without_a_gpu_only_the_tail_cases_are_checked(bench, tmp_path, capsys):
    out = tmp_path / "norm.json"
    assert bench.main(["--width", "16", "--out", str(out)]) == 0
    assert "no GPU here (cpu)" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert [(c["rows"], c["residual"]) for c in record["checks"]] == [(70, False), (70, True)] and record["checks_ok"]
    assert "timing" not in record and record["gpu"] is None


def test_a_broken_bound_exits_1_without_timings(bench, tmp_path, monkeypatch):
    real = bench.bound_fractions
    monkeypatch.setattr(bench, "bound_fractions", lambda *a, **kw: {**real(*a, **kw), "dx": (0.5, 1.01)})
    out = tmp_path / "norm.json"
    assert bench.main(["--interpret", "--rows", "33", "--width", "16", "--tiles", "", "--out", str(out)]) == 1
    record = json.loads(out.read_text())
    assert not record["checks_ok"] and [c["ok"] for c in record["checks"]] == [False] * 4
    assert record["checks"][0]["errors"]["dx"] == {"max_abs_err": 0.5, "bound_fraction": 1.01}
    assert "timing" not in record and "bytes_moved" not in record


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--width", "1536"], "--width 1536: the kernels take a power of two from 16 to 4096"),
        (["--tiles", "abc"], "argument --tiles: 'abc': invalid literal"),
        (["--tiles", "8x4,3x4"], r"argument --tiles: '3x4': rms_norm: tile must be \(rows, warps\), both powers of two"),
        (["--tiles", "2x64"], "asks for 64 warps; a Triton program runs at most 32"),
        (["--iters", "0"], "argument --iters: invalid positive_int value: '0'"),
        (["--bound-rows", "0"], "argument --bound-rows: invalid positive_int value: '0'"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_anything_runs(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
