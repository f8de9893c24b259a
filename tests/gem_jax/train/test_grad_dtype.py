"""`OptimConfig.gradient_dtype="bfloat16"`: which parameters get bfloat16 gradients, and that training is unchanged bit for bit.

The end-to-end cases train configs/gem_h200_tiny.py (one device, both table-update paths) and
configs/gem_sharded_tiny.py (8 fake CPU devices, HSDP and sharded tables, in a subprocess: this
file run as a script) under `model.compute_dtype=bfloat16`, where every dense parameter is cast
to bfloat16 on its shard before use, with float32 and with bfloat16 gradients.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gem_jax.train import grad_dtype
from gem_jax.train.optimizer import OptimConfig, float32_gradients

REPO = Path(__file__).resolve().parents[3]
STEPS = 3


class Tiny(nnx.Module):
    """A bf16 layer (kernel and bias cast to bf16 at use) and a scale applied in float32."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.scale = nnx.Param(jnp.linspace(0.5, 1.5, 3, dtype=jnp.float32))

    def __call__(self, x):
        return (self.dense(x).astype(jnp.float32) * self.scale[...]).sum()


def test_the_mask_selects_the_parameters_used_only_through_one_bf16_cast():
    graphdef, params = nnx.split(Tiny(nnx.Rngs(0)), nnx.Param)
    x = jax.random.normal(jax.random.key(1), (5, 4))

    def loss(params, x):
        return nnx.merge(graphdef, params)(x)

    mask = grad_dtype.bf16_gradient_mask(loss, params, x)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert dict(zip(paths, mask)) == {"['dense']['bias'].value": True, "['dense']['kernel'].value": True, "['scale'].value": False}

    # The bf16 copies' gradients are the float32 gradients' exact bfloat16 values.
    want = jax.grad(loss)(params, x)
    got = jax.grad(loss)(grad_dtype.to_bf16(params, mask), x)
    assert [g.dtype for g in jax.tree.leaves(got)] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    for g, w in zip(jax.tree.leaves(grad_dtype.widen(got)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))


def test_the_mask_follows_sub_jaxprs_and_refuses_what_it_cannot_see():
    bf = lambda v: v.astype(jnp.bfloat16)  # noqa: E731

    @jax.custom_vjp
    def opaque(v):
        return bf(v)

    opaque.defvjp(lambda v: (bf(v), None), lambda _, g: (g.astype(jnp.float32),))

    def body(carry, row):
        return carry + (bf(row) * carry).sum(), None

    def loss(p, flag):
        terms = [
            jax.jit(lambda v: bf(v).sum())(p["jit"]),  # cast inside a jit: qualifies
            jax.checkpoint(lambda v: jnp.sin(bf(v)).sum())(p["remat"]),  # cast inside remat: qualifies
            jax.lax.cond(flag, lambda v: bf(v).sum(), lambda v: bf(v).prod(), p["cond"]),  # cast in every branch
            jax.lax.scan(body, jnp.bfloat16(1), p["scan_xs"])[0],  # per-iteration input cast: qualifies
            jax.lax.scan(lambda c, _: (c + bf(p["scan_const"]).sum(), None), jnp.bfloat16(0), None, length=2)[0],  # accumulated
            bf(p["twice"]).sum() + bf(p["twice"]).prod(),  # two casts: two widened gradients summed in float32
            (bf(p["f32_too"]).sum() + p["f32_too"].sum()).astype(jnp.bfloat16),  # used in float32 as well
            opaque(p["custom"]).sum(),  # a custom rule's gradient
            bf(p["plain"] * 2).sum(),  # cast after a float32 product
        ]
        return sum(t.astype(jnp.float32) for t in terms)

    names = ["jit", "remat", "cond", "scan_xs", "scan_const", "twice", "f32_too", "custom", "plain"]
    params = {k: jnp.arange(1.0, 4.0) for k in names}
    flag = jnp.bool_(True)
    mask = dict(zip(sorted(names), grad_dtype.bf16_gradient_mask(loss, params, flag)))
    assert {k for k, m in mask.items() if m} == {"jit", "remat", "cond", "scan_xs"}
    # Every selected leaf's gradient is unchanged bit for bit.
    want = jax.grad(loss)(params, flag)
    got = grad_dtype.widen(jax.grad(loss)(grad_dtype.to_bf16(params, list(mask.values())), flag))
    for k in names:
        np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint32), np.asarray(want[k]).view(np.uint32), err_msg=k)


def test_config_validation():
    assert OptimConfig().gradient_dtype == "float32"
    with pytest.raises(ValueError, match="gradient_dtype"):
        OptimConfig(gradient_dtype="float16")


def test_float32_gradients_keeps_the_state_and_the_updates():
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)}
    grads = {"w": jnp.linspace(-0.3, 0.7, 6, dtype=jnp.float32).astype(jnp.bfloat16)}
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    wrapped = float32_gradients(inner)
    assert jax.tree.structure(wrapped.init(params)) == jax.tree.structure(inner.init(params))
    want, _ = inner.update(grad_dtype.widen(grads), inner.init(params), params)
    got, _ = wrapped.update(grads, wrapped.init(params), params)
    assert got["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))


def train(config_path: Path, overrides: list[str]) -> dict:
    """`STEPS` train steps: losses, grad norms, final parameters; the gradients' dtypes and (sharded) their shardings."""
    from gem_jax.train import sparse_tables
    from gem_jax.train.config import load_config
    from gem_jax.train.config_tree import apply_overrides
    from gem_jax.train.setup import setup_training

    config = apply_overrides(load_config(config_path), ["model.compute_dtype=bfloat16", *overrides])
    training, state = setup_training(config)
    iterator = training.dataset.train_iterator()
    batches = [training.placement.put(next(iterator)) for _ in range(STEPS)]
    model, shardings = training.state.sharded_model(), training.state.shardings.params
    grads_of = jax.jit(
        lambda p, b: sparse_tables.sparse_value_and_grad(model, p, b, grad_dtype.MaskCache())[1].grads,
        in_shardings=(shardings, training.placement.sharding),
    )
    grads = grads_of(state.params, batches[0])
    bf16 = [path for path, g in jax.tree_util.tree_leaves_with_path(grads) if g.dtype == jnp.bfloat16]
    mismatched = [
        jax.tree_util.keystr(path)
        for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(state.params))
        if g.dtype == jnp.bfloat16 and not g.sharding.is_equivalent_to(p.sharding, p.ndim)
    ]
    dense = [(path, p) for path, p in jax.tree_util.tree_leaves_with_path(state.params) if "embedding" not in jax.tree_util.keystr(path)]
    losses, norms, asked = [], [], []
    mask = grad_dtype.MaskCache.mask
    grad_dtype.MaskCache.mask = lambda self, *args: asked.append(args[0]) or mask(self, *args)  # the step takes the bf16 path
    try:
        for batch in batches:
            state, metrics = training.train_step(state, batch)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    finally:
        grad_dtype.MaskCache.mask = mask
    return {
        "losses": losses,
        "norms": norms,
        "params": [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))],
        "bf16_leaves": len(bf16),
        "bf16_bytes": sum(g.size * 4 for _, g in jax.tree_util.tree_leaves_with_path(grads) if g.dtype == jnp.bfloat16),
        "dense_leaves": len(dense),
        "dense_bytes": sum(p.size * 4 for _, p in dense),
        "mismatched_shardings": mismatched,
        "step_masks": len(asked),
    }


def assert_identical(got: dict, want: dict):
    assert got["losses"] == want["losses"]
    assert got["norms"] == want["norms"]
    for g, w in zip(got["params"], want["params"], strict=True):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))


@pytest.mark.parametrize("sparse", [True, False], ids=["row_wise_tables", "dense_tables"])
def test_bf16_gradients_train_bit_identically(repo_root, sparse):
    config = repo_root / "configs" / "gem_h200_tiny.py"
    base = [f"optim.sparse_embedding_updates={sparse}"]
    want = train(config, [*base, "optim.gradient_dtype=float32"])
    got = train(config, [*base, "optim.gradient_dtype=bfloat16"])
    # Every dense parameter is cast to bf16 on its shard (gem_jax.parallel.spmd.gather_param) and used only so.
    assert got["bf16_leaves"] == got["dense_leaves"] == 76
    assert got["step_masks"] > 0 and want["step_masks"] == 0
    assert_identical(got, want)


def test_bf16_gradients_train_bit_identically_sharded(tmp_path):
    out = tmp_path / "report.npz"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["devices"] == 8
    # The expert group's weights and the dense layers: every non-table parameter.
    assert report["got"]["bf16_leaves"] == report["got"]["dense_leaves"] > 0
    assert report["got"]["mismatched_shardings"] == []
    assert report["got"]["step_masks"] > 0
    assert report["identical"], report


if __name__ == "__main__":
    config = REPO / "configs" / "gem_sharded_tiny.py"
    want = train(config, ["optim.gradient_dtype=float32"])
    got = train(config, ["optim.gradient_dtype=bfloat16"])
    try:
        assert_identical(got, want)
        identical = True
    except AssertionError:
        identical = False
    summary = {k: v for k, v in got.items() if k != "params"}
    Path(sys.argv[1]).write_text(
        json.dumps({"devices": jax.device_count(), "identical": identical, "got": summary, "want_losses": want["losses"]}, indent=1)
    )
