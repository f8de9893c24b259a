"""The per-step context reaches the layers by their module paths, on 4 fake CPU devices (in a subprocess): an FP8
layer named in the context's `fp8` quantizes its kernel shard and gathers it in 8 bits (the values of quantizing
the whole kernel), one not named refuses the shard; a table named in `tables` exchanges its rows in its own
exchange dtype, and plan_sharding refuses a model whose layers do not know their paths."""

import os
import subprocess
import sys
import textwrap

import pytest
from flax import nnx

from gem_jax.mesh import Topology
from gem_jax.nn.layers import EmbeddingTable, dense, name_layers
from gem_jax.parallel.rules import HSDP_RULES, plan_sharding
from gem_jax.quant import Fp8Recipe

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from gem_jax import shard_context
    from gem_jax.mesh import Topology, make_mesh
    from gem_jax.nn.embeddings import Generation, TableSharding, place_table
    from gem_jax.nn.layers import EmbeddingTable, dense, name_layers
    from gem_jax.quant import Fp8Gather, Fp8Recipe

    assert jax.device_count() == 4, jax.devices()
    bits = lambda a: np.asarray(a).reshape(-1).view(np.uint8)
    mesh = make_mesh(Topology(1, 1, 4, experts_per_node=1))
    sizes = dict(mesh.shape)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.proj = dense(128, 64, ("embed", "mlp"), rngs=rngs, fp8=Fp8Recipe(implementation="xla"))
            self.table = EmbeddingTable(60, 8, rngs=rngs)

    with nnx.use_eager_sharding(False):
        net = Net(nnx.Rngs(0))
    name_layers(net)
    graphdef, state = nnx.split(net)
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(1), (32, 128))
    g = jax.random.normal(jax.random.key(2), (32, 64))

    def loss(model, x):
        return jnp.sum(model.proj(x) * g)

    # One device, no context: the whole kernel.
    want, want_dw = jax.jit(jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), x)))(params)
    want_dw = want_dw["proj"]["kernel"]

    # Inside shard_map, the kernel's rows sharded over gpu (32 per device: one block); x and g replicated.
    gathers = {"proj": Fp8Gather(0, ("gpu",))}
    def body(kernel, p):
        p = dict(p, proj=dict(p["proj"], kernel=kernel))
        def f(kernel):
            q = dict(p, proj=dict(p["proj"], kernel=kernel))
            with shard_context.shard_context(sizes, fp8=gathers):
                return loss(nnx.merge(graphdef, q), x)
        value, dw = jax.value_and_grad(f)(kernel)
        return value[None], dw

    rest = params
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("gpu", None), P()), out_specs=(P("gpu"), P("gpu", None))))
    lowered = mapped.lower(params["proj"]["kernel"], rest)
    assert "u8[128,64]" in lowered.as_text(dialect="hlo"), "no 8-bit gather of the kernel"
    value, dw = lowered.compile()(params["proj"]["kernel"], rest)
    # The same quantized operands and the same GEMM on every device: the loss bit for bit. Every device computes
    # the whole loss (x and g replicated), so the reduce-scattered kernel gradient is 4 times its rows of the
    # one-device gradient, up to the rounding of that float32 sum.
    for v in np.asarray(value):
        np.testing.assert_array_equal(bits(v), bits(want))
    np.testing.assert_allclose(np.asarray(dw), 4 * np.asarray(want_dw), rtol=1e-6, atol=1e-6)

    # Without the layer's entry the kernel is taken whole: a shard of it is refused.
    def unnamed(kernel, p):
        q = dict(p, proj=dict(p["proj"], kernel=kernel))
        with shard_context.shard_context(sizes, fp8={}):
            return loss(nnx.merge(graphdef, q), x)
    try:
        jax.shard_map(unnamed, mesh=mesh, in_specs=(P("gpu", None), P()), out_specs=P())(params["proj"]["kernel"], rest)
    except ValueError as e:
        assert "x has 128 input features, w 32 rows" in str(e), e
    else:
        raise AssertionError("a kernel shard without its gather was accepted")

    # The table, rows sharded over gpu (GLOBAL), named in the context: its rows cross the network in its dtype.
    table = params["table"]["embedding"]
    placement = place_table("table", 60, table.shape[0], TableSharding(Generation.GLOBAL), sizes)
    ids = jnp.arange(4 * 6, dtype=jnp.int32).reshape(4, 6) * 2 + 1
    for dtype in ("bfloat16", "float32"):
        net.table.exchange_dtype = jnp.dtype(dtype)  # the model's compute dtype, set when it is built
        table_graphdef = nnx.split(net)[0]
        def lookup(shard, ids):
            q = dict(params, table=dict(embedding=shard))
            with shard_context.shard_context(sizes, tables={"table": placement}) as ctx:
                rows = nnx.merge(table_graphdef, q).table(ids[0])
            return rows[None], ctx.stats["table/sent_bytes"][None]
        rows, sent = jax.jit(jax.shard_map(lookup, mesh=mesh, in_specs=(P("gpu", None), P("gpu")), out_specs=(P("gpu"), P("gpu"))))(table, ids)
        assert rows.dtype == jnp.dtype(dtype), (dtype, rows.dtype)
        np.testing.assert_array_equal(np.asarray(rows).reshape(-1, 8), np.asarray(table[ids.reshape(-1)].astype(dtype)))
        # 4 owners x 6 ids per round (worst case), one round: int32 ids out and rows of 8 back.
        assert float(sent[0]) == 4 * 6 * (4 + 8 * jnp.dtype(dtype).itemsize), (dtype, sent)
    print("CONTEXT-OK")
    """
)


@pytest.mark.multidevice
def test_layers_take_their_gather_and_placement_from_the_step_context(repo_root):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(repo_root))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert proc.returncode == 0 and "CONTEXT-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_plan_sharding_refuses_layers_that_do_not_know_their_paths():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.proj = dense(128, 64, ("embed", "mlp"), rngs=rngs, fp8=Fp8Recipe())
            self.table = EmbeddingTable(60, 8, rngs=rngs)

    sizes = Topology(1, 1, 4, experts_per_node=1).axis_sizes
    with nnx.use_eager_sharding(False):
        unnamed = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
        named = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"Fp8Linear at 'proj' has path None: .*name_layers"):
        plan_sharding(unnamed, sizes, HSDP_RULES)
    name_layers(named)
    plan = plan_sharding(named, sizes, HSDP_RULES)
    assert set(plan.tables) == {"table"}
