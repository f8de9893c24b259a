"""Quantize-on-shard-then-gather equals gather-then-quantize, on 8 fake CPU devices (in a subprocess), from a
globally sharded array and from inside a `shard_map` over the FSDP axes."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from gem_jax.quant import Fp8Gather, Fp8Recipe, fp8_matmul, quantize_gathered
    from pallas_kernels.mxfp8 import quantize_mxfp8

    assert jax.device_count() == 8, jax.devices()
    bits = lambda a: np.asarray(a).view(np.uint8)

    def check(mesh, axis, dim, shape, block, seed):
        w = jax.random.normal(jax.random.key(seed), shape) * jnp.exp(jax.random.normal(jax.random.key(seed + 1), (shape[0], 1)))
        spec = P(*(axis if d == dim else None for d in range(2)))
        w_sharded = jax.device_put(w, NamedSharding(mesh, spec))
        data, scales = jax.jit(lambda w: quantize_gathered(w, axis_name=axis, dim=dim, block=block, mesh=mesh))(w_sharded)
        ref_d, ref_s = quantize_mxfp8(w, block=block)
        np.testing.assert_array_equal(bits(data), bits(ref_d))
        np.testing.assert_array_equal(bits(scales), bits(ref_s))

    mesh1 = jax.make_mesh((8,), ("fsdp",))
    mesh2 = jax.make_mesh((2, 4), ("data", "fsdp"))
    check(mesh1, "fsdp", 0, (512, 96), (32, 32), 0)       # 64 rows per shard = 2 blocks
    check(mesh1, "fsdp", 1, (40, 256), (32, 32), 2)       # shards split columns; partial row blocks
    check(mesh2, "fsdp", 0, (1024, 128), (128, 128), 4)   # 128x128 weight blocks, 256 rows per shard
    check(mesh2, "fsdp", 1, (64, 128), (32, 32), 6)

    try:
        quantize_gathered(jnp.ones((96, 64)), axis_name="fsdp", dim=0, mesh=mesh1)
    except ValueError as e:
        assert "whole quantization blocks" in str(e)
    else:
        raise AssertionError("misaligned shards were accepted")

    # The layer path: kernel sharded over fsdp (rows), quantized per shard inside jit, same result.
    x = jax.random.normal(jax.random.key(9), (64, 256))
    w = jax.random.normal(jax.random.key(10), (256, 96)) / 16
    g = jax.random.normal(jax.random.key(11), (64, 96))
    plain = Fp8Recipe(implementation="xla")
    def step(recipe, gather=None):
        f = lambda x, w: jnp.sum(fp8_matmul(x, w, None, recipe, w.dtype, gather=gather) * g)
        return jax.value_and_grad(f, argnums=(0, 1))
    with jax.set_mesh(mesh2):
        w_sharded = jax.device_put(w, NamedSharding(mesh2, P("fsdp", None)))
        got = jax.jit(step(plain, Fp8Gather(0, ("fsdp",))))(x, w_sharded)
    want = jax.jit(step(plain))(x, w)
    # The same quantized operands (scales per whole 32x32 tile) and the same contractions: equal up to the float32
    # sum of the loss's 64 x 96 terms, which XLA may order differently in the sharded program (measured: ~1e-7).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)

    # Inside a shard_map over the FSDP axes (as in a sharded train step): each device has its own rows of x
    # (whole 32-row tiles) and its shard of w, gathers 8-bit data over two axes, and gets its shard's
    # gradient (the weight gradients of all devices' rows, reduce-scattered).
    from gem_jax.quant import shard_gradient
    axes = ("data", "fsdp")
    manual = Fp8Gather(0, axes)
    x = jax.random.normal(jax.random.key(12), (256, 256))
    g = jax.random.normal(jax.random.key(13), (256, 96))
    want = jax.jit(step(plain))(x, w)
    rows = NamedSharding(mesh2, P(axes, None))

    def local(x_rows, g_rows, w_shard):
        data, scales = quantize_gathered(w_shard, axis_name=axes, dim=0)
        f = lambda x, w: jnp.sum(fp8_matmul(x, w, None, plain, w.dtype, gather=manual) * g_rows)
        value, (dx, dw) = jax.value_and_grad(f, argnums=(0, 1))(x_rows, w_shard)
        return data, scales, jax.lax.psum(value, axes), dx, dw

    out_specs = (P(), P(), P(), P(axes, None), P(axes, None))
    data, scales, value, dx, dw = jax.jit(jax.shard_map(local, mesh=mesh2, in_specs=(P(axes, None),) * 3, out_specs=out_specs))(
        jax.device_put(x, rows), jax.device_put(g, rows), jax.device_put(w, rows)
    )
    ref_d, ref_s = quantize_mxfp8(w, block=(32, 32))
    np.testing.assert_array_equal(bits(data), bits(ref_d))
    np.testing.assert_array_equal(bits(scales), bits(ref_s))
    # Whole 32-row tiles per device: the same quantized operands; only float32 order differs (dw: 8 partial sums of
    # 32 rows reduce-scattered instead of one sum of 256; value: a psum of 8). gamma_256 = 1.5e-5 of the sum of
    # magnitudes, which is ~sqrt(256) = 16x |dw| for these random signs: rtol 1e-5 with atol 1e-4 on O(1)-O(10) entries.
    for a, b in zip((value, dx, dw), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
    # With the random Hadamard rotation each row shard rotates by its slice of the signs: the same layer.
    hadamard = Fp8Recipe(implementation="xla", hadamard=True)
    want = jax.jit(step(hadamard))(x, w)

    def local_rotated(x_rows, g_rows, w_shard):
        f = lambda x, w: jnp.sum(fp8_matmul(x, w, None, hadamard, w.dtype, gather=manual) * g_rows)
        value, (dx, dw) = jax.value_and_grad(f, argnums=(0, 1))(x_rows, w_shard)
        return jax.lax.psum(value, axes), dx, dw

    got = jax.jit(jax.shard_map(local_rotated, mesh=mesh2, in_specs=(P(axes, None),) * 3, out_specs=out_specs[2:]))(
        jax.device_put(x, rows), jax.device_put(g, rows), jax.device_put(w, rows)
    )
    for a, b in zip(got, jax.tree.leaves(want)):  # as above: the same tiles, float32 order only
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
    # Outside a shard_map the gradient is already the global one.
    np.testing.assert_array_equal(np.asarray(shard_gradient(jnp.ones((4, 2)), axis_name=axes)), np.ones((4, 2)))

    try:
        jax.shard_map(lambda s: quantize_gathered(s, axis_name=axes, dim=0), mesh=mesh2, in_specs=P(axes, None), out_specs=(P(), P()))(
            jax.device_put(jnp.ones((128, 64)), rows)  # 16 rows per shard
        )
    except ValueError as e:
        assert "whole quantization blocks" in str(e) and "16 rows" in str(e), e
    else:
        raise AssertionError("a misaligned shard was accepted inside shard_map")
    print("FSDP-OK")
    """
)


@pytest.mark.multidevice
def test_quantize_on_shard_then_gather_equals_gather_then_quantize(repo_root):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()  # a sweep's flags reach it
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(repo_root))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert proc.returncode == 0 and "FSDP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
