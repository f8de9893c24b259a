"""Quantize-on-shard-then-gather equals gather-then-quantize, on 8 fake CPU devices (in a subprocess)."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from gem_jax.quant import Fp8Recipe, fp8_matmul, quantize_gathered
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
    fsdp = Fp8Recipe(implementation="xla", fsdp_axis="fsdp", fsdp_dim=0)
    def step(recipe):
        f = lambda x, w: jnp.sum(fp8_matmul(x, w, None, recipe, w.dtype) * g)
        return jax.value_and_grad(f, argnums=(0, 1))
    with jax.set_mesh(mesh2):
        w_sharded = jax.device_put(w, NamedSharding(mesh2, P("fsdp", None)))
        got = jax.jit(step(fsdp))(x, w_sharded)
    want = jax.jit(step(plain))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    print("FSDP-OK")
    """
)


@pytest.mark.multidevice
def test_quantize_on_shard_then_gather_equals_gather_then_quantize(repo_root):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONPATH=str(repo_root))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert proc.returncode == 0 and "FSDP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
