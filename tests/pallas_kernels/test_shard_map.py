"""The Mosaic GPU kernels inside `jax.shard_map` (CPU interpret mode), as the SPMD train step calls them.

Under `shard_map` arrays are typed by the mesh axes they vary over; the kernels
must trace there (loop bounds read from varying operands), return results of
their operands' type, and give a replicated operand (pooled attention's learned
queries) a gradient of its own type. The mesh has one device: the typing is the
same as on many, and the Mosaic GPU interpreter does not run two devices'
kernels side by side in one process.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import BFLOAT16, attention_budget, check

from pallas_kernels import gdpa, jagged_flash_attention, rms_norm
from pallas_kernels.mxfp8 import dequantize_mxfp8, mxfp8_matmul, quantize_mxfp8

AXIS = "data"


@pytest.fixture(autouse=True)
def gpu_interpreter():
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield


@pytest.fixture
def mesh():
    return jax.make_mesh((1,), (AXIS,), devices=jax.devices()[:1])


def _offsets(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _normal(seed, shape, *, nan_from=None):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)
    return x if nan_from is None else x.at[nan_from:].set(jnp.nan)


def _sharded(mesh, fn, args, specs):
    """`fn(*args)` under `shard_map`; every output (and its cotangent) varies over the axis."""
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=P(AXIS)))(*args)


def _value_and_grads(attend, d_out):
    def run(*xs):
        out, vjp = jax.vjp(attend, *xs)
        return (out, *vjp(d_out))

    return run


def _assert_close(got, want, real_rows, name):
    """Real rows within the bf16 attention budget of the reference's scale (a NaN fails the comparison).

    bf16 kernels against the float32 reference on the same bf16 inputs: `attention_budget(BFLOAT16)` =
    8 u = 3.1% of the largest entry (tests/support/tolerances.py; measured: benchmarks/tolerances.md).
    """
    got, want = (np.asarray(x[:real_rows].astype(jnp.float32)) for x in (got, want))
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    check(name, float(np.max(np.abs(got - want), initial=0.0)) / scale, attention_budget(BFLOAT16))  # NaN fails too


def _compare(mesh, call, args, specs, real_rows):
    pallas = _sharded(mesh, lambda *a: call("pallas", *a), args, specs)
    # The reference on float32 copies of the inputs: exact up to float32 rounding.
    exact = [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in args]
    xla = _sharded(mesh, lambda *a: call("xla", *a), exact, specs)
    for i, (g, w) in enumerate(zip(pallas, xla)):
        _assert_close(g, w, real_rows[i], f"output {i}")


def test_gdpa_jagged_forward_and_gradients(mesh):
    q_lens, kv_lens = [13, 0, 27], [10, 14, 0]
    heads, dim = 2, 64
    q, d_out = _normal(1, (48, heads, dim), nan_from=40), _normal(2, (48, heads, dim), nan_from=40)
    k, v = _normal(3, (32, heads, dim), nan_from=24), _normal(4, (32, heads, dim), nan_from=24)

    def call(impl, q, k, v, d_out, qo, ko):
        attend = lambda q, k, v: gdpa(q, k, v, qo, ko, max_seq_len_q=32, max_seq_len_kv=16, implementation=impl)
        return _value_and_grads(attend, d_out)(q, k, v)

    specs = [P(AXIS)] * 4 + [P(), P()]  # offsets replicated: each device reads the same
    _compare(mesh, call, (q, k, v, d_out, _offsets(q_lens), _offsets(kv_lens)), specs, (40, 40, 24, 24))


def test_gdpa_pooled_replicated_queries_get_their_gradient(mesh):
    """Learned queries (replicated) over each device's sequences: dQ sums over the devices."""
    kv_lens = [20, 0, 9]
    heads, dim, lq = 2, 64, 8
    q = _normal(5, (lq, heads, dim))
    k, v = _normal(6, (32, heads, dim), nan_from=29), _normal(7, (32, heads, dim), nan_from=29)
    d_out = _normal(8, (len(kv_lens) * lq, heads, dim))

    def call(impl, q, k, v, d_out, ko):
        attend = lambda q, k, v: gdpa(
            q, k, v, None, ko, max_seq_len_q=lq, max_seq_len_kv=24, broadcast_q=True, implementation=impl
        )
        out, dq, dk, dv = _value_and_grads(attend, d_out)(q, k, v)
        assert jax.typeof(dq).manual_axis_type.varying == frozenset(), "replicated q got a varying gradient"
        return out, dq[None], dk, dv

    specs = [P(), P(AXIS), P(AXIS), P(AXIS), P()]
    _compare(mesh, call, (q, k, v, d_out, _offsets(kv_lens)), specs, (24, 1, 29, 29))


def test_jagged_flash_attention_forward_and_gradients(mesh):
    lengths = [65, 0, 17]
    heads, dim = 2, 64
    q, k, v, d_out = (_normal(10 + i, (96, heads, dim), nan_from=82) for i in range(4))

    def call(impl, q, k, v, d_out, offsets):
        attend = lambda q, k, v: jagged_flash_attention(q, k, v, offsets, max_seq_len=80, causal=True, implementation=impl)
        return _value_and_grads(attend, d_out)(q, k, v)

    specs = [P(AXIS)] * 4 + [P()]
    _compare(mesh, call, (q, k, v, d_out, _offsets(lengths)), specs, (82, 82, 82, 82))


def test_mxfp8_matmul(mesh):
    a = jax.random.normal(jax.random.key(20), (64, 96))
    b = jax.random.normal(jax.random.key(21), (64, 96))
    a8, sa = quantize_mxfp8(a, block=(32, 32))
    b8, sb = quantize_mxfp8(b, block=(32, 32))
    want = np.asarray(dequantize_mxfp8(a8, sa, block=(32, 32))) @ np.asarray(dequantize_mxfp8(b8, sb, block=(32, 32))).T

    def call(a8, sa, b8, sb):
        return mxfp8_matmul(a8, sa, b8, sb, out_dtype=jnp.float32, implementation="pallas")

    got = _sharded(mesh, call, (a8, sa, b8, sb), [P(AXIS), P(AXIS), P(), P()])
    # Exact FP8 products, float32 sums over K = 96 in the kernel's order against float32 numpy's: gamma_96 = 6e-6 of the
    # sum of |terms| (~sqrt(96) x the O(10) entries): atol 1e-3 with rtol 1e-4.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)


def test_rms_norm_with_a_replicated_scale_and_the_input_passed_through(mesh):
    """Traced under `shard_map` with its checks: each device's rows are normalised with the replicated scale, whose
    gradient comes back invariant (summed over the devices), and the outputs and dx vary over the axis. Traced, not
    run: the generic Pallas interpreter (the Triton kernels' CPU path) cannot run a masked load under shard_map's
    checks (its padding constant is invariant, the rows varying); the values are tests/pallas_kernels/test_rms_norm.py's
    and the GPU check's (benchmarks/rms_norm_bench.py)."""
    x, dy, dx_in = _normal(30, (48, 64)), _normal(31, (48, 64)), _normal(32, (48, 64))
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(33), (64,))
    kinds = {}

    def step(x, scale, dy, dx_in):
        norm = lambda x, scale: rms_norm(x, scale, dtype=jnp.bfloat16, return_input=True, implementation="pallas")  # noqa: E731
        (y, passed), vjp = jax.vjp(norm, x, scale)
        dx, dscale = vjp((dy, dx_in))
        kinds.update({name: jax.typeof(a).manual_axis_type.varying for name, a in (("y", y), ("passed", passed), ("dx", dx), ("dscale", dscale))})
        return y, passed, dx, dscale[None]

    specs = (P(AXIS), P(), P(AXIS), P(AXIS))
    sharded = jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(AXIS), P(AXIS), P(AXIS), P()))
    jaxpr = jax.make_jaxpr(sharded)(*(jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip((x, scale, dy, dx_in), specs)))
    assert kinds == {"y": {AXIS}, "passed": {AXIS}, "dx": {AXIS}, "dscale": frozenset()}
    assert str(jaxpr).count("pallas_call") == 2  # the forward and backward kernels, no reference
