"""The one-pass 1x128 quantize kernel (Pallas interpreter on the CPU) against the jnp reference, bit for bit
(codes one apart where the two compute a value in other float32 orders: bounded by tests/support/tolerances.py's
`flip_probability`; measured: benchmarks/tolerances.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P
from tolerances import check, flip_probability, sum_worst

from pallas_kernels import ImplementationUnavailableError, describe_choice
from pallas_kernels.mxfp8 import Fp8Recipe, Prologue, fp8_matmul, gelu_quantize_mxfp8, kernel_quantize, quantize_mxfp8, reference
from pallas_kernels.mxfp8 import rmsnorm_quantize_mxfp8
from pallas_kernels.mxfp8.ops import quantize_kernel_takes

OPS = {  # (x, gain or bias, implementation, Hadamard signs or None)
    "none": lambda x, g, impl, s=None: quantize_mxfp8(x, block=(1, 128), hadamard_signs=s, implementation=impl),
    "rmsnorm": lambda x, g, impl, s=None: rmsnorm_quantize_mxfp8(x, g, eps=1e-6, block=(1, 128), hadamard_signs=s, implementation=impl),
    "gelu": lambda x, g, impl, s=None: gelu_quantize_mxfp8(x, block=(1, 128), hadamard_signs=s, implementation=impl),
    "gelu_bias": lambda x, g, impl, s=None: gelu_quantize_mxfp8(x, bias=g, block=(1, 128), hadamard_signs=s, implementation=impl),
}


def _bytes(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _assert_same(op, got, want, rotated=False):
    """Bit for bit; the GELU's tanh may differ by an ulp between the kernel and XLA, which moves
    an element to the neighbouring E4M3 value now and then (same sign, one code apart).

    With a Hadamard rotation the kernel's dot may sum in another order than XLA's: data one
    code apart as for the GELU, and now and then a scale one step apart where a tile's amax
    sits at a scale boundary (that tile's data is then scaled by another power of two and is
    not compared byte by byte).
    """
    sa, sb = _bytes(got[1]).astype(np.int32), _bytes(want[1]).astype(np.int32)
    scale_differ = sa != sb
    # A rotated value is a 128-term float32 sum: two orders differ by at most gamma_128 = 7.6e-6 of it (over the sum
    # of |terms|, ~sqrt(128) x the value for random signs), so an amax crosses a power of two with probability
    # ~ that relative change (tolerances.flip_probability for a 1-bit grid): 1e-3 is >10x the expected rate.
    assert scale_differ.mean() <= (1e-3 if rotated else 0), scale_differ.mean()
    assert np.all(np.abs(sa - sb)[scale_differ] == 1)
    a, b = _bytes(got[0]).astype(np.int32), _bytes(want[0]).astype(np.int32)
    if not (op.startswith("gelu") or rotated):
        np.testing.assert_array_equal(a, b)
        return
    differ = (a != b) & np.repeat(~scale_differ, 128, axis=1)[:, : a.shape[1]]
    # flip_probability(change) <= 4 change / 2^-3: 32 x (an ulp of tanh, ~1e-7; or the rotation's ~1e-5) = 3e-4 at most.
    check("share of codes one apart", float(differ.mean()), flip_probability(sum_worst(128) * np.sqrt(128)))
    assert np.all(np.abs(a - b)[differ] == 1) and np.all((a >> 7)[differ] == (b >> 7)[differ])


def _kernel(op, x, g, signs=None):
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return jax.jit(lambda x, g: OPS[op](x, g, "pallas", signs))(x, g)


def _fresh(shape, seed, dtype=jnp.bfloat16):
    """Normal values with row magnitudes spread over several orders (token-norm spread)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, shape) * jnp.exp(3.0 * jax.random.normal(k2, (shape[0], 1)))
    return x.astype(dtype), jax.random.normal(k3, (shape[1],))


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize(
    "shape, dtype, rotated",
    [((200, 512), jnp.bfloat16, False), ((1, 128), jnp.bfloat16, False), ((65, 256), jnp.float32, False)]
    + [((1, 128), jnp.bfloat16, True), ((65, 256), jnp.float32, True)],  # with the random Hadamard rotation
)
def test_kernel_matches_reference_bit_for_bit(op, shape, dtype, rotated):
    x, g = _fresh(shape, seed=sum(shape) + len(op), dtype=dtype)  # rows not a multiple of the kernel's 64
    signs = reference.random_signs(jax.random.key(len(op)), shape[1]) if rotated else None
    got, want = _kernel(op, x, g, signs), OPS[op](x, g, "xla", signs)
    assert got[0].dtype == jnp.float8_e4m3fn and got[1].dtype == jnp.float8_e8m0fnu
    assert got[0].shape == shape and got[1].shape == (shape[0], shape[1] // 128)
    _assert_same(op, got, want, rotated)


@pytest.mark.parametrize("op, rotated", [(op, False) for op in sorted(OPS)] + [("none", True), ("rmsnorm", True), ("gelu_bias", True)])
def test_poisoned_slack_rows_and_edge_values(op, rotated):
    """Poison stays in its row tile; with the rotation an Inf or NaN spreads over its 128-block,
    which is the tile it poisons anyway (an Inf poisons it as the reference does, NaN data, byte 255)."""
    x, g = _fresh((130, 256), seed=7)
    x = x.at[64:].set(jnp.nan)  # slack rows past the real tokens, NaN-poisoned
    x = x.at[1, 5].set(jnp.inf).at[2, :128].set(0.0).at[3, 130].set(1e-38).at[4, 3].set(3e4)
    signs = reference.random_signs(jax.random.key(5), 256) if rotated else None
    (data, scales), want = _kernel(op, x, g, signs), OPS[op](x, g, "xla", signs)
    _assert_same(op, (data, scales), want, rotated)
    if rotated and op == "none":  # the Inf's tile (row 1, block 0) alone is poisoned in its row
        assert _bytes(scales)[1, 0] == 255 and _bytes(scales)[1, 1] != 255
    byte = _bytes(scales)
    assert np.all(byte[64:] == 255) and np.all(np.isnan(np.asarray(data[64:].astype(jnp.float32))))
    assert np.all(byte[5:64] != 255)  # real rows stay finite: poison never leaks across rows
    assert np.all(np.isfinite(np.asarray(data[5:64].astype(jnp.float32))))


def test_zero_rows_and_other_tiles_take_the_reference():
    x, g = _fresh((70, 200), seed=3)  # C not a multiple of 128: the reference under "pallas"
    for op in OPS:
        _assert_same(op, _kernel(op, x, g), OPS[op](x, g, "xla"))
    empty = jnp.zeros((0, 256), jnp.bfloat16)
    for signs in (None, reference.random_signs(jax.random.key(0), 256)):
        data, scales = _kernel("gelu", empty, jnp.ones((256,)), signs)
        assert data.shape == (0, 256) and scales.shape == (0, 2)
    data, scales = _kernel("none", jnp.zeros((4, 0), jnp.bfloat16), jnp.ones((0,)))  # zero width
    assert data.shape == (4, 0) and scales.shape == (4, 0)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):  # 32x32 tiles: the reference
        d32, _ = quantize_mxfp8(x[:, :128], block=(32, 32), implementation="pallas")
    np.testing.assert_array_equal(_bytes(d32), _bytes(reference.quantize(x[:, :128], block=(32, 32))[0]))


def test_inputs_the_kernel_takes():
    bf16, f16 = jnp.bfloat16, jnp.float16
    assert quantize_kernel_takes((200, 512), bf16, (1, 128), "nearest")
    assert quantize_kernel_takes((65, 1024), jnp.float32, [1, 128], "nearest")
    assert not quantize_kernel_takes((524_288, 4096), bf16, (1, 128), "nearest")  # 2**31 elements: 32-bit offsets
    assert quantize_kernel_takes((524_287, 4096), bf16, (1, 128), "nearest")
    for shape, dtype, block, rounding in [
        ((0, 256), bf16, (1, 128), "nearest"),
        ((4, 0), bf16, (1, 128), "nearest"),
        ((4, 200), bf16, (1, 128), "nearest"),
        ((4, 256), f16, (1, 128), "nearest"),
        ((4, 256), jnp.int32, (1, 128), "nearest"),
        ((4, 256), bf16, (32, 32), "nearest"),
        ((4, 256), bf16, (1, 128), "stochastic"),
        ((256,), bf16, (1, 128), "nearest"),
    ]:
        assert not quantize_kernel_takes(shape, dtype, block, rounding), (shape, dtype, block, rounding)


@pytest.mark.parametrize("op", ["quantize_mxfp8", "rmsnorm_quantize_mxfp8", "gelu_quantize_mxfp8"])
def test_implementation_is_checked_for_every_input(op):
    x32 = jnp.ones((64, 64))  # 32x32 tiles: the reference whichever name is given, but names still checked
    fn = {
        "quantize_mxfp8": lambda impl: quantize_mxfp8(x32, implementation=impl),
        "rmsnorm_quantize_mxfp8": lambda impl: rmsnorm_quantize_mxfp8(x32, jnp.ones((64,)), implementation=impl),
        "gelu_quantize_mxfp8": lambda impl: gelu_quantize_mxfp8(x32, implementation=impl),
    }[op]
    with pytest.raises(ValueError, match="unknown implementation"):
        fn("bogus")
    with pytest.raises(ValueError, match=f"{op} has no cuDNN implementation"):
        fn("cudnn")
    with pytest.raises(ImplementationUnavailableError, match=f"{op}: .*no Hopper GPU"):
        fn("pallas")
    np.testing.assert_array_equal(_bytes(fn(None)[0]), _bytes(fn("xla")[0]))  # None on the CPU: the reference
    assert describe_choice(op, jnp.bfloat16).implementation.value == "xla"


def test_scale_exponent_from_bits_matches_the_reference_rule():
    amax = jnp.array([0.0, 1e-45, 1e-38, 448 * 2.0**-126, 1.0, 448.0, 449.0, 447.9, 896.0, 1.75 * 2**20, 1.76 * 2**20, 3e38])
    np.testing.assert_array_equal(np.asarray(kernel_quantize._scale_exponent(amax)), np.asarray(reference.formats.scale_exponent(amax)))


def test_rmsnorm_kernel_refuses_missing_operands():
    with pytest.raises(ValueError, match="come with Kind.RMSNORM, and only with it; got None and None"):
        kernel_quantize.quantize_rows(jnp.zeros((4, 128)), kernel_quantize.Kind.RMSNORM, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel_quantize.quantize_rows(jnp.zeros((4, 100)), interpret=True)
    with pytest.raises(ValueError, match="bias comes with Kind.GELU only"):
        kernel_quantize.quantize_rows(jnp.zeros((4, 128)), bias=jnp.zeros((128,)), interpret=True)
    with pytest.raises(ValueError, match="only with it"):
        kernel_quantize.quantize_rows(jnp.zeros((4, 128)), kernel_quantize.Kind.GELU, gain=jnp.ones((128,)), interpret=True)
    with pytest.raises(ValueError, match=r"bias must be \[128\] for x \(4, 128\), got \(64,\)"):
        gelu_quantize_mxfp8(jnp.zeros((4, 128)), bias=jnp.zeros((64,)), block=(1, 128))
    with pytest.raises(ValueError, match="x must be 2-D"):
        gelu_quantize_mxfp8(jnp.zeros((128,)), bias=jnp.zeros((128,)), block=(1, 128))


def test_hadamard_signs_are_checked_by_each_op():
    x = jnp.zeros((4, 256))
    with pytest.raises(ValueError, match=r"quantize_rows: hadamard_signs must be \[256\] \(one sign per column\), got \(128,\)"):
        kernel_quantize.quantize_rows(x, hadamard_signs=jnp.ones((128,)), interpret=True)
    for op in OPS:
        name = {"none": "quantize_mxfp8", "rmsnorm": "rmsnorm_quantize_mxfp8"}.get(op, "gelu_quantize_mxfp8")
        with pytest.raises(ValueError, match=f"{name}: hadamard_signs must be \\[256\\]"):
            OPS[op](x, jnp.ones((256,)), "xla", jnp.ones((255,)))
    with pytest.raises(ValueError, match="quantize_mxfp8: the Hadamard rotation needs 96 columns in whole power-of-two blocks"):
        quantize_mxfp8(jnp.zeros((4, 96)), block=(1, 128), hadamard_signs=jnp.ones((96,)))


@pytest.mark.parametrize(
    "prologue, hadamard", [(p, False) for p in ("none", "rmsnorm", "gelu", "gelu_bias")] + [("none", True), ("rmsnorm", True), ("gelu_bias", True)]
)
def test_fp8_layer_forward_and_gradients_through_the_kernel(prologue, hadamard):
    """The FP8 layer with the kernel quantizing its input and output gradient equals the jnp path
    (with `hadamard`, the kernel rotates the input in the same pass)."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(11), 4)
    x = jax.random.normal(k1, (72, 256))  # tokens not a multiple of the kernel's rows
    w = jax.random.normal(k2, (256, 128)) / 16
    g = jax.random.normal(k3, (72, 128))
    scale = 1 + 0.1 * jax.random.normal(k4, (256,)) if prologue in ("rmsnorm", "gelu_bias") else None
    outs = {}
    for impl in ("xla", "pallas"):
        recipe = Fp8Recipe(block=128, implementation=impl, hadamard=hadamard)

        def loss(x, w, s, r=recipe):
            param = {"norm_scale": s} if prologue == "rmsnorm" else {"input_bias": s}
            y = fp8_matmul(x, w, None, r, w.dtype, prologue=Prologue(prologue.removesuffix("_bias")), **param)
            return jnp.sum(y * g)

        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            outs[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2) if scale is not None else (0, 1)))(x, w, scale)
    for got, want in zip(jax.tree.leaves(outs["pallas"]), jax.tree.leaves(outs["xla"])):
        # The same quantized operands (codes one apart at most, as above) and float32 sums of <= 256 terms in
        # their own orders; measured ~1e-7.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_kernel_results_vary_like_the_input_under_shard_map():
    mesh = jax.make_mesh((1,), ("gpu",))
    x = jax.device_put(jnp.ones((128, 256), jnp.bfloat16), jax.sharding.NamedSharding(mesh, P("gpu")))

    def body(x, g):
        inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1) + 1e-6)
        return kernel_quantize.quantize_rows(x, kernel_quantize.Kind.RMSNORM, inv_rms=inv_rms, gain=g)

    f = jax.jit(lambda x, g: jax.shard_map(body, mesh=mesh, in_specs=(P("gpu"), P()), out_specs=(P("gpu"), P("gpu")))(x, g))
    data, scales = f.trace(x, jnp.ones((256,))).out_info  # typed (traced) without a GPU to lower for
    assert data.shape == (128, 256) and scales.shape == (128, 2) and data.sharding.spec == P("gpu", None)
