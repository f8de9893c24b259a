"""The RMSNorm kernels (Pallas interpreter on the CPU) against the jnp reference, and the reference against flax's
`nnx.RMSNorm`: outputs and the gradients of x and the scale, within one ulp of their dtype plus the float32 error of
summing in another order (bounds in tests/support/rms_norm_bounds.py, shared with benchmarks/rms_norm_bench.py), on
fresh random inputs each run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from jax.experimental.pallas import mosaic_gpu as plgpu
from rms_norm_bounds import bound_fractions
from tolerances import check
from stand_in_gpu import Hopper

from pallas_kernels import ImplementationUnavailableError, compiling_for, describe_choice, rms_norm
from pallas_kernels.rms_norm import kernel, ops, reference, rms_norm_backward

EPS = 1e-6


def _inputs(shape, dtype, seed):
    """x with row magnitudes spread over orders, a scale near 1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(2.0 * rng.standard_normal(shape[:-1] + (1,)))
    return jnp.asarray(x, dtype), jnp.asarray(1 + 0.2 * rng.standard_normal(shape[-1]), jnp.float32)


def _cotangents(shape, out_dtype, in_dtype, seed, with_input):
    rng = np.random.default_rng(seed + 1)
    dy = jnp.asarray(rng.standard_normal(shape), out_dtype)
    return (dy, jnp.asarray(rng.standard_normal(shape), in_dtype)) if with_input else (dy, None)


def _run(implementation, x, scale, cotangents, dtype=None, eps=EPS, **kwargs):
    """`(y, (dx, dscale))` for `cotangents` `(dy, dx_in)` (`dx_in` None: the input is not passed through)."""
    dy, dx_in = cotangents
    with_input = dx_in is not None

    def fn(x, scale):
        return rms_norm(x, scale, eps=eps, dtype=dtype, return_input=with_input, implementation=implementation, **kwargs)

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        outs, vjp = jax.vjp(jax.jit(fn), x, scale)
        grads = jax.jit(vjp)((dy, dx_in) if with_input else dy)
    if with_input:
        np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(x))  # passed through unchanged
        outs = outs[0]
    return outs, grads


def _flat(result):
    """`(y, (dx, dscale))` with y and dx as `[N, d]`."""
    y, (dx, dscale) = result
    return y.reshape(-1, y.shape[-1]), (dx.reshape(-1, dx.shape[-1]), dscale)


def _assert_close(got, want, x, scale, cotangents, what="", eps=EPS):
    flat = lambda a: None if a is None else a.reshape(-1, a.shape[-1])  # noqa: E731
    fractions = bound_fractions(_flat(got), _flat(want), (flat(x), scale), tuple(flat(c) for c in cotangents), eps)
    for name, (_, fraction) in fractions.items():
        check(f"{what}{name}", fraction, 1.0)


@pytest.mark.parametrize("with_input", [False, True])
@pytest.mark.parametrize(
    "shape, dtype, out_dtype, tile",
    [
        ((70, 64), jnp.bfloat16, jnp.bfloat16, kernel.TILE),  # N not a multiple of the kernel's rows
        ((70, 32), jnp.float32, jnp.float32, kernel.TILE),
        ((64, 16), jnp.float32, jnp.bfloat16, kernel.TILE),  # whole tiles; float32 x, bf16 y; the least d
        ((1, 1024), jnp.bfloat16, jnp.bfloat16, kernel.TILE),  # a single row, the GEM width
        ((3, 7, 128), jnp.bfloat16, jnp.float32, kernel.TILE),  # three axes; float32 y (dtype=None for bf16 x, f32 scale)
        ((70, 256), jnp.bfloat16, jnp.bfloat16, (16, 8)),  # 16-row tiles (a masked last one), 8 warps
    ],
)
def test_kernel_matches_reference_forward_and_gradients(shape, dtype, out_dtype, tile, with_input):
    seed = int(np.random.default_rng().integers(1 << 31))
    x, scale = _inputs(shape, dtype, seed)
    cts = _cotangents(shape, out_dtype, dtype, seed, with_input)
    got = _run("pallas", x, scale, cts, dtype=out_dtype, tile=tile)
    want = _run("xla", x, scale, cts, dtype=out_dtype)
    assert got[0].dtype == out_dtype and got[0].shape == shape
    assert got[1][0].dtype == dtype and got[1][0].shape == shape and got[1][1].dtype == jnp.float32
    _assert_close(got, want, x, scale, cts, f"seed {seed}: ")


def test_a_wider_output_dtype_reads_x_as_it_is_and_a_narrower_one_rounds_it_first():
    """bf16 x with a float32 norm: no cast before the kernels (widening changes no value), so the input passes
    through them; float32 x with a bf16 norm: x rounded to bf16 first, as flax's promote_dtype does."""
    x, scale = _inputs((40, 64), jnp.bfloat16, 7)

    def kernel_call(x, dtype):
        """The kernels' custom VJP: its operands' dtypes and its outputs (2: x passed through it)."""
        jaxpr = jax.make_jaxpr(lambda x: rms_norm(x, scale, dtype=dtype, return_input=True, implementation="pallas"))(x)
        (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
        return [str(v.aval.dtype) for v in call.invars], len(call.outvars)

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        assert kernel_call(x, jnp.float32) == (["bfloat16", "float32"], 2)  # x as it is, passed through the kernels
        assert kernel_call(x.astype(jnp.float32), jnp.bfloat16) == (["bfloat16", "float32"], 1)  # rounded first; autodiff sums
        assert kernel_call(x, jnp.bfloat16) == (["bfloat16", "float32"], 2)


def test_backward_walks_several_tiles_a_program():
    """With fewer programs than row tiles each program sums the scale gradient of several tiles (the last ones
    past the end, masked): the same results within the bounds."""
    seed = int(np.random.default_rng().integers(1 << 31))
    x, scale = _inputs((70, 64), jnp.bfloat16, seed)
    scale = scale.astype(jnp.bfloat16).astype(jnp.float32)  # the op's cast, as flax's
    dy, dx_in = _cotangents((70, 64), jnp.bfloat16, jnp.bfloat16, seed, True)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        dx, dscale = jax.jit(lambda *a: kernel.backward(*a, eps=EPS, tile=kernel.TILE, programs=5, interpret=True))(x, scale, dy, dx_in)
    want = _run("xla", x, scale, (dy, dx_in), dtype=jnp.bfloat16)
    y = rms_norm(x, scale, dtype=jnp.bfloat16, implementation="xla")
    for name, (_, fraction) in bound_fractions((y, (dx, dscale)), want, (x, scale), (dy, dx_in), EPS).items():
        check(f"seed {seed}: {name}", fraction, 1.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_is_flax_rms_norm_bit_for_bit(dtype):
    """The "xla" path: flax's `nnx.RMSNorm` values and autodiff gradients, bit for bit, with dtype None and set."""
    x, scale = _inputs((40, 64), jnp.bfloat16, 3)
    for out_dtype in (None, dtype):
        graphdef, state = nnx.split(nnx.RMSNorm(64, epsilon=EPS, dtype=out_dtype, rngs=nnx.Rngs(0)))

        def flax_norm(x, s, graphdef=graphdef, state=state):
            return nnx.merge(graphdef, jax.tree.map(lambda _: s, state))(x)  # the scale is the state's one leaf

        ours = lambda x, s, out_dtype=out_dtype: rms_norm(x, s, eps=EPS, dtype=out_dtype, implementation="xla")  # noqa: E731
        a, vjp_a = jax.vjp(flax_norm, x, scale)
        b, vjp_b = jax.vjp(ours, x, scale)
        assert a.dtype == b.dtype
        ct = jnp.asarray(np.random.default_rng(4).standard_normal(a.shape), a.dtype)
        for u, v in zip((a, *vjp_a(ct)), (b, *vjp_b(ct))):
            assert u.dtype == v.dtype and np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_eps_zero_with_a_masked_last_tile():
    """eps = 0 with N not a multiple of the tile: the masked rows, read as zeros, have an infinite rsqrt and must
    not reach the scale gradient; a real all-zero row is NaN in both paths."""
    seed = int(np.random.default_rng().integers(1 << 31))
    x, scale = _inputs((70, 32), jnp.float32, seed)
    cts = _cotangents((70, 32), jnp.float32, jnp.float32, seed, False)
    got, want = _run("pallas", x, scale, cts, eps=0.0), _run("xla", x, scale, cts, eps=0.0)
    _assert_close(got, want, x, scale, cts, f"seed {seed}: ", eps=0.0)
    zero = x.at[5].set(0.0)
    for y, (dx, dscale) in (_run("pallas", zero, scale, cts, eps=0.0), _run("xla", zero, scale, cts, eps=0.0)):
        assert np.isnan(np.asarray(y)[5]).all() and np.isfinite(np.asarray(y)[np.arange(70) != 5]).all()
        assert np.isnan(np.asarray(dscale)).all()


def test_no_rows():
    """N = 0 runs the reference (the kernels take at least one row), under "pallas" too."""
    x, scale = _inputs((0, 64), jnp.bfloat16, 0)
    assert not kernel.kernel_takes(x.shape, x.dtype)
    cts = (jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 64), jnp.bfloat16))
    y, (dx, dscale) = _run("pallas", x, scale, cts, dtype=jnp.bfloat16)
    assert y.shape == dx.shape == (0, 64)
    np.testing.assert_array_equal(np.asarray(dscale), np.zeros(64))


@pytest.mark.parametrize("with_input", [False, True])
def test_nan_rows_stay_in_their_rows(with_input):
    """NaN-poisoned rows (as a capacity's slack rows may hold) poison their own y and dx only, as in the reference;
    the scale gradient sums every row, so it is NaN in both paths. The clean rows match within their bounds."""
    seed = int(np.random.default_rng().integers(1 << 31))
    x, scale = _inputs((70, 64), jnp.bfloat16, seed)
    poisoned = [3, 40, 69]  # in the first, a middle and the (masked) last tile
    x = x.at[poisoned, 7].set(jnp.nan)
    cts = _cotangents((70, 64), jnp.bfloat16, jnp.bfloat16, seed, with_input)
    got, want = _run("pallas", x, scale, cts, dtype=jnp.bfloat16), _run("xla", x, scale, cts, dtype=jnp.bfloat16)
    clean = np.setdiff1d(np.arange(70), poisoned)
    for y, (dx, dscale) in (got, want):
        assert np.isnan(np.asarray(y, np.float32)[poisoned]).all() and np.isnan(np.asarray(dx, np.float32)[poisoned]).all()
        assert np.isfinite(np.asarray(y, np.float32)[clean]).all() and np.isfinite(np.asarray(dx, np.float32)[clean]).all()
        assert np.isnan(np.asarray(dscale)).all()
    pick = lambda r: (r[0][clean], (r[1][0][clean], r[1][1]))  # noqa: E731
    fractions = bound_fractions(pick(got), pick(want), (x[clean], scale), tuple(None if c is None else c[clean] for c in cts), EPS)
    del fractions["dscale"]  # NaN in both paths (above)
    for name, (_, fraction) in fractions.items():
        check(f"seed {seed}: {name}", fraction, 1.0)


@pytest.mark.parametrize("with_input", [False, True])
def test_residuals_are_the_inputs(with_input):
    """The backward keeps x and the scale: no normalised copy, no float32 statistic."""
    x, scale = _inputs((40, 64), jnp.bfloat16, 0)

    def loss(x, scale):
        out = rms_norm(x, scale, dtype=jnp.bfloat16, return_input=with_input, implementation="pallas")
        return sum(jnp.sum(o.astype(jnp.float32)) for o in (out if with_input else (out,)))  # linear: no residual of its own

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        kept = sorted((a.shape, str(a.dtype)) for a, _ in saved_residuals(loss, x, scale))
    assert ((40, 64), "bfloat16") in kept and ((64,), "float32") in kept
    assert not [k for k in kept if k[0] == (40, 64) and k[1] == "float32"] and not [k for k in kept if k[0] in ((40, 1), (40,))]


def test_bad_inputs_are_named():
    x, scale = _inputs((8, 32), jnp.bfloat16, 0)
    cases = [
        ((x.astype(jnp.int32), scale), {}, r"x must be a floating array \[..., d\], got \(8, 32\) int32"),
        ((jnp.float32(1.0), scale), {}, r"x must be a floating array \[..., d\], got \(\)"),
        ((x, scale[:16]), {}, r"scale must be a floating \[32\] \(x's last axis\), got \(16,\)"),
        ((x, scale.astype(jnp.int32)), {}, r"scale must be a floating \[32\].*int32"),
        ((x, scale), {"eps": -1e-6}, "eps must be a finite non-negative Python number"),
        ((x, scale), {"eps": float("nan")}, "eps must be a finite non-negative Python number"),
        ((x, scale), {"eps": jnp.float32(1e-6)}, "eps must be a finite non-negative Python number"),
        ((x, scale), {"dtype": jnp.int8}, r"dtype must be a floating dtype \(or None: x's and scale's promoted dtype\)"),
        ((x, scale), {"implementation": "bogus"}, "unknown implementation"),
        ((x, scale), {"implementation": "cudnn"}, "rms_norm has no cuDNN implementation"),
        ((x, scale), {"tile": (6, 4)}, r"rms_norm: tile must be \(rows, warps\), both powers of two, got \(6, 4\)"),
        ((x, scale), {"tile": (2, 64)}, r"rms_norm: tile \(2, 64\) asks for 64 warps; a Triton program runs at most 32"),
        ((x, scale), {"return_input": "no"}, "rms_norm: return_input must be True or False, got 'no'"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            rms_norm(*args, **kwargs)


def test_dispatch_and_inputs_the_kernel_takes():
    x, scale = _inputs((8, 32), jnp.bfloat16, 0)
    with pytest.raises(ImplementationUnavailableError, match="rms_norm: .*no Hopper GPU"):
        rms_norm(x, scale, implementation="pallas")
    np.testing.assert_array_equal(np.asarray(rms_norm(x, scale)), np.asarray(reference.rms_norm(x, scale, EPS, jnp.float32)))
    assert describe_choice("rms_norm", jnp.bfloat16, 1024).implementation.value == "xla"  # None on the CPU: the reference
    assert ops.SUPPORT.kernel_problem([jnp.bfloat16], 1536) == f"the kernels take width in {kernel.KERNEL_WIDTHS}, got 1536"
    assert kernel.default_tile(16) == kernel.default_tile(1024) == (4, 4) and kernel.default_tile(4096) == (4, 16)
    assert kernel.kernel_takes((166_528, 1024), jnp.bfloat16) and kernel.kernel_takes((1, 16), jnp.float32)
    assert kernel.kernel_takes((4, 4, 4096), jnp.bfloat16)
    for shape, dtype in [
        ((5, 1536), jnp.bfloat16), ((5, 8), jnp.bfloat16), ((5, 8192), jnp.bfloat16),  # d outside the powers of two 16..4096
        ((5, 64), jnp.float16), ((2_200_000, 1024), jnp.bfloat16), ((0, 1024), jnp.bfloat16), ((), jnp.bfloat16),
    ]:
        assert not kernel.kernel_takes(shape, dtype), (shape, dtype)
    # Under "pallas" an input the kernel does not take (d = 48, or 1536: wider than 1024 but no power of two) runs
    # the reference.
    for d in (48, 1536):
        xd, sd = _inputs((8, d), jnp.bfloat16, 0)
        got = _run("pallas", xd, sd, (jnp.ones((8, d), jnp.float32), None))
        want = _run("xla", xd, sd, (jnp.ones((8, d), jnp.float32), None))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _backward_alone(implementation, x, scale, dy, dx_in, eps=EPS):
    """`rms_norm_backward` jitted, in the interpreter (the kernel path on the CPU)."""
    fn = lambda x, scale, dy, dx_in: rms_norm_backward(x, scale, dy, dx_in, eps=eps, implementation=implementation)  # noqa: E731
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return jax.jit(fn)(x, scale, dy, dx_in)


def _float64_backward(x, scale, dy, dx_in):
    """`(dx, dscale)` of `y = x * rsqrt(mean(x**2) + eps) * scale` in float64, written out (module docstring of kernel.py)."""
    x, s, dy = (np.asarray(a, np.float64) for a in (x, scale, dy))
    inv = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    xhat, gw = x * inv, dy * s
    dx = inv * (gw - xhat * np.mean(gw * xhat, axis=-1, keepdims=True))
    if dx_in is not None:
        dx = dx + np.asarray(dx_in, np.float64)
    return dx, (dy * xhat).reshape(-1, x.shape[-1]).sum(0)


@pytest.mark.parametrize("with_input", [False, True])
@pytest.mark.parametrize(
    "shape, dtype, scale_dtype",
    [((70, 64), jnp.bfloat16, jnp.float32), ((70, 64), jnp.bfloat16, jnp.bfloat16), ((3, 7, 128), jnp.float32, jnp.float32), ((1, 1024), jnp.bfloat16, jnp.float32)],
)
def test_backward_alone_matches_the_float64_gradients(shape, dtype, scale_dtype, with_input):
    """`rms_norm_backward`, the backward of a norm computed elsewhere (an FP8 quantization's prologue), on both paths
    against the gradient written out in float64, within the kernels' bounds (one ulp of x's dtype and the float32 sums'
    order), dx_in added before the rounding; a bf16 gain (the FP8 layer's) gets its gradient in bf16. Rows not a
    multiple of the kernel's, a single row at the GEM width, fresh random inputs."""
    seed = int(np.random.default_rng().integers(1 << 31))
    x, scale = _inputs(shape, dtype, seed)
    scale = scale.astype(scale_dtype)
    dy, dx_in = _cotangents(shape, jnp.bfloat16, dtype, seed, with_input)
    exact_dx, exact_dscale = _float64_backward(x, scale, dy, dx_in)
    flat = lambda a: None if a is None else np.asarray(a).reshape(-1, shape[-1])  # noqa: E731
    y = np.zeros((flat(x).shape[0], shape[-1]), np.float32)  # no forward here: y's fraction is 0 by construction
    for implementation in ("pallas", "xla"):
        dx, dscale = _backward_alone(implementation, x, scale, dy, dx_in)
        assert dx.dtype == dtype and dx.shape == shape and dscale.dtype == scale_dtype
        got = (y, (flat(dx), np.asarray(dscale, np.float64)))
        fractions = bound_fractions(got, (y, (flat(exact_dx), exact_dscale)), (flat(x), scale.astype(jnp.float32)), (flat(dy), flat(dx_in)), EPS)
        if scale_dtype == jnp.bfloat16:  # a float32 sum rounded once to bf16: within its unit roundoff (and the sum's order)
            del fractions["dscale"]
            np.testing.assert_allclose(np.asarray(dscale, np.float64), exact_dscale, rtol=2.0**-7)
        for name, (_, fraction) in fractions.items():
            check(f"{implementation}, seed {seed}: {name}", fraction, 1.0)


def test_backward_alone_keeps_nan_rows_in_their_rows_and_takes_no_rows():
    """A NaN-poisoned row's dx is NaN in its row only (the scale gradient sums every row: NaN); no rows run the
    reference under "pallas" too; a cotangent of another shape is named."""
    seed = int(np.random.default_rng().integers(1 << 31))
    x, scale = _inputs((70, 64), jnp.bfloat16, seed)
    x = x.at[[3, 69], 5].set(jnp.nan)
    dy, dx_in = _cotangents((70, 64), jnp.bfloat16, jnp.bfloat16, seed, True)
    clean = np.setdiff1d(np.arange(70), [3, 69])
    for dx, dscale in (_backward_alone(impl, x, scale, dy, dx_in) for impl in ("pallas", "xla")):
        dx = np.asarray(dx, np.float32)
        assert np.isnan(dx[[3, 69]]).all() and np.isfinite(dx[clean]).all() and np.isnan(np.asarray(dscale)).all()
    none = jnp.zeros((0, 64), jnp.bfloat16)
    dx, dscale = _backward_alone("pallas", none, scale, none, none)
    assert dx.shape == (0, 64)
    np.testing.assert_array_equal(np.asarray(dscale), np.zeros(64))
    with pytest.raises(ValueError, match=r"rms_norm_backward: dx_in must have x's shape \(70, 64\), got \(70, 32\)"):
        rms_norm_backward(x, scale, dy, dx_in[:, :32])


def test_backward_alone_under_shard_map_types_the_gains_gradient_like_the_gain():
    """Inside shard_map, rows sharded and the gain replicated (the FP8 layer's prologue in the sharded step): the kernel
    runs and the gain's gradient is typed like the gain (its partial sums summed over the rows' axis). Traced only."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("gpu",))
    x, scale = _inputs((40, 64), jnp.bfloat16, 0)
    dy, dx_in = _cotangents((40, 64), jnp.bfloat16, jnp.bfloat16, 0, True)
    specs = (P("gpu"), P(), P("gpu"), P("gpu"))
    f = jax.jit(jax.shard_map(lambda *a: rms_norm_backward(*a, eps=EPS), mesh=mesh, in_specs=specs, out_specs=(P("gpu"), P())))
    with compiling_for(Hopper()):
        traced = f.trace(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, scale, dy, dx_in), specs)))
    assert [o.sharding.spec for o in traced.out_info] == [P("gpu", None), P(None)]
    assert str(traced.jaxpr).count("pallas_call") == 1
