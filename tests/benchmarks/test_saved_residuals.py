"""The saved-residual listing (benchmarks/saved_residuals.py) on the tiny GEM config."""

import json

import jax.numpy as jnp


def test_lists_fp8_residuals_in_place_of_the_mlp_activations(repo_root, load_benchmark, tmp_path):
    module = load_benchmark("saved_residuals")
    out = tmp_path / "residuals.json"
    module.main(["--config", str(repo_root / "configs" / "gem_h200_tiny.py"), "--tokens", "131", "--batch", "4",
                 "--dtype", "bfloat16", "--fp8-saved-activations", "--out", str(out)])
    record = json.loads(out.read_text())
    off, on = (record["variants"][k] for k in ("bf16_residuals", "fp8_saved_activations"))
    hidden = 2 * 16  # mlp_ratio x embed_dim of the tiny config
    rows = lambda v, dtype: [r for r in v["residuals"] if r["axis"] == "T" and r["dtype"] == dtype]  # noqa: E731
    assert not rows(off, "float8_e4m3fn")
    assert {tuple(r["shape"]) for r in rows(on, "float8_e4m3fn")} == {(131, 16), (131, hidden)}
    assert any(r["shape"] == [131, hidden] for r in rows(off, "bfloat16"))
    assert not any(r["shape"] == [131, hidden] for r in rows(on, "bfloat16"))
    # Bytes per token add up: count x elements per row x itemsize.
    for r in on["residuals"]:
        assert r["bytes_per_token"] * 131 == r["count"] * jnp.dtype(r["dtype"]).itemsize * int(jnp.prod(jnp.array(r["shape"])))
    assert on["bytes_per_token_by_leading_axis"]["T"] < off["bytes_per_token_by_leading_axis"]["T"]
