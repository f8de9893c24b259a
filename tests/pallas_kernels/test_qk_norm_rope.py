"""The QK-norm + RoPE kernels (Pallas interpreter on the CPU) against the jnp reference: outputs and the
gradients of qkv and both scales, within one ulp of the output dtype plus the float32 error of summing the
mean squares in another order (bounds in tests/support/qk_norm_rope_bounds.py, shared with
benchmarks/qk_norm_rope_bench.py), on fresh random inputs each run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.experimental.pallas import mosaic_gpu as plgpu
from qk_norm_rope_bounds import bound_fractions
from tolerances import check
from stand_in_gpu import Hopper

import pallas_kernels
from pallas_kernels import ImplementationUnavailableError, describe_choice, qk_norm_rope
from pallas_kernels.block_local_attention.reference import rope_frequencies
from pallas_kernels.qk_norm_rope import kernel

EPS = 1e-6


def _inputs(t, h, d, dtype, seed):
    """qkv `[T, 3, H, D]` with token magnitudes spread over orders, scales near 1, the RoPE table of random positions."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((t, 3, h, d)) * np.exp(2.0 * rng.standard_normal((t, 1, 1, 1)))
    scales = [jnp.asarray(1 + 0.2 * rng.standard_normal(d), jnp.float32) for _ in range(2)]
    angles = jnp.asarray(rng.integers(0, 4096, t), jnp.float32)[:, None, None] * rope_frequencies(d, 10_000.0)
    return jnp.asarray(qkv, dtype), *scales, jnp.cos(angles), jnp.sin(angles)


def _run(implementation, qkv, q_scale, k_scale, cos, sin, cotangents, dtype=None, eps=EPS, **kwargs):
    """`(q, k, v)` and the cotangents of `(qkv, q_scale, k_scale)` for `cotangents` of `(q, k, v)`."""

    def fn(qkv, q_scale, k_scale):
        return qk_norm_rope(qkv, q_scale, k_scale, cos, sin, eps=eps, dtype=dtype, implementation=implementation, **kwargs)

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        outs, vjp = jax.vjp(jax.jit(fn), qkv, q_scale, k_scale)
        return outs, jax.jit(vjp)(cotangents)


def _cotangents(outs, seed):
    rng = np.random.default_rng(seed + 1)
    return tuple(jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in outs)


def _assert_close(got, want, inputs, cotangents, what=""):
    """Outputs and gradients within their bounds (`qk_norm_rope_bounds`: one ulp of their dtype plus twice
    Higham's gamma of the sums the two paths order differently times the magnitude of the terms; v and dv exact)."""
    for name, (_, fraction) in bound_fractions(got, want, inputs, cotangents, EPS).items():
        check(f"{what}{name}", fraction, 1.0)


@pytest.mark.parametrize(
    "t, h, d, dtype, out_dtype, tile",
    [
        (70, 2, 32, jnp.bfloat16, jnp.bfloat16, kernel.TILE),  # T not a multiple of the kernel's 16 rows
        (70, 2, 32, jnp.float32, jnp.float32, kernel.TILE),
        (64, 3, 16, jnp.float32, jnp.bfloat16, kernel.TILE),  # whole tiles; float32 projection, bf16 q and k; the least D
        (1, 8, 128, jnp.bfloat16, jnp.bfloat16, kernel.TILE),  # a single token, the GEM head shape
        (5, 1, 256, jnp.bfloat16, jnp.bfloat16, kernel.TILE),  # the largest D
        (70, 2, 32, jnp.bfloat16, jnp.bfloat16, (32, 8)),  # 32-row tiles (a masked last one), 8 warps
    ],
)
def test_kernel_matches_reference_forward_and_gradients(t, h, d, dtype, out_dtype, tile):
    seed = int(np.random.default_rng().integers(1 << 31))
    inputs = _inputs(t, h, d, dtype, seed)
    outs = jax.jit(lambda *a: qk_norm_rope(*a, eps=EPS, dtype=out_dtype, implementation="xla"))(*inputs)
    cts = _cotangents(outs, seed)
    got = _run("pallas", *inputs, cts, dtype=out_dtype, tile=tile)
    want = _run("xla", *inputs, cts, dtype=out_dtype)
    assert [o.dtype for o in got[0]] == [jnp.dtype(out_dtype)] * 2 + [jnp.dtype(dtype)]
    assert all(o.shape == (t, h, d) for o in got[0]) and got[1][0].shape == (t, 3, h, d) and got[1][0].dtype == dtype
    _assert_close(got, want, inputs, cts, f"seed {seed}: ")


def test_eps_zero_with_a_masked_last_tile():
    """eps = 0 (a valid setting) with T not a multiple of the tile: the masked rows, read as zeros, have an
    infinite rsqrt and must not reach the scale gradients, which match the reference's within their bounds;
    a real all-zero head is NaN in both paths."""
    seed = int(np.random.default_rng().integers(1 << 31))
    inputs = _inputs(70, 2, 32, jnp.float32, seed)
    cts = _cotangents(qk_norm_rope(*inputs, eps=0.0, implementation="xla"), seed)
    got, want = _run("pallas", *inputs, cts, eps=0.0), _run("xla", *inputs, cts, eps=0.0)
    for name, (_, fraction) in bound_fractions(got, want, inputs, cts, 0.0).items():
        check(f"seed {seed}: {name}", fraction, 1.0)
    qkv = inputs[0].at[5, 1, 0].set(0.0)  # token 5's first key head all zero
    for path in (_run("pallas", qkv, *inputs[1:], cts, eps=0.0), _run("xla", qkv, *inputs[1:], cts, eps=0.0)):
        assert np.isnan(np.asarray(path[0][1])[5, 0]).all() and np.isnan(np.asarray(path[1][2])).all()
        assert np.isfinite(np.asarray(path[1][1])).all()


def test_flat_projection_and_two_dimensional_table_give_the_same_results():
    """`qkv [T, 3*H*D]` with `heads`, and `cos`/`sin` `[T, D/2]`: the same call as `[T, 3, H, D]` and `[T, 1, D/2]`."""
    seed = int(np.random.default_rng().integers(1 << 31))
    qkv, qs, ks, cos, sin = _inputs(40, 2, 32, jnp.bfloat16, seed)
    outs = qk_norm_rope(qkv, qs, ks, cos, sin, implementation="xla")
    cts = _cotangents(outs, seed)
    shaped = _run("pallas", qkv, qs, ks, cos, sin, cts)
    flat = _run("pallas", qkv.reshape(40, -1), qs, ks, cos[:, 0], sin[:, 0], cts, heads=2)
    for a, b in zip(jax.tree.leaves(shaped), jax.tree.leaves(flat)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32).reshape(a.shape))


def test_no_tokens():
    """T = 0 runs the reference (the kernels take at least one token), under "pallas" too."""
    qkv, qs, ks, cos, sin = _inputs(0, 2, 32, jnp.bfloat16, 0)
    assert not kernel.kernel_takes(qkv.shape, qkv.dtype)
    cts = tuple(jnp.zeros((0, 2, 32), jnp.bfloat16) for _ in range(3))
    (q, k, v), (dqkv, dqs, dks) = _run("pallas", qkv, qs, ks, cos, sin, cts)
    assert q.shape == k.shape == v.shape == (0, 2, 32) and dqkv.shape == (0, 3, 2, 32)
    np.testing.assert_array_equal(np.asarray(dqs), np.zeros(32))
    np.testing.assert_array_equal(np.asarray(dks), np.zeros(32))


def test_nan_stays_in_its_token_and_head():
    """A NaN in one token's query head poisons that head's q and dq only, as in the reference; other tokens'
    outputs and gradients (and that token's other heads and its key) are unchanged; the q scale's gradient
    sums every token, so it is NaN in both paths, and the k scale's is not."""
    seed = int(np.random.default_rng().integers(1 << 31))
    qkv, qs, ks, cos, sin = _inputs(70, 2, 32, jnp.float32, seed)
    poisoned = [3, 40, 69]  # in the first, second and (masked) last tile
    qkv = qkv.at[poisoned, 0, 1, 5].set(jnp.nan)
    outs = qk_norm_rope(qkv, qs, ks, cos, sin, implementation="xla")
    cts = _cotangents(outs, seed)
    got, want = _run("pallas", qkv, qs, ks, cos, sin, cts), _run("xla", qkv, qs, ks, cos, sin, cts)
    for (q, _, _), (dqkv, dqs, dks) in (got, want):
        bad = np.zeros((70, 3, 2), bool)
        bad[poisoned, 0, 1] = True
        assert np.all(np.isnan(np.asarray(q)[poisoned, 1])) and np.all(np.isnan(np.asarray(dqkv)[poisoned, 0, 1]))
        assert np.isfinite(np.asarray(dqkv)[~bad]).all() and np.isfinite(np.asarray(q)[:, 0]).all()
        assert np.isnan(np.asarray(dqs)).all() and np.isfinite(np.asarray(dks)).all()
    clean = np.setdiff1d(np.arange(70), poisoned)
    # The clean tokens' values and qkv gradients against their bounds; d k_scale (all finite) against its bound
    # over every token it sums; d q_scale is NaN in both paths (above).
    pick = lambda r: ((r[0][0][clean], r[0][1][clean], r[0][2][clean]), (r[1][0][clean], r[1][1], r[1][2]))  # noqa: E731
    cut = (qkv[clean], qs, ks, cos[clean], sin[clean])
    fractions = bound_fractions(pick(got), pick(want), cut, tuple(c[clean] for c in cts), EPS)
    fractions["dk_scale"] = bound_fractions(got, want, (qkv, qs, ks, cos, sin), cts, EPS)["dk_scale"]
    del fractions["dq_scale"]
    for name, (_, fraction) in fractions.items():
        check(f"seed {seed}: {name}", fraction, 1.0)


def test_residuals_are_the_inputs():
    """The backward keeps qkv, the scales and the table: no normalised copy of q or k."""
    qkv, qs, ks, cos, sin = _inputs(40, 2, 32, jnp.bfloat16, 0)
    loss = lambda qkv, qs, ks: sum(jnp.sum(o.astype(jnp.float32)) for o in qk_norm_rope(qkv, qs, ks, cos, sin, implementation="pallas"))  # noqa: E731
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        kept = sorted((a.shape, str(a.dtype)) for a, _ in saved_residuals(loss, qkv, qs, ks))
    assert kept == sorted([((40, 3 * 2 * 32), "bfloat16"), ((2, 32), "float32"), ((40, 16), "float32"), ((40, 16), "float32")])


def test_bad_inputs_are_named():
    qkv, qs, ks, cos, sin = _inputs(8, 2, 32, jnp.bfloat16, 0)
    cases = [
        ((qkv[:, :2], qs, ks, cos, sin), {}, r"qkv must be \[T, 3, H, D\].*got \(8, 2, 2, 32\)"),
        ((qkv[..., :31], qs[:31], ks[:31], cos, sin), {}, "head dim D must be even for RoPE, got 31"),
        ((qkv.astype(jnp.int32), qs, ks, cos, sin), {}, "qkv must be floating point, got int32"),
        ((qkv, qs[:16], ks, cos, sin), {}, r"q_scale must be a floating \[32\] \(the head dim\), got \(16,\)"),
        ((qkv, qs, ks, cos[:4], sin), {}, r"cos must be float32 \[8, 16\] or \[8, 1, 16\], got \(4, 1, 16\)"),
        ((qkv, qs, ks, cos, sin.astype(jnp.bfloat16)), {}, "sin must be float32.*bfloat16"),
        ((qkv.reshape(8, -1), qs, ks, cos, sin), {"heads": 5}, r"with heads=5, qkv must be \[T, 3\*H\*D\]"),
        ((qkv, qs, ks, cos, sin), {"implementation": "bogus"}, "unknown implementation"),
        ((qkv, qs, ks, cos, sin), {"implementation": "cudnn"}, "qk_norm_rope has no cuDNN implementation"),
        ((qkv, qs, ks, cos, sin), {"dtype": jnp.int8}, r"dtype must be a floating dtype \(or None: qkv's\), got .*int8"),
        ((qkv, qs, ks, cos, sin), {"dtype": "bogus"}, "dtype must be a floating dtype.*'bogus'"),
        ((qkv, qs, ks, cos, sin), {"tile": (24, 4)}, r"tile must be \(rows, warps\), both powers of two, got \(24, 4\)"),
        ((qkv, qs, ks, cos, sin), {"tile": (32, 0)}, "both powers of two"),
        ((qkv, qs, ks, cos, sin), {"tile": (32, 4, 1)}, "both powers of two"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            qk_norm_rope(*args, **kwargs)


def test_dispatch_and_inputs_the_kernel_takes():
    qkv, qs, ks, cos, sin = _inputs(8, 2, 32, jnp.bfloat16, 0)
    with pytest.raises(ImplementationUnavailableError, match="qk_norm_rope: .*no Hopper GPU"):
        qk_norm_rope(qkv, qs, ks, cos, sin, implementation="pallas")
    for a, b in zip(qk_norm_rope(qkv, qs, ks, cos, sin), qk_norm_rope(qkv, qs, ks, cos, sin, implementation="xla")):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))  # None on the CPU: the reference
    assert describe_choice("qk_norm_rope", jnp.bfloat16, 128).implementation.value == "xla"
    assert kernel.kernel_takes((166_528, 3, 8, 128), jnp.bfloat16) and kernel.kernel_takes((1, 3, 1, 16), jnp.float32)
    assert kernel.kernel_takes((5, 3, 2, 256), jnp.bfloat16)
    for shape, dtype in [
        ((5, 3, 2, 48), jnp.bfloat16), ((5, 3, 2, 8), jnp.bfloat16), ((5, 3, 2, 512), jnp.bfloat16),  # D outside 16..256
        ((5, 3, 2, 64), jnp.float16), ((700_000, 3, 8, 128), jnp.bfloat16), ((0, 3, 8, 128), jnp.bfloat16),
    ]:
        assert not kernel.kernel_takes(shape, dtype), (shape, dtype)
    # Under "pallas" an input the kernel does not take (D = 48) runs the reference.
    qkv48, qs48, ks48, cos48, sin48 = _inputs(8, 2, 48, jnp.bfloat16, 0)
    got = _run("pallas", qkv48, qs48, ks48, cos48, sin48, tuple(jnp.ones((8, 2, 48), jnp.bfloat16) for _ in range(3)))
    want = _run("xla", qkv48, qs48, ks48, cos48, sin48, tuple(jnp.ones((8, 2, 48), jnp.bfloat16) for _ in range(3)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _pallas_calls(t, d, implementation=None, **kwargs):
    """The pallas_calls in the jaxpr of the op's value and gradients at `[T, 3, 2, D]` bf16 on a stand-in H200."""
    qkv, qs, ks, cos, sin = _inputs(t, 2, d, jnp.bfloat16, 0)
    loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in qk_norm_rope(*a, cos, sin, implementation=implementation, **kwargs))  # noqa: E731
    with pallas_kernels.compiling_for(Hopper()):
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(qkv, qs, ks)).count("pallas_call")


def test_head_dims_outside_16_to_256_and_no_tokens_run_the_reference_on_hopper():
    """On a Hopper GPU (None or "pallas") the kernels run for D = 16 and 256; D = 8 and 512, and T = 0, run the reference."""
    for implementation in (None, "pallas"):
        assert [_pallas_calls(4, d, implementation) for d in (8, 16, 256, 512)] == [0, 2, 2, 0]
        assert _pallas_calls(0, 32, implementation) == 0


def test_start_up_reasons_say_what_runs():
    """`describe_choice` names the reference where "pallas" meets an input the kernels do not take, and the size limit
    it cannot check where it names the kernels."""
    explicit = describe_choice("qk_norm_rope", jnp.float16, 128, implementation="pallas", device=Hopper())
    assert explicit.implementation.value == "xla" and "asked for the Pallas kernels, but the kernels take bfloat16 or float32" in explicit.reason
    assert describe_choice("qk_norm_rope", jnp.bfloat16, 512, implementation="pallas", device=Hopper()).implementation.value == "xla"
    for implementation in (None, "pallas"):
        chosen = describe_choice("qk_norm_rope", jnp.float32, 128, implementation=implementation, device=Hopper())
        assert chosen.implementation.value == "pallas"
        assert chosen.reason.endswith("(at least one token and under 2**31 elements; else the jnp reference)")


def test_forward_and_backward_lower_for_cuda_without_a_gpu():
    """Both kernels lower through Triton for an H200 described to jax (the Triton lowering reads the GPU
    from the abstract mesh's device: no GPU, no CUDA libraries)."""
    qkv, qs, ks, cos, sin = _inputs(100, 8, 128, jnp.bfloat16, 0)

    def loss(qkv, qs, ks):
        q, k, v = qk_norm_rope(qkv, qs, ks, cos, sin, implementation="pallas")
        return jnp.sum(jnp.sin(q.astype(jnp.float32))) + jnp.sum(jnp.sin(k.astype(jnp.float32))) + jnp.sum(jnp.sin(v.astype(jnp.float32)))

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with pallas_kernels.compiling_for(Hopper()), jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(qkv, qs, ks).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2
    assert "qk_norm_rope_forward" in text and "qk_norm_rope_backward" in text


def test_gradients_keep_their_primals_types_under_shard_map():
    """Inside shard_map the replicated scales' gradients are typed like the scales (the kernel's partial sums are
    summed over the axis by the cast's transpose). Traced only: the interpreter's masked loads do not run there."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("gpu",))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    qkv, qs, ks, cos, sin = _inputs(40, 2, 32, jnp.bfloat16, 0)

    def body(qkv, qs, ks, cos, sin):
        loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in qk_norm_rope(*a, cos, sin))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(qkv, qs, ks)

    specs = (P("gpu"), P(), P(), P("gpu"), P("gpu"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs[:3]))
    with pallas_kernels.compiling_for(Hopper()):
        traced = f.trace(*(put(x, spec) for x, spec in zip((qkv, qs, ks, cos, sin), specs)))
    assert [o.sharding.spec for o in traced.out_info] == [P("gpu", None, None, None), P(None), P(None)]
    assert str(traced.jaxpr).count("pallas_call") == 2


def test_no_tokens_under_shard_map_run_the_reference():
    """T = 0 inside shard_map: the reference's gradients keep their primals' types (the kernels take T > 0)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("gpu",))
    qkv, qs, ks, cos, sin = _inputs(0, 2, 32, jnp.bfloat16, 0)

    def body(qkv, qs, ks, cos, sin):
        loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in qk_norm_rope(*a, cos, sin, implementation="pallas"))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(qkv, qs, ks)

    specs = (P("gpu"), P(), P(), P("gpu"), P("gpu"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs[:3]))
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip((qkv, qs, ks, cos, sin), specs)]
    with pallas_kernels.compiling_for(Hopper()):  # "pallas" as on a Hopper GPU; the program runs on the CPU
        assert str(f.trace(*args).jaxpr).count("pallas_call") == 0
        dqkv, dqs, dks = f(*args)
    assert dqkv.shape == (0, 3, 2, 32)
    np.testing.assert_array_equal(np.asarray(dqs), np.zeros(32))
    np.testing.assert_array_equal(np.asarray(dks), np.zeros(32))
