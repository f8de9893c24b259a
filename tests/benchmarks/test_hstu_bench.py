"""benchmarks/hstu_bench.py on the CPU: the case table, the work count, the mapping of HSTU's semantics onto our
op (against a numpy re-statement of HSTU's Triton kernel), the checks, and the script end to end (our side in the
Mosaic GPU interpreter; HSTU's side replaced by the numpy formula)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture
def bench(load_benchmark, repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))
    return load_benchmark("hstu_bench")


# HSTU's Triton kernel (generative_recommenders/ops/triton/triton_hstu_attention.py), restated: per sequence and
# head, scores s_ij = alpha q_i . k_j; valid pairs j <= i (the diagonal included); out_i = sum_j silu(s_ij) / N v_j,
# N the max sequence length argument. Backward: dv = P^T dout with P = silu(S) / N on valid pairs,
# dS = (dout V^T) sigmoid(S) (1 + S (1 - sigmoid(S))) / N on valid pairs, dq = alpha dS K, dk = alpha dS^T Q.


def hstu_numpy(q, k, v, lengths, n, alpha, dout=None, divide_by_n=True):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out, dq, dk, dv = (np.zeros_like(q) for _ in range(4))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    norm = 1.0 / n if divide_by_n else 1.0
    for b in range(len(lengths)):
        lo, hi = bounds[b], bounds[b + 1]
        valid = np.tril(np.ones((hi - lo, hi - lo)))[None]  # [1, i, j]: j <= i
        s = np.einsum("ihd,jhd->hij", q[lo:hi], k[lo:hi]) * alpha
        sig = 1.0 / (1.0 + np.exp(-s))
        p = s * sig * norm * valid
        out[lo:hi] = np.einsum("hij,jhd->ihd", p, v[lo:hi])
        if dout is not None:
            g = np.asarray(dout[lo:hi], np.float64)
            dv[lo:hi] = np.einsum("hij,ihd->jhd", p, g)
            ds = np.einsum("ihd,jhd->hij", g, v[lo:hi]) * sig * (1 + s * (1 - sig)) * norm * valid
            dq[lo:hi] = alpha * np.einsum("hij,jhd->ihd", ds, k[lo:hi])
            dk[lo:hi] = alpha * np.einsum("hij,ihd->jhd", ds, q[lo:hi])
    return out if dout is None else (out, dq, dk, dv)


def test_case_table_is_the_documented_distribution(bench):
    assert bench.CASES == {
        "long-tailed": dict(batch=64, median=600, sigma=1.0, low=8, high=1024),
        "gem-like": dict(batch=1024, median=600, sigma=1.0, low=8, high=1024),
        "long": dict(batch=32, median=2000, sigma=1.0, low=8, high=4096),
    }
    assert (bench.SEED, bench.HEADS, bench.DIM) == (0, 4, 128)
    pinned = {"long-tailed": (64, 40739, 1024), "gem-like": (1024, 618365, 1024), "long": (32, 63928, 4096)}
    for name, case in bench.CASES.items():
        lengths = bench.draw_lengths(case)
        drawn = np.random.default_rng(0).lognormal(np.log(case["median"]), 1.0, case["batch"])
        np.testing.assert_array_equal(lengths, np.rint(np.clip(drawn, case["low"], case["high"])))
        assert lengths.dtype == np.int64 and lengths.min() >= case["low"] and lengths.max() <= case["high"]
        summary = bench.lengths_summary(lengths)
        assert (summary["count"], summary["sum"], summary["max"]) == pinned[name]
        assert summary["mean"] == pytest.approx(summary["sum"] / summary["count"])


def test_work_count_is_a_brute_force_count_of_causal_pairs(bench):
    lengths = [0, 1, 2, 7, 64, 65, 130]
    brute = sum(1 for n in lengths for i in range(n) for j in range(n) if j <= i)
    assert bench.causal_pairs(lengths) == brute == sum(n * (n + 1) // 2 for n in lengths)
    assert bench.forward_flops(lengths, 4, 128) == 4 * 4 * 128 * brute
    assert bench.causal_pairs([]) == 0


def test_our_op_with_scale_alpha_then_one_over_n_is_hstus_formula(bench):
    lengths, heads, dim, n, alpha = np.array([0, 1, 5, 17, 9]), 2, 16, 32, 0.3
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((int(lengths.sum()) + 3, heads, dim)).astype(np.float32) for _ in range(3))
    offsets = jnp.asarray(bench.offsets_of(lengths), jnp.int32)
    ours = bench.ours_hstu_semantics(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), offsets, n=n, alpha=alpha,
                                     implementation="xla")
    want = hstu_numpy(q, k, v, lengths, n, alpha)
    total = int(lengths.sum())
    np.testing.assert_allclose(np.asarray(ours)[:total], want[:total], rtol=1e-5, atol=1e-6)
    # 1/N belongs after silu: folding it into the scale computes something else.
    folded = bench.ours_gdpa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), offsets, n=n, alpha=alpha / n,
                             implementation="xla")
    assert bench.rel_err(np.asarray(folded)[:total], want[:total]) > 0.1


def test_the_chunked_reference_and_the_comparison_pass_agreement_and_flag_a_five_percent_error(bench):
    lengths, n, alpha = np.array([3, 0, 21, 40, 8]), 48, 16**-0.5
    data = bench.make_inputs(lengths, 2, 16, with_dout=True)
    total = data["total"]
    assert data["capacity"] == 128 and np.all(data["q"][total:] == 0) and data["q"].dtype == jnp.bfloat16
    want = hstu_numpy(data["q"], data["k"], data["v"], lengths, n, alpha, data["dout"])
    hstu = {name: x.astype(np.float32) for name, x in zip(("out", "dq", "dk", "dv"), want)}
    ref, chunks = bench.reference_outputs(data, lengths, n=n, alpha=alpha, grads=True)
    assert chunks == 1 and set(ref) == {"out", "dq", "dk", "dv"} and ref["out"].shape == (total, 2, 16)
    assert bench.reference_chunks(lengths, n, 2, score_elements=2 * 2 * n * n) == (2, [(0, 2), (2, 4), (4, 5)])
    chunked, chunks = bench.reference_outputs(data, lengths, n=n, alpha=alpha, grads=True, score_elements=2 * 2 * n * n)
    assert chunks == 3
    for name in ref:
        np.testing.assert_allclose(chunked[name], ref[name], rtol=1e-6, atol=1e-7)
        assert bench.rel_err(ref[name], hstu[name][:total]) < 1e-5  # the reference is HSTU's formula
    ours = {name: x.astype(jnp.bfloat16) for name, x in hstu.items()}
    good = bench.compare(ref, ours, hstu)
    assert good["ok"] and set(good) == {"measure", "bound", "ok", "out", "dq", "dk", "dv"}
    assert set(good["out"]) == {"ours_vs_ref", "hstu_vs_ref", "ours_vs_hstu", "ours_finite", "hstu_finite"}
    assert good["dq"]["ours_vs_ref"] < 0.01 and good["dq"]["hstu_vs_ref"] < 1e-5
    off = {name: x.copy() for name, x in hstu.items()}
    row = int(np.argmax(np.abs(hstu["out"][:total]).max(axis=(1, 2))))
    off["out"][row] *= 1.05  # the largest output 5% off
    bad = bench.compare(ref, ours, off)
    assert not bad["ok"] and bad["out"]["hstu_vs_ref"] == pytest.approx(0.05, rel=0.05) and bad["dq"]["hstu_vs_ref"] < 1e-5
    hstu["out"][total:] = np.nan  # slack rows are never compared
    assert bench.compare(ref, ours, hstu)["ok"] and bench.compare({"out": ref["out"]}, ours, None)["ok"]
    nan = {name: x.copy() for name, x in hstu.items()}
    nan["dv"][0, 0, 0] = np.nan
    assert not bench.compare(ref, ours, nan)["ok"]


def test_cpu_smoke_times_ours_and_records_a_failed_hstu_import(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("GEM_GIT_COMMIT", "abc123")
    out = tmp_path / "hstu.json"
    assert bench.main(["--cpu-smoke", "--hstu-src", str(tmp_path / "no-such-dir"), "--hstu-commit", "deadbeef",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["smoke"] and record["git_commit"] == "abc123" and record["hstu"]["commit"] == "deadbeef"
    assert record["hstu"]["import_error"].startswith("ModuleNotFoundError") and not record["hstu"]["ran"]
    assert set(record["versions"]) >= {"jax", "torch", "triton"} and record["flags"] == []
    assert list(record["cases"]) == list(bench.SMOKE_CASES)
    for name, case in record["cases"].items():
        lengths = bench.draw_lengths(bench.SMOKE_CASES[name])
        assert case["lengths"] == bench.lengths_summary(lengths) and case["N"] == bench.SMOKE_CASES[name]["high"]
        assert case["real_flops_fwd"] == bench.forward_flops(lengths, bench.SMOKE_HEADS, bench.SMOKE_DIM)
        for mode in ("fwd", "gdpa_only"):
            assert case["ours"][mode]["wall_ms"] > 0 and case["ours"][mode]["device_ms"] is None
        assert case["checks"]["ok"] and case["checks"]["out"]["ours_vs_ref"] < 0.02 and case["checks"]["reference_chunks"] > 1
        assert case["hstu"] == {} and case["ratios"] == {}


def fake_hstu(bench, monkeypatch, divide_by_n=True):
    """HSTU's side on the CPU: the numpy formula for the kernel, fixed times for the clocks."""
    monkeypatch.setattr(bench, "import_hstu", lambda src: (object(), None))
    monkeypatch.setattr(bench, "hstu_runnable", lambda mha, smoke: True)
    monkeypatch.setattr(bench, "torch_tensor", lambda x: x)
    monkeypatch.setattr(bench, "torch_numpy", lambda x: np.asarray(x, np.float32))
    monkeypatch.setattr(bench, "gpu_name", lambda: "fake GPU")

    def calls(mha, t, n, alpha):
        lengths = np.diff(t["offsets"])
        fwd = lambda: hstu_numpy(t["q"], t["k"], t["v"], lengths, n, alpha, divide_by_n=divide_by_n)
        return {"fwd": fwd, "fwd_unsorted": fwd,
                "fwd_bwd": lambda: hstu_numpy(t["q"], t["k"], t["v"], lengths, n, alpha, t["dout"], divide_by_n)}

    monkeypatch.setattr(bench, "hstu_calls", calls)
    monkeypatch.setattr(bench, "time_hstu", lambda fn, flops, iters: (fn(), {"first_call_s": 0.5, "do_bench_ms": 2.0,
                                                                           "wall_ms": 3.0, "real_flops": flops})[1])
    monkeypatch.setattr(bench, "torch_kernel_ms", lambda fn, iters: {"kernel_ms": 1.5, "kernels": [["k", 1500.0]]})


def test_every_phase_with_a_stand_in_for_hstu(bench, tmp_path, monkeypatch):
    fake_hstu(bench, monkeypatch)
    out = tmp_path / "hstu.json"
    assert bench.main(["--cpu-smoke", "--backward", "--cases", "smoke-b", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    case = record["cases"]["smoke-b"]
    assert record["hstu"]["ran"] and record["gpu"] is None and record["flags"] == []
    assert case["checks"]["ok"] and case["checks"]["out"]["ours_vs_hstu"] < 0.02 and case["checks"]["out"]["hstu_vs_ref"] < 1e-5
    grads = case["checks_grads"]
    assert grads["ok"] and set(grads) == {"measure", "bound", "ok", "dq", "dk", "dv"}
    for g in ("dq", "dk", "dv"):
        assert grads[g]["ours_vs_ref"] < 0.02 and grads[g]["ours_vs_hstu"] < 0.02 and grads[g]["hstu_vs_ref"] < 1e-5
    assert set(case["hstu"]) >= {"fwd", "fwd_unsorted", "fwd_bwd", "best_config"}
    assert case["hstu"]["fwd"]["kernel_ms"] == 1.5 and case["hstu"]["fwd_bwd"]["kernel_ms"] == 1.5
    assert case["ours"]["fwd_bwd"]["real_flops"] == pytest.approx(3.5 * case["real_flops_fwd"])
    for mode, ours in (("fwd", "fwd"), ("fwd_gdpa_only", "gdpa_only"), ("fwd_bwd", "fwd_bwd")):
        ratios = case["ratios"][mode]
        assert ratios["wall"] == pytest.approx(3.0 / case["ours"][ours]["wall_ms"])
        assert ratios["device"] is None  # no CUPTI on the CPU


def test_outputs_that_disagree_are_flagged_loudly_with_their_times_kept(bench, tmp_path, monkeypatch, capsys):
    fake_hstu(bench, monkeypatch, divide_by_n=False)  # an HSTU without its 1/N
    out = tmp_path / "hstu.json"
    assert bench.main(["--cpu-smoke", "--cases", "smoke-b", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    case = record["cases"]["smoke-b"]
    assert not case["checks"]["ok"] and case["checks"]["out"]["hstu_vs_ref"] > 1
    assert len(record["flags"]) == 1 and record["flags"][0].startswith("smoke-b: outputs disagree beyond 2%")
    assert case["hstu"]["fwd"]["do_bench_ms"] == 2.0 and case["ours"]["fwd"]["wall_ms"] > 0
    assert "!!! smoke-b: outputs disagree" in capsys.readouterr().out


def test_sweep_times_our_forward_under_each_tiling_against_the_default_output(bench, tmp_path, monkeypatch):
    """`--sweep` on the CPU: every `gdpa_bench.FORWARD_VARIANTS` tiling is traced (the tiling it ran is recorded) and
    agrees with our default tiling's output, or records why it did not run; wall time only (no CUPTI)."""
    from benchmarks import gdpa_bench

    monkeypatch.setattr(gdpa_bench, "FORWARD_VARIANTS", {"default": {}, "items8": {"row_tiles_per_item": 8, "group_sequences": False},
                                                         "grouped_items1": {"row_tiles_per_item": 1, "group_sequences": True},
                                                         "cols64": {"block_cols": 64}, "too_many_slots": {"row_slots": 64}})
    out = tmp_path / "hstu.json"
    assert bench.main(["--cpu-smoke", "--sweep", "--cases", "smoke-b", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["cases"]["smoke-b"]["ours_forward_sweep"]
    assert list(sweep) == ["default", "items8", "grouped_items1", "cols64", "too_many_slots"]
    # A tiling changes at most the order of the float32 sums behind a bf16 output element, so an element may round
    # the other way: one bf16 ulp, at most 2^-7 of the largest output (8 significant bits).
    for name in ("default", "items8", "grouped_items1", "cols64"):
        assert sweep[name]["rel_max_err"] <= 2.0**-7 and sweep[name]["wall_ms"] > 0 and sweep[name]["device_ms"] is None
    assert sweep["items8"]["tiling"]["row_tiles_per_item"] == 8 and sweep["cols64"]["tiling"]["block_cols"] == 64
    assert not sweep["items8"]["tiling"]["group_sequences"]
    # The causal forward's own tiling: one-tile items dealt by sequence (a few tiles a CTA here).
    assert sweep["default"]["tiling"] == sweep["grouped_items1"]["tiling"]
    assert sweep["default"]["tiling"]["group_sequences"] and sweep["default"]["tiling"]["row_tiles_per_item"] == 1
    assert "shared memory" in sweep["too_many_slots"]["error"]
