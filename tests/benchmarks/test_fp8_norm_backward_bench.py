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
        assert layer["y_elements_differing"] == layer["dw_elements_differing"] == 0  # one machine, one reduction order
        assert layer["y_bound_fraction"] == layer["dw_bound_fraction"] == 0.0
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


def test_forward_bounds_allow_one_e4m3_code_per_input_byte_and_no_more(bench):
    """y computed from an input whose every quantized byte moved one E4M3 code (2**-3 of its tile's max, the worst
    the bound assumes) stays inside `forward_bounds`; the same move doubled does not."""
    import jax
    import jax.numpy as jnp

    x, scale, w, dy, g, h = bench.make_inputs(48, 256, 64, seed=3)
    normed = x.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + bench.EPS) * scale
    tile_max = jnp.repeat(jnp.max(jnp.abs(normed).reshape(48, 2, 128), axis=-1), 128, axis=1)
    y = (normed @ w).astype(jnp.bfloat16)
    y_bound, dw_bound = bench.forward_bounds(x, scale, w, g, y)
    for factor, inside in ((1.0, True), (2.0, False)):
        moved = ((normed + factor * 2.0**-3 * tile_max * jnp.sign(w[:, :1].T)) @ w).astype(jnp.bfloat16)
        assert bool(jnp.all(jnp.abs(moved.astype(jnp.float32) - y.astype(jnp.float32)) <= y_bound)) == inside
        dw_moved = (factor * 2.0**-3 * tile_max).T @ jnp.abs(g.astype(jnp.float32))
        assert bool(jnp.all(dw_moved <= dw_bound)) == inside
