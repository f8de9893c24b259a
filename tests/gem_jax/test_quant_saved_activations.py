"""FP8 saved activations: exact forward, gradients at the dequantized input within E4M3's bound,
non-finite blocks, empty inputs, and the tiny GEM model with `fp8_saved_activations`.

Bounds from the formats (tests/support/tolerances.py); measured errors: benchmarks/tolerances.md."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from gem_jax.batch import random_batch
from gem_jax.model.gem import GEMModel
from gem_jax.model.loss import weighted_bce
from gem_jax.nn.layers import MLP
from gem_jax.quant import Fp8Linear, Fp8Recipe
from gem_jax.quant.saved_activations import BLOCK, dense_fp8_input, fp8_residual, gelu_dense_fp8_input
from gem_jax.train.config import load_config
from pallas_kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from tolerances import DRAW, E4M3, check, check_within, dot_bound, product_rms, rel_err as _rel
from specs import movielens_spec

REPO = Path(__file__).resolve().parents[2]
# One E4M3-rounded operand (tests/support/tolerances.py): rms relative error <= 2^-3/sqrt(12) = 3.6% per element
# (Gaussian data lands at ~2.7%, the binade mean), and so in relative Frobenius norm, and so does x~^T dy.
E4M3_FROBENIUS = DRAW * E4M3.rms


def _linear(din, dout, dtype, seed):
    return nnx.Linear(din, dout, dtype=dtype, rngs=nnx.Rngs(seed), bias_init=nnx.initializers.normal(1.0))


def _dequantized(x):
    flat = x.reshape(x.shape[0], -1)
    return dequantize_mxfp8(*quantize_mxfp8(flat, block=BLOCK), block=BLOCK, dtype=x.dtype).reshape(x.shape)


def _grads(apply, layer, x, dy):
    """`(d layer params, dx)` of `<apply(layer, x), dy>`, jitted."""
    graphdef, params = nnx.split(layer)
    loss = lambda p, x: jnp.vdot(apply(nnx.merge(graphdef, p), x).astype(jnp.float32), dy.astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


def _plain_gelu_dense(layer, h):
    return layer(jax.nn.gelu(h))


def _plain_dense(layer, x):
    return layer(x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("wrapped,plain", [(dense_fp8_input, _plain_dense), (gelu_dense_fp8_input, _plain_gelu_dense)], ids=["dense", "gelu_dense"])
def test_forward_is_the_unwrapped_forward_bit_for_bit(dtype, wrapped, plain):
    seed = int(np.random.default_rng().integers(1 << 30))
    layer = _linear(200, 48, dtype, seed)
    x = (3.0 * jax.random.normal(jax.random.key(seed), (75, 200))).astype(dtype)
    graphdef, params = nnx.split(layer)
    for run in (lambda f: f, jax.jit):  # eager and jitted
        got = run(lambda p, x: wrapped(nnx.merge(graphdef, p), x))(params, x)
        want = run(lambda p, x: plain(nnx.merge(graphdef, p), x))(params, x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Under differentiation the primal output is the same too.
    got, _ = jax.vjp(lambda p, x: wrapped(nnx.merge(graphdef, p), x), params, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain(layer, x)))


def test_dense_weight_gradient_reads_the_fp8_input_and_dx_is_exact():
    seed = int(np.random.default_rng().integers(1 << 30))
    layer = _linear(256, 96, jnp.float32, seed)
    kx, kd = jax.random.split(jax.random.key(seed))
    # Token norms spread over orders of magnitude: 1x128 blocks keep each token's own scale.
    x = jax.random.normal(kx, (130, 256)) * jnp.exp(2.0 * jax.random.normal(kd, (130, 1)))
    dy = jax.random.normal(kd, (130, 96))
    (dp, dx) = _grads(dense_fp8_input, layer, x, dy)
    (rp, rx) = _grads(_plain_dense, layer, x, dy)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(rx))  # dx = dy W^T has no x in it
    # sum(dy): the same sum, in whatever order XLA reduces it (130 terms: gamma_130 = 8e-6 of the sum of magnitudes).
    np.testing.assert_allclose(np.asarray(dp["bias"][...]), np.asarray(rp["bias"][...]), rtol=1e-5, atol=1e-5)
    # The weight gradient is exactly x~^T dy ...
    # (float32 sums over 130 tokens whose norms span orders of magnitude: compared in Frobenius norm)
    check_within("x~^T dy", dp["kernel"][...], _dequantized(x).T @ dy, dot_bound(_dequantized(x).T, dy))
    # ... within E4M3's rounding of the exact one, and not zero (about the binade mean, 0.72 E4M3.rms).
    err = _rel(dp["kernel"][...], rp["kernel"][...])
    assert err > E4M3.rms / 2, err
    check("x~^T dy vs x^T dy", err, E4M3_FROBENIUS)


def test_gelu_dense_recomputes_gelu_at_the_fp8_input():
    seed = int(np.random.default_rng().integers(1 << 30))
    layer = _linear(192, 64, jnp.float32, seed)
    kh, kd = jax.random.split(jax.random.key(seed))
    h = 2.0 * jax.random.normal(kh, (100, 192))
    dy = jax.random.normal(kd, (100, 64))
    (dp, dh) = _grads(gelu_dense_fp8_input, layer, h, dy)
    (rp, rh) = _grads(_plain_gelu_dense, layer, h, dy)
    # Exactly the gradients of layer(gelu(.)) at h~ ...
    (qp, qh) = _grads(_plain_gelu_dense, layer, _dequantized(h), dy)
    # The same float32 arithmetic at the same h~, up to summation order over 100 tokens or 64 outputs (gamma_100 = 6e-6).
    for got, want in ((dp["kernel"][...], qp["kernel"][...]), (dh, qh)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dp["bias"][...]), np.asarray(rp["bias"][...]), rtol=1e-5, atol=1e-5)
    # ... within E4M3's rounding of the exact ones (dh through gelu'(h~), ~1.5% measured).
    check("kernel grad", _rel(dp["kernel"][...], rp["kernel"][...]), E4M3_FROBENIUS)
    check("dh", _rel(dh, rh), E4M3_FROBENIUS)


def test_any_rank_and_pytree_arguments():
    """A `[T, H, D]` input is quantized per token over H*D; arguments of any pytree shape pass through."""
    seed = int(np.random.default_rng().integers(1 << 30))
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (40, 4, 64))
    w = {"a": jax.random.normal(kw, (64,)), "n": jnp.arange(40)}
    fn = lambda x, w: jnp.sum(jnp.tanh(x) * w["a"], axis=-1) + w["n"][:, None]  # noqa: E731
    dy = jnp.ones((40, 4))
    got, vjp = jax.vjp(lambda x, a: fp8_residual(fn, x, {"a": a, "n": w["n"]}), x, w["a"])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(x, w)))
    want = jax.vjp(lambda x, a: fn(x, {"a": a, "n": w["n"]}), _dequantized(x), w["a"])[1](dy)
    for g, r in zip(vjp(dy), want):  # the same float32 elementwise ops and 64-term sums: a few u
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_gives_non_finite_gradients(bad):
    layer = _linear(256, 32, jnp.float32, 0)
    x = jax.random.normal(jax.random.key(1), (64, 256)).at[5, 130].set(bad)
    dy = jax.random.normal(jax.random.key(2), (64, 32))
    for wrapped, plain in ((dense_fp8_input, _plain_dense), (gelu_dense_fp8_input, _plain_gelu_dense)):
        y = wrapped(layer, x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(plain(layer, x)))
        (dp, dx), (rp, rx) = _grads(wrapped, layer, x, dy), _grads(plain, layer, x, dy)
        for got, want in ((dp["kernel"][...], rp["kernel"][...]), (dx, rx)):
            got, want = np.asarray(got), np.asarray(want)
            assert (~np.isfinite(got))[~np.isfinite(want)].all()  # never a number where the exact one is not
        kernel = np.asarray(dp["kernel"][...])
        # The poisoned 1x128 block is row 5, features 128..255: only their weight rows are NaN.
        assert np.isnan(kernel[128:]).all() and np.isfinite(kernel[:128]).all()


def test_zero_rows():
    layer = _linear(48, 16, jnp.bfloat16, 0)
    x = jnp.zeros((0, 48), jnp.bfloat16)
    dy = jnp.zeros((0, 16), jnp.bfloat16)
    for wrapped in (dense_fp8_input, gelu_dense_fp8_input):
        assert wrapped(layer, x).shape == (0, 16)
        dp, dx = _grads(wrapped, layer, x, dy)
        assert dx.shape == (0, 48)
        assert not np.asarray(dp["kernel"][...]).any() and not np.asarray(dp["bias"][...]).any()


def test_fp8_layer_is_called_as_it_is_and_gelu_dense_accepts_it():
    recipe = Fp8Recipe(block=32, implementation="xla")
    layer = Fp8Linear(64, 32, dtype=jnp.float32, recipe=recipe, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (40, 64))
    dy = jax.random.normal(jax.random.key(2), (40, 32))
    assert [a.dtype for a, _ in saved_residuals(lambda x: dense_fp8_input(layer, x), x)] == [
        a.dtype for a, _ in saved_residuals(lambda x: layer(x), x)
    ]
    (dp, dh), (rp, rh) = _grads(gelu_dense_fp8_input, layer, x, dy), _grads(_plain_gelu_dense, layer, x, dy)
    # Both sides run the FP8 layer; the saved FP8 input adds one more E4M3 rounding of h to the FP8 GEMMs' own.
    check("kernel grad", _rel(dp["kernel"][...], rp["kernel"][...]), DRAW * product_rms(E4M3, E4M3))
    check("dh", _rel(dh, rh), DRAW * product_rms(E4M3, E4M3))


def test_rejects_inputs_without_a_row_axis():
    with pytest.raises(ValueError, match=r"rank >= 2; got float32 \(5,\)"):
        fp8_residual(jnp.sin, jnp.ones(5))
    with pytest.raises(ValueError, match="floating"):
        fp8_residual(lambda x: x, jnp.ones((5, 2), jnp.int32))


# --- the tiny GEM model (configs/gem_h200_tiny.py) ---------------------------------------------

TOKENS, BATCH = 37, 5  # 37 history rows: a size no other dimension of the tiny model has
SPEC = movielens_spec(genres=5, max_genres=4, max_seq_len=16)


def _tiny(fp8_saved: bool, dtype: str = "float32"):
    model = load_config(REPO / "configs" / "gem_h200_tiny.py").model
    config = dataclasses.replace(model, fp8_saved_activations=fp8_saved, compute_dtype=dtype)
    with nnx.use_eager_sharding(False):
        return nnx.split(GEMModel(SPEC, config, rngs=nnx.Rngs(0)))


def _batch():
    return random_batch(SPEC, np.random.default_rng(0), [9, 0, 16, 3, 7], TOKENS)  # 35 real rows, 2 slack


def _loss(graphdef):
    def loss(params, batch):
        logits = nnx.merge(graphdef, params)(batch)
        return weighted_bce(logits, batch.labels, batch.weights).sum()

    return loss


def test_tiny_model_gradients_within_the_fp8_bound():
    batch = _batch()
    out, dots = {}, {}
    for on in (False, True):
        graphdef, params = _tiny(on)
        step = jax.jit(jax.value_and_grad(_loss(graphdef))).lower(params, batch).compile()
        out[on] = step(params, batch)
        dots[on] = step.as_text().count(" dot(")
    (loss_off, g_off), (loss_on, g_on) = out[False], out[True]
    assert float(loss_on) == float(loss_off)  # the forward is untouched
    # The backward recomputes elementwise work only, no matmul. The pooled attention's key-value projection is one GEMM
    # with an FP8 copy of its input and two without (`layers.norm_dense_parts`): one dot fewer forward, two backward.
    assert dots[True] == dots[False] - 3 > 50
    errors = {jax.tree_util.keystr(k): _rel(a, b) for (k, a), b in zip(jax.tree.leaves_with_path(g_on), jax.tree.leaves(g_off)) if np.any(b)}
    # Every parameter's gradient is within E4M3's rounding (worst measured: 2.8%, the first MLP-down kernel).
    worst = max(errors, key=errors.get)
    assert errors[worst] < E4M3_FROBENIUS, (worst, errors[worst])
    whole = _rel(jnp.concatenate([x.ravel() for x in jax.tree.leaves(g_on)]), jnp.concatenate([x.ravel() for x in jax.tree.leaves(g_off)]))
    assert 1e-4 < whole < E4M3_FROBENIUS, whole


def _residuals(on: bool):
    graphdef, params = _tiny(on, "bfloat16")
    return [(a.dtype, a.shape) for a, src in saved_residuals(_loss(graphdef), params, _batch()) if "from the argument" not in src]


def test_saved_residuals_hold_fp8_instead_of_bf16():
    cfg = load_config(REPO / "configs" / "gem_h200_tiny.py").model
    d, hidden, layers = cfg.embed_dim, cfg.mlp_ratio * cfg.embed_dim, cfg.num_seq_layers
    off, on = _residuals(False), _residuals(True)
    fp8 = [s for t, s in on if t == jnp.float8_e4m3fn]
    # Per block: the QKV input and the MLP-up input [T, d] and the pre-GELU [T, hidden]; the pooled KV input.
    assert sorted(fp8) == sorted([(TOKENS, d)] * (2 * layers + 1) + [(TOKENS, hidden)] * layers)
    assert not any(t == jnp.float8_e4m3fn for t, _ in off)
    wide = lambda res: [t for t, s in res if s == (TOKENS, hidden) and t != jnp.float8_e4m3fn]  # noqa: E731
    assert len(wide(off)) >= 2 * layers and not wide(on)  # no bf16 [T, hidden] residual is left
    token_bytes = lambda res: sum(np.prod(s) * jnp.dtype(t).itemsize for t, s in res if s and s[0] == TOKENS)  # noqa: E731
    assert token_bytes(on) < token_bytes(off)


def _temp_bytes(layers: int, on: bool, tokens: int = 2048, d: int = 256) -> int:
    with nnx.use_eager_sharding(False):
        mlps = nnx.List([MLP(d, 4 * d, rngs=nnx.Rngs(0), dtype=jnp.float32, fp8_saved_activations=on) for _ in range(layers)])
    graphdef, params = nnx.split(mlps)

    def loss(params, x):
        for mlp in nnx.merge(graphdef, params):
            x = x + mlp(x)
        return jnp.sum(x * x)

    x = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_compiled_backward_keeps_only_the_fp8_copies():
    """XLA's buffers, not just the traced residuals: stacking MLPs grows the gradient's temp memory
    by the full-precision activations each one saves, and with FP8 saved activations by far less
    (the dequantization waits for the cotangent; without that barrier XLA hoisted it into the
    forward and the saving was lost)."""
    per_layer = {on: (_temp_bytes(9, on) - _temp_bytes(1, on)) / 8 for on in (False, True)}
    tokens, hidden = 2048, 1024
    assert per_layer[False] >= 2 * tokens * hidden * 4  # at least h and gelu(h) in float32
    assert per_layer[True] <= tokens * (hidden + 256) * 1.1  # 8-bit h and x (and scales) at most
