"""FP8 dense layer: forward and gradients against bf16/f32 references, nnx.Linear compatibility.

Bounds from the formats (tests/support/tolerances.py; measured errors: benchmarks/tolerances.md): an FP8 GEMM
against the bf16 layer is off by the E4M3 rounding of each FP8 operand and the bf16 rounding of the
reference's; the "documented formula" checks redo the same quantized products in float32, so they
differ only by summation order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import mosaic_gpu as plgpu

from tolerances import BFLOAT16, DRAW, E4M3, check, check_within, dot_bound, product_rms, rel_err as _rel, sum_worst

from gem_jax.nn.layers import MLP, norm_dense, rms_norm
from gem_jax.quant import Fp8Gather, Fp8Linear, Fp8Recipe, fp8_matmul, quantize_weight
from pallas_kernels.mxfp8 import dequantize_mxfp8, hadamard_signs, kernel_matmul, quantize_mxfp8, reference
from pallas_kernels.mxfp8.fsdp import gathered_extent


# Measured 1.5-1.8x under these bounds (benchmarks/tolerances.md), and that is the margin the arithmetic predicts:
# Format.rms is 1/0.72 above the mean over a binade, and DRAW adds 1.25x. The measured error is an rms over
# >= 96 x 64 elements, whose spread from draw to draw is a few percent: a 1.5x margin is many spreads wide.
# FP8 x FP8 GEMM against the bf16 GEMM of the same float operands (forward, dgrad).
FP8_VS_BF16 = DRAW * product_rms(E4M3, E4M3, BFLOAT16, BFLOAT16)
# The wgrad: FP8 x against bf16 x, the same bf16 gradient on both sides.
WGRAD_VS_BF16 = DRAW * product_rms(E4M3, BFLOAT16)
# Against float32: each FP8 operand's rounding, nothing on the reference's side.
FP8_VS_F32 = DRAW * product_rms(E4M3, E4M3)
# A gradient through an FP8 GEMM and a prologue's backward (a linear map of the FP8 dgrad): the dgrad's error.
PROLOGUE_GRAD_VS_BF16 = FP8_VS_BF16
# A gradient of sum(sin(y)) with y from FP8 layers: y's error (2 FP8 operands) in the cotangent, FP8 x, bf16 cotangent.
CHAIN_GRAD_VS_F32 = DRAW * product_rms(E4M3, E4M3, E4M3, BFLOAT16)


def _data(t, din, dout, seed):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (t, din))
    w = jax.random.normal(kw, (din, dout)) / np.sqrt(din)
    g = jax.random.normal(kg, (t, dout))
    return x, w, g


def _grads(fn, x, w, g):
    return jax.grad(lambda x, w: jnp.sum(fn(x, w) * g), argnums=(0, 1))(x, w)


@pytest.mark.parametrize("block", [32, 128])
def test_forward_and_gradients_against_float_reference(block):
    recipe = Fp8Recipe(block=block, implementation="xla")
    x, w, g = _data(96, 256, 160, seed=block)
    y = fp8_matmul(x, w, None, recipe, w.dtype)
    dx, dw = _grads(lambda x, w: fp8_matmul(x, w, None, recipe, w.dtype), x, w, g)
    # bf16 reference layer (the layer the FP8 one replaces), f32 accumulation.
    bf16 = lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)  # noqa: E731
    rx, rw = _grads(bf16, x, w, g)
    check("y", _rel(y, bf16(x, w)), FP8_VS_BF16)
    check("dx", _rel(dx, rx), FP8_VS_BF16)
    check("dw", _rel(dw, rw), WGRAD_VS_BF16)

    # Exactly the documented formulas: FP8 forward and dgrad, bf16 wgrad from the saved FP8 input.
    ab, wb = recipe.act_block, recipe.weight_block
    xq = dequantize_mxfp8(*quantize_mxfp8(x, block=ab), block=ab)
    wq = dequantize_mxfp8(*quantize_mxfp8(w, block=wb), block=wb)
    gq = dequantize_mxfp8(*quantize_mxfp8(g, block=ab), block=ab)
    check_within("y = xq wq", y, xq @ wq, dot_bound(xq, wq))  # the same exact products, summed in another order
    check_within("dx = gq wq^T", dx, gq @ wq.T, dot_bound(gq, wq.T))
    xb, gb = xq.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
    dw_ref = jnp.dot(xb.T, gb, preferred_element_type=jnp.float32)
    check_within("dw = xq^T g", dw, dw_ref, dot_bound(xb.T, gb))


@pytest.mark.parametrize("block", [32, 128])
def test_pallas_kernels_match_xla_path_forward_and_backward(block):
    x, w, g = _data(72, 128, 160, seed=10 + block)  # tokens not a multiple of the tiles
    small = kernel_matmul.TuningConfig(max_concurrent_steps=2, cluster=None)
    outs = {}
    for impl in ("xla", "pallas"):
        recipe = Fp8Recipe(block=block, implementation=impl, config=small)
        f = jax.jit(lambda x, w, r=recipe: (fp8_matmul(x, w, None, r, w.dtype), *_grads(lambda a, b: fp8_matmul(a, b, None, r, b.dtype), x, w, g)))
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            outs[impl] = f(x, w)
    # Both quantize the same float32 values bit for bit and sum the same exact FP8 products in float32, in their
    # own orders: at most 2 gamma_K of the sum of magnitudes (K <= 160), ~1e-5 of these O(1) entries; measured ~1e-7.
    atol = 2 * sum_worst(160) * np.sqrt(160)  # |x w| sums to at most ~sqrt(K) for unit-variance x and w ~ 1/sqrt(K)
    for got, ref in zip(outs["pallas"], outs["xla"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2 * sum_worst(160), atol=atol)


def test_square_weight_quantization_is_reused_by_the_backward():
    w = jax.random.normal(jax.random.key(2), (96, 64))
    wq, sw = quantize_weight(w, Fp8Recipe())
    wq_t, sw_t = quantize_mxfp8(w.T)
    np.testing.assert_array_equal(np.asarray(wq.T).view(np.uint8), np.asarray(wq_t).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sw.T).view(np.uint8), np.asarray(sw_t).view(np.uint8))


def test_stochastic_gradient_rounding_is_unbiased_over_keys():
    recipe = Fp8Recipe(grad_rounding="stochastic", implementation="xla")
    x, w, g = _data(64, 64, 64, seed=4)
    keys = jax.random.split(jax.random.key(0), 256)
    dx = jax.vmap(lambda k: jax.grad(lambda x: jnp.sum(fp8_matmul(x, w, k, recipe, w.dtype) * g))(x))(keys)
    wq = dequantize_mxfp8(*quantize_mxfp8(w))
    exact = g @ wq.T  # dgrad with an unrounded gradient
    # Stochastic rounding's error has variance f(1-f) ulp^2 (f: the value's place between its grid neighbours),
    # ulp^2/6 on average: rms eps/sqrt(6) = sqrt(2) E4M3.rms per gradient element; the mean of n draws has 1/sqrt(n) of it.
    sr = np.sqrt(2) * E4M3.rms
    check("one draw", _rel(dx[0], exact), DRAW * sr)
    check("mean of 256 draws", _rel(dx.mean(0), exact), DRAW * sr / np.sqrt(256))


def test_layer_is_a_drop_in_for_nnx_linear():
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    with nnx.use_eager_sharding(False):
        fp8 = Fp8Linear(64, 96, kernel_init=init, rngs=nnx.Rngs(0), recipe=Fp8Recipe(implementation="xla"))
        ref = nnx.Linear(64, 96, kernel_init=init, rngs=nnx.Rngs(0))
    s_fp8, s_ref = nnx.state(fp8, nnx.Param), nnx.state(ref, nnx.Param)
    assert jax.tree.map(jnp.shape, s_fp8) == jax.tree.map(jnp.shape, s_ref)
    np.testing.assert_array_equal(np.asarray(fp8.kernel[...]), np.asarray(ref.kernel[...]))
    assert nnx.get_partition_spec(s_fp8)["kernel"].get_value() == nnx.get_partition_spec(s_ref)["kernel"].get_value()
    x = jax.random.normal(jax.random.key(1), (3, 7, 64))
    y = fp8(x)
    assert y.shape == (3, 7, 96) and y.dtype == jnp.float32
    check("y", _rel(y, ref(x)), FP8_VS_F32)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(fp8)
    ref_grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(ref)
    # d/dy = 2y carries y's FP8 error; the wgrad adds FP8 x and the bf16 rounding of 2y.
    check("bias grad", _rel(grads["bias"][...], ref_grads["bias"][...]), FP8_VS_F32)
    check("kernel grad", _rel(grads["kernel"][...], ref_grads["kernel"][...]), DRAW * product_rms(E4M3, E4M3, E4M3, BFLOAT16))
    assert Fp8Linear(64, 96, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x).dtype == jnp.bfloat16


def test_zero_tokens_and_errors():
    layer = Fp8Linear(64, 32, rngs=nnx.Rngs(0), recipe=Fp8Recipe(implementation="xla"))
    x = jnp.zeros((0, 64))
    assert layer(x).shape == (0, 32)
    grads = nnx.grad(lambda m: jnp.sum(m(x)))(layer)
    assert not np.any(np.asarray(grads["kernel"][...]))
    with pytest.raises(ValueError, match="in_features"):
        layer(jnp.ones((2, 63)))
    with pytest.raises(ValueError, match="key"):
        Fp8Linear(64, 32, rngs=nnx.Rngs(0), recipe=Fp8Recipe(grad_rounding="stochastic"))(jnp.ones((2, 64)))
    with pytest.raises(ValueError, match="block"):
        Fp8Recipe(block=64)
    with pytest.raises(ValueError, match="rounding"):
        Fp8Recipe(grad_rounding="up")
    with pytest.raises(ValueError, match="Fp8Recipe.hadamard must be a bool, got 1"):
        Fp8Recipe(hadamard=1)
    with pytest.raises(ValueError, match=r"Fp8Recipe\(hadamard=True\) rotates the input features in blocks of 32; got 48"):
        fp8_matmul(jnp.ones((2, 48)), jnp.ones((48, 8)), None, Fp8Recipe(hadamard=True), jnp.float32)


def _prologue_ref(prologue, x, param):
    """float32 p(x) of the fused prologues, written out (`param`: the norm gain or the GELU's input bias)."""
    if prologue == "rmsnorm":
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * param
    if prologue == "gelu_bias":
        return jax.nn.gelu(x + param)
    return jax.nn.gelu(x) if prologue == "gelu" else x


def _prologue_args(prologue, param):
    return {
        "none": {},
        "rmsnorm": {"prologue": "rmsnorm", "norm_scale": param},
        "gelu": {"prologue": "gelu"},
        "gelu_bias": {"prologue": "gelu", "input_bias": param},
    }[prologue]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gelu_bias_gradient_is_the_row_sum_of_the_input_gradient_the_layer_returns(dtype):
    """The GELU prologue's input bias gets the float32 row sum of the `dx` the layer passes on
    (rounded to `x`'s dtype), the gradient a bias added in that dtype gets."""
    recipe = Fp8Recipe(block=32, implementation="xla")
    x, w, g = _data(96, 256, 160, seed=int(np.random.default_rng().integers(1 << 30)))
    bias = 0.3 * jax.random.normal(jax.random.key(3), (256,))
    _, vjp = jax.vjp(lambda x, b: fp8_matmul(x, w, None, recipe, w.dtype, prologue="gelu", input_bias=b), x.astype(dtype), bias)
    dx, dbias = vjp(g.astype(dtype))  # the layer's output is in x's dtype
    assert dx.dtype == dtype and dbias.dtype == bias.dtype
    # float32 sums of the same values in possibly other orders: gamma_rows of the sum of magnitudes
    wide = np.asarray(dx, np.float64)
    check_within("dbias", dbias, wide.sum(0), 2 * sum_worst(wide.shape[0]) * np.abs(wide).sum(0))


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize(
    "prologue, hadamard", [(p, False) for p in ("rmsnorm", "gelu", "gelu_bias")] + [(p, True) for p in ("none", "rmsnorm", "gelu", "gelu_bias")]
)
def test_fused_prologue_forward_and_gradients(block, prologue, hadamard):
    """With `hadamard` the GEMMs see `p(x) R` and `R^T w`: `y`, `dx`, the prologue's parameter and
    `dw = R (.)` stay within the FP8 bound of the float32 layer, as without the rotation."""
    recipe = Fp8Recipe(block=block, implementation="xla", hadamard=hadamard)
    x, w, g = _data(96, 256, 160, seed=20 + block)
    x = x * 3.0 + 0.5  # a mean and a spread for the norm to remove
    x = x.at[:, 7].multiply(30.0)  # an outlier feature, what the rotation spreads over its block
    scale = 1.0 + 0.3 * jax.random.normal(jax.random.key(7), (256,))
    has_param = prologue in ("rmsnorm", "gelu_bias")

    def fused(x, scale, w):
        return fp8_matmul(x, w, None, recipe, w.dtype, **_prologue_args(prologue, scale))

    y, vjp = jax.vjp(fused, x, scale, w)
    dx, dscale, dw = vjp(g)
    # Reference: the bf16 layer p(x) @ w that the fused FP8 layer replaces (the FP8 bound: ~3.7% per GEMM).
    bf16 = lambda x, scale, w: jnp.dot(  # noqa: E731
        _prologue_ref(prologue, x, scale).astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32
    )
    ry, rvjp = jax.vjp(bf16, x, scale, w)
    rdx, rdscale, rdw = rvjp(g)
    check("y", _rel(y, ry), FP8_VS_BF16)
    check("dx", _rel(dx, rdx), PROLOGUE_GRAD_VS_BF16)
    check("dw", _rel(dw, rdw), WGRAD_VS_BF16)
    if has_param:
        check("dscale", _rel(dscale, rdscale), PROLOGUE_GRAD_VS_BF16)
    else:
        assert dscale is None or not np.any(np.asarray(dscale))

    # Exactly the documented formulas: p in float32, FP8 forward and dgrad, bf16 wgrad from the saved FP8 input;
    # with the rotation R (signs hadamard_signs(256), blocks of `block`): p R and R^T w quantized, dgrad (.) R^T
    # (bf16 operands, float32 sums: reference.rotate(..., bf16_operands=True)), wgrad R (.).
    # Compiled like the layer (which runs through one jit per configuration), so both take XLA's tanh.
    ab, wb = recipe.act_block, recipe.weight_block
    signs = hadamard_signs(256) if hadamard else None
    back = (lambda a, axis=-1: reference.rotate(a, signs, block=block, axis=axis, inverse=True)) if hadamard else (lambda a, axis=-1: a)
    dgrad_back = (lambda a: reference.rotate(a, signs, block=block, inverse=True, bf16_operands=True)) if hadamard else (lambda a: a)
    p, p_vjp = jax.jit(lambda x, scale: jax.vjp(lambda x, s: _prologue_ref(prologue, x, s), x, scale))(x, scale)
    pq = dequantize_mxfp8(*quantize_mxfp8(p, block=ab, hadamard_signs=signs), block=ab)
    w_rot = reference.rotate(w, signs, block=block, axis=0) if hadamard else w
    wq = dequantize_mxfp8(*quantize_mxfp8(w_rot, block=wb), block=wb)
    gq = dequantize_mxfp8(*quantize_mxfp8(g, block=ab), block=ab)
    np.testing.assert_allclose(np.asarray(y), np.asarray(pq @ wq), rtol=1e-4, atol=1e-4)
    want_dx, want_dscale = p_vjp(dgrad_back(gq @ wq.T))
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-4, atol=1e-4)
    if has_param:
        np.testing.assert_allclose(np.asarray(dscale), np.asarray(want_dscale), rtol=1e-4, atol=1e-4)
    dw_ref = back(jnp.dot(pq.astype(jnp.bfloat16).T, g.astype(jnp.bfloat16), preferred_element_type=jnp.float32), axis=0)
    # float32 sums of pq.shape[0] products (then of `block` in the inverse rotation), each at most the
    # largest |entry|: the worst-case summation error bounds the difference of two summation orders
    atol = sum_worst(pq.shape[0] + block) * float(np.abs(np.asarray(dw_ref)).max())
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=0, atol=atol)


def test_layer_with_norm_or_gelu_matches_the_unfused_modules():
    """`Fp8Linear(x, norm=n)` and `(x, gelu=True)` are `Fp8Linear(n(x))` and `Fp8Linear(gelu(x))` up to FP8 rounding."""
    recipe = Fp8Recipe(implementation="xla")
    layer = Fp8Linear(128, 64, rngs=nnx.Rngs(0), recipe=recipe)
    norm = nnx.RMSNorm(128, epsilon=1e-6, rngs=nnx.Rngs(1))
    norm.scale[...] = 1.0 + 0.2 * jax.random.normal(jax.random.key(3), (128,))
    x = jax.random.normal(jax.random.key(2), (5, 40, 128)) * 2.0 + 1.0
    ref = nnx.Linear(128, 64, rngs=nnx.Rngs(0))  # the same initial kernel and bias

    check("y with norm", _rel(layer(x, norm=norm), ref(norm(x))), FP8_VS_F32)

    def loss(modules, fused):
        layer, norm = modules
        y = layer(x, norm=norm) if fused else layer(norm(x))
        return jnp.sum(jnp.sin(y))

    fused_grads, grads_ref = (nnx.grad(loss)((m, norm), f) for m, f in ((layer, True), (ref, False)))
    for part in ("kernel", "bias"):
        check(part, _rel(fused_grads[0][part][...], grads_ref[0][part][...]), CHAIN_GRAD_VS_F32)
    check("norm scale", _rel(fused_grads[1]["scale"][...], grads_ref[1]["scale"][...]), CHAIN_GRAD_VS_F32)
    gelu_y = layer(x, gelu=True)
    assert gelu_y.shape == (5, 40, 64)
    check("y with gelu", _rel(gelu_y, ref(jax.nn.gelu(x))), FP8_VS_F32)

    with pytest.raises(ValueError, match="not both"):
        layer(x, norm=norm, gelu=True)
    with pytest.raises(ValueError, match="in_features=128"):
        layer(x, norm=nnx.RMSNorm(64, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="RMSNorm with a scale"):
        layer(x, norm=nnx.LayerNorm(128, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="norm_scale"):
        fp8_matmul(x[0], layer.kernel[...], None, recipe, jnp.float32, prologue="rmsnorm")


def test_first_mlp_layer_leaves_its_bias_to_the_second():
    """`down(up(x, add_bias=False), gelu=True, input_bias=up.bias)` is `down(gelu(up(x)))`, gradients included."""
    recipe = Fp8Recipe(implementation="xla")
    up = Fp8Linear(128, 256, rngs=nnx.Rngs(0), recipe=recipe, bias_init=nnx.initializers.normal(0.5))
    down = Fp8Linear(256, 64, rngs=nnx.Rngs(1), recipe=recipe)
    x = jax.random.normal(jax.random.key(2), (3, 50, 128))
    np.testing.assert_allclose(np.asarray(up(x, add_bias=False) + up.bias[...]), np.asarray(up(x)), rtol=1e-6, atol=1e-6)

    def loss(modules, deferred):
        up, down = modules
        y = down(up(x, add_bias=False), gelu=True, input_bias=up.bias[...]) if deferred else down(up(x), gelu=True)
        return jnp.sum(jnp.sin(y))

    (y_def, g_def), (y_ref, g_ref) = (nnx.value_and_grad(loss)((up, down), d) for d in (True, False))
    assert _rel(y_def, y_ref) < 1e-3  # the sum over all outputs; elementwise, FP8 rounding of h + b vs bf16 h
    for module in (0, 1):
        for part in ("kernel", "bias"):
            assert _rel(g_def[module][part][...], g_ref[module][part][...]) < 0.02
    with pytest.raises(ValueError, match="input_bias is added before the GELU"):
        down(up(x), input_bias=up.bias[...])
    with pytest.raises(ValueError, match=r"input_bias must be \[256\], got \(\)"):
        fp8_matmul(up(x)[0], down.kernel[...], None, recipe, jnp.float32, prologue="gelu", input_bias=1.0)


@pytest.mark.parametrize("with_norm", [False, True])
def test_fp8_mlp_adds_the_first_bias_in_the_gelu_pass(with_norm):
    """`MLP` with FP8 layers computes `down(gelu(up(norm(x)) + b_up))`: the same values and gradients as written out."""
    recipe = Fp8Recipe(implementation="xla")
    with nnx.use_eager_sharding(False):  # logical axes only, no mesh
        mlp = MLP(128, 256, rngs=nnx.Rngs(0), fp8=recipe, dtype=jnp.float32)
        norm = rms_norm(128, rngs=nnx.Rngs(1), dtype=jnp.float32) if with_norm else None
    mlp.up.bias[...] = 0.5 * jax.random.normal(jax.random.key(4), (256,))
    x = jax.random.normal(jax.random.key(5), (2, 40, 128))

    def written_out(mlp, deferred):
        h = mlp.up(x, norm=norm, add_bias=not deferred) if with_norm else mlp.up(x, add_bias=not deferred)
        bias = mlp.up.bias[...] if deferred else None
        return jnp.sum(jnp.sin(mlp.down(h, gelu=True, input_bias=bias)))

    value, grads = nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x, norm=norm))))(mlp)
    want, want_grads = nnx.value_and_grad(written_out)(mlp, True)
    np.testing.assert_allclose(np.asarray(value), np.asarray(want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    undeferred, undeferred_grads = nnx.value_and_grad(written_out)(mlp, False)  # bias added before the GELU pass
    assert _rel(value, undeferred) < 1e-3
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(undeferred_grads)):
        assert _rel(a, b) < 0.02


def test_fp8_matmul_refuses_inputs_whose_features_differ_from_the_weight_rows():
    x, w = jnp.ones((64, 96)), jnp.ones((128, 64))
    assert gathered_extent(w, axis_name="fsdp") == 128  # outside shard_map: the array is the whole weight
    with pytest.raises(ValueError, match="x has 96 input features, w 128 rows"):
        fp8_matmul(x, w, None, Fp8Recipe(), jnp.float32)
    with pytest.raises(ValueError, match="x has 96 input features, w 128 rows"):  # gathered size counts outside too
        fp8_matmul(x, w, None, Fp8Recipe(), jnp.float32, gather=Fp8Gather(0, "fsdp"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kept_input_gradient_joins_the_norm_backward(dtype):
    """`fp8_matmul(keep_input=True)` returns `x` through the layer, and its cotangent joins the RMSNorm prologue's
    backward. By default ("xla") the gradients are those of the layer with `x` used directly, bit for bit (the same
    autodiff, the cotangent added to the rounded dx); with the norm's backward kernel (the interpreter,
    `norm_implementation="pallas"`) the sum is taken in float32 before the rounding: dx within four unit roundoffs
    of x's dtype of its row's largest |dx| + |h|, the gain's gradient within float32 summation order, the weight's bit for bit."""
    recipe = Fp8Recipe(block=128, implementation="xla")
    x, w, g = _data(70, 128, 96, seed=31)  # 70 rows: not a multiple of the norm kernel's row tile
    x = (x * 3.0 + 0.5).astype(dtype)
    scale = 1.0 + 0.3 * jax.random.normal(jax.random.key(8), (128,))
    h = jax.random.normal(jax.random.key(9), x.shape).astype(dtype)  # the residual's cotangent

    def kept(x, scale, w, implementation):
        y, x_out = fp8_matmul(x, w, None, recipe, w.dtype, prologue="rmsnorm", norm_scale=scale, norm_implementation=implementation, keep_input=True)
        return jnp.sum(y.astype(jnp.float32) * g) + jnp.sum(x_out.astype(jnp.float32) * h.astype(jnp.float32))

    def direct(x, scale, w):
        y = fp8_matmul(x, w, None, recipe, w.dtype, prologue="rmsnorm", norm_scale=scale)
        return jnp.sum(y.astype(jnp.float32) * g) + jnp.sum(x.astype(jnp.float32) * h.astype(jnp.float32))

    want = jax.jit(jax.grad(direct, argnums=(0, 1, 2)))(x, scale, w)
    grads = lambda i: jax.jit(jax.grad(lambda *a: kept(*a, i), argnums=(0, 1, 2)))(x, scale, w)  # noqa: E731
    for a, b in zip(grads("xla"), want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = grads("pallas")
    assert got[0].dtype == dtype
    unit = 2.0**-24 if dtype == jnp.float32 else 2.0**-8
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    # Per row, against the row's largest |dx| + |h|: autodiff rounds each of the norm's two float32 widenings'
    # gradients of a bf16 x to bf16 before summing them (terms of the row's scale that may cancel), dx before h,
    # and the sum; the kernel rounds once (4 unit roundoffs); both sum the row's 128 terms in float32 in any order.
    row_scale = np.max(np.abs(f32(want[0])) + np.abs(f32(h)), axis=-1, keepdims=True)
    assert np.max(np.abs(f32(got[0]) - f32(want[0])) / row_scale) <= 4 * unit + 2 * sum_worst(128)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-4)  # float32 sums in another order
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # the weight gradient does not see the norm's backward


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_pre_norm_residual_blocks_keep_their_gradients(dtype):
    """`MLP.residual` and `norm_dense(residual=True)` with FP8 layers pass the input through the first layer
    (`keep_input`): values and every gradient bit for bit those of `x + mlp(x, norm)` and `(layer(x, norm=), x)`."""
    recipe = Fp8Recipe(implementation="xla")
    with nnx.use_eager_sharding(False):  # logical axes only, no mesh
        mlp = MLP(128, 256, rngs=nnx.Rngs(0), fp8=recipe, dtype=dtype)
        norm = rms_norm(128, rngs=nnx.Rngs(1), dtype=dtype)
    norm.scale[...] = 1.0 + 0.2 * jax.random.normal(jax.random.key(3), (128,))
    x = (jax.random.normal(jax.random.key(5), (2, 40, 128)) * 2.0 + 0.5).astype(dtype)
    loss = lambda out: jnp.sum(jnp.sin(out.astype(jnp.float32)))  # noqa: E731
    kept = nnx.jit(nnx.value_and_grad(lambda m, n, x: loss(m.residual(x, n)), argnums=(0, 1, 2)))(mlp, norm, x)
    plain = nnx.jit(nnx.value_and_grad(lambda m, n, x: loss(x + m(x, norm=n)), argnums=(0, 1, 2)))(mlp, norm, x)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def block(layer, n, x, residual):
        out = norm_dense(n, layer, x, residual=True) if residual else (layer(x, norm=n), x)
        return loss(out[0]) + loss(out[1] * 0.5)

    kept, plain = (nnx.jit(nnx.value_and_grad(lambda l, n, x, r=r: block(l, n, x, r), argnums=(0, 1, 2)))(mlp.up, norm, x) for r in (True, False))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layer_keeps_its_input_for_the_residual_only_with_a_norm():
    """`Fp8Linear(keep_input=True)` returns `(y, x)` with `x` unchanged; it needs `norm=`, and `fp8_matmul` its RMSNorm prologue."""
    recipe = Fp8Recipe(implementation="xla")
    layer = Fp8Linear(128, 64, rngs=nnx.Rngs(0), recipe=recipe)
    norm = nnx.RMSNorm(128, epsilon=1e-6, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (5, 40, 128))
    y, x_out = layer(x, norm=norm, keep_input=True)
    np.testing.assert_array_equal(np.asarray(x_out), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(layer(x, norm=norm)))
    with pytest.raises(ValueError, match="keep_input passes the input of the norm through: pass it with norm="):
        layer(x, keep_input=True)
    # float32 inputs to a bf16 layer: cast first, so the inputs come back as they are, outside the layer's VJP
    bf16_layer = Fp8Linear(128, 64, rngs=nnx.Rngs(0), recipe=recipe, dtype=jnp.bfloat16)
    y16, x_same = bf16_layer(x, norm=norm, keep_input=True)
    assert x_same is x and y16.dtype == jnp.bfloat16
    kept_grad = jax.grad(lambda x: jnp.sum(jnp.sin(bf16_layer(x, norm=norm, keep_input=True)[0].astype(jnp.float32))))(x)
    plain_grad = jax.grad(lambda x: jnp.sum(jnp.sin(bf16_layer(x, norm=norm).astype(jnp.float32))))(x)
    np.testing.assert_array_equal(np.asarray(kept_grad), np.asarray(plain_grad))
    with pytest.raises(ValueError, match="keep_input passes the input of the RMSNorm prologue through, not of Prologue.GELU"):
        fp8_matmul(x[0], layer.kernel[...], None, recipe, jnp.float32, prologue="gelu", keep_input=True)
    with pytest.raises(ValueError, match="norm_implementation must be 'xla', 'pallas' or None, got 'cudnn'"):
        fp8_matmul(x[0], layer.kernel[...], None, recipe, jnp.float32, prologue="rmsnorm", norm_scale=jnp.ones(128), norm_implementation="cudnn")
    with pytest.raises(ValueError, match="norm_implementation chooses the RMSNorm prologue's backward, not Prologue.GELU's"):
        fp8_matmul(x[0], layer.kernel[...], None, recipe, jnp.float32, prologue="gelu", norm_implementation="pallas")


@pytest.mark.parametrize("implementation, kernel_calls", [("xla", 0), ("pallas", 1), (None, 0)])
def test_layer_runs_the_norm_backward_its_norm_runs(implementation, kernel_calls, monkeypatch):
    """An `Fp8Linear` given `gem_jax.nn.layers.RMSNorm` runs the prologue's backward under the norm's `implementation`
    (`fp8_matmul(norm_implementation=)`), flax's `nnx.RMSNorm` under "xla": every gradient bit for bit the direct call's,
    and the norm's backward kernel traced once under "pallas" (in the interpreter), never under "xla" or None on the
    CPU (`rms_norm_backward`'s reference)."""
    from pallas_kernels.rms_norm import kernel as norm_kernel

    traced = []
    real_backward = norm_kernel.backward
    monkeypatch.setattr(norm_kernel, "backward", lambda *a, **kw: traced.append(1) or real_backward(*a, **kw))
    recipe = Fp8Recipe(block=128, implementation="xla")
    with nnx.use_eager_sharding(False):
        layer = Fp8Linear(128, 64, rngs=nnx.Rngs(0), recipe=recipe, dtype=jnp.bfloat16)
        norm = rms_norm(128, rngs=nnx.Rngs(1), dtype=jnp.bfloat16, implementation=implementation)
    norm.scale[...] = 1.0 + 0.2 * jax.random.normal(jax.random.key(3), (128,))
    flax_norm = nnx.RMSNorm(128, epsilon=1e-6, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    flax_norm.scale[...] = norm.scale[...]
    x = (jax.random.normal(jax.random.key(5), (70, 128)) * 2.0 + 0.5).astype(jnp.bfloat16)
    h = jax.random.normal(jax.random.key(6), x.shape)
    loss = lambda y, x_out: jnp.sum(jnp.sin(y.astype(jnp.float32))) + jnp.sum(x_out.astype(jnp.float32) * h)  # noqa: E731

    def through_layer(n, x):
        return nnx.grad(lambda n, x: loss(*layer(x, norm=n, keep_input=True)), argnums=(1, 0))(n, x)

    def direct(impl):
        kernel = layer.kernel[...]
        fn = lambda x, s: loss(*fp8_matmul(x, kernel, None, recipe, kernel.dtype, prologue="rmsnorm", norm_scale=s, norm_implementation=impl, keep_input=True))  # noqa: E731
        return jax.grad(fn, argnums=(0, 1))(x, norm.scale[...].astype(jnp.bfloat16))

    def check_same(got, want):
        dx, dnorm = got
        for a, b in zip((dx, dnorm.scale[...]), want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = through_layer(norm, x)
        assert len(traced) == kernel_calls
        check_same(got, direct(implementation))
    traced.clear()
    check_same(through_layer(flax_norm, x), direct("xla"))
    assert not traced
