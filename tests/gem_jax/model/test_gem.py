"""The GEM model: slack and capacity invariance, independence of examples, gradients, RoPE, the FP8 switch
(FP8 bounds from the formats, tests/support/tolerances.py; measured: benchmarks/tolerances.md), attention choices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.batch import Batch, HistoryField, random_batch
from gem_jax.jagged import from_lengths
from gem_jax.model.config import Fp8Region, ModelConfig, describe_attention
from gem_jax.model.gem import GEMModel
from gem_jax.nn.layers import EmbeddingTable, RMSNorm, apply_rope, dense, gelu, norm_dense, norm_dense_parts, rms_norm, rope_table
from jax._src.ad_checkpoint import saved_residuals
from gem_jax.quant.dense import Fp8Linear
from gem_jax.train.config_tree import ConfigError, apply_overrides
from gem_jax.train.state import check_exchange_dtypes
import pallas_kernels
from pallas_kernels.mxfp8 import Fp8Recipe
from tolerances import DRAW, E4M3, check, product_rms
from specs import movielens_spec

SPEC = movielens_spec()
CONFIG = ModelConfig(embed_dim=16, num_heads=2, num_seq_layers=2, num_pooled_queries=2, head_hidden=16)


def make_batch(rng, lengths, capacity, slack_value=0):
    return random_batch(SPEC, rng, lengths, capacity, slack_value=slack_value)


@pytest.fixture(scope="module")
def split_model():
    with nnx.use_eager_sharding(False):
        return nnx.split(GEMModel(SPEC, CONFIG, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def model(split_model):
    """The model's forward, jitted: `model(batch) -> logits`."""
    graphdef, params = split_model
    apply = jax.jit(lambda p, batch: nnx.merge(graphdef, p)(batch))
    return lambda batch: apply(params, batch)


def test_logits_shape_finite_with_empty_full_and_odd_histories(model):
    batch = make_batch(np.random.default_rng(), [0, 1, 12, 5, 0], capacity=40)
    logits = model(batch)
    assert logits.shape == (5, 2) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_slack_rows_change_nothing(model):
    seed = np.random.default_rng().integers(1 << 30)
    a = make_batch(np.random.default_rng(seed), [3, 0, 7], capacity=32, slack_value=0)
    b = make_batch(np.random.default_rng(seed), [3, 0, 7], capacity=32, slack_value=7)
    np.testing.assert_array_equal(np.asarray(model(a)), np.asarray(model(b)))


def test_capacity_bucket_does_not_change_logits(model):
    seed = np.random.default_rng().integers(1 << 30)
    a = make_batch(np.random.default_rng(seed), [4, 9, 2], capacity=16)
    b = make_batch(np.random.default_rng(seed), [4, 9, 2], capacity=64)
    # Other shapes can sum in another float32 order (attention over 16 vs 64 rows, GEMMs of other sizes): ~sqrt(64) u =
    # 5e-7 of the terms per sum, so the error is relative to the logits' scale, not to a logit that nearly cancels.
    want = np.asarray(model(b))
    np.testing.assert_allclose(np.asarray(model(a)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_examples_are_independent(model):
    """An example's logits do not depend on the other examples of its batch."""
    rng = np.random.default_rng()
    batch = make_batch(rng, [5, 3, 8], capacity=24)
    alone = Batch(
        history=from_lengths(np.asarray(batch.history.values)[5:8], [3], max_seq_len=SPEC.max_seq_len, capacity=8),
        user={k: v[1:2] for k, v in batch.user.items()}, candidate_item=batch.candidate_item[1:2],
        candidate_features={k: v[1:2] for k, v in batch.candidate_features.items()}, labels=batch.labels[1:2], weights=batch.weights[1:2],
    )
    want = np.asarray(model(alone))[0]
    np.testing.assert_allclose(np.asarray(model(batch))[1], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())  # as above


def test_gradients_finite_and_history_item_gets_gradient(split_model):
    batch = make_batch(np.random.default_rng(), [0, 6, 12], capacity=24)
    graphdef, params = split_model

    def loss(p):
        return nnx.merge(graphdef, p)(batch).sum()

    grads = jax.jit(jax.grad(loss))(params)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    item_grad = np.asarray(grads["embed"]["item"]["embedding"][...])
    used = np.asarray(batch.history.values)[:18, HistoryField.ITEM]
    assert np.abs(item_grad[used]).sum() > 0
    unused = np.setdiff1d(np.arange(1, SPEC.num_items), np.concatenate([used, np.asarray(batch.candidate_item)]))
    assert np.abs(item_grad[unused]).sum() == 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gelu_is_jax_gelu_bit_for_bit_and_keeps_only_its_input(dtype):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(scale=3.0, size=(64, 96)), dtype)
    dy = jnp.asarray(rng.normal(size=(64, 96)), dtype)
    ours = jax.jit(lambda x: jax.vjp(gelu, x)[1](dy)[0])
    theirs = jax.jit(lambda x: jax.vjp(jax.nn.gelu, x)[1](dy)[0])
    np.testing.assert_array_equal(np.asarray(jax.jit(gelu)(x), np.float32), np.asarray(jax.jit(jax.nn.gelu)(x), np.float32))
    np.testing.assert_array_equal(np.asarray(ours(x), np.float32), np.asarray(theirs(x), np.float32))
    # the backward's only residual is x itself (jax.nn.gelu also keeps its tanh, and more)
    kept = [aval for aval, _ in saved_residuals(lambda x: jnp.sum(gelu(x)), x)]
    assert [(a.shape, a.dtype) for a in kept] == [(x.shape, x.dtype)]
    assert len(saved_residuals(lambda x: jnp.sum(jax.nn.gelu(x)), x)) > 1


@pytest.mark.parametrize("dtype,use_bias", [(jnp.float32, True), (jnp.bfloat16, False), (jnp.bfloat16, True)])
def test_norm_dense_parts_are_the_fused_products_columns_with_their_gradients(dtype, use_bias):
    rngs = nnx.Rngs(3)
    with nnx.use_eager_sharding(False):
        norm = rms_norm(64, rngs=rngs, dtype=dtype, implementation="xla")
        layer = dense(64, 3 * 32, ("embed", "heads"), rngs=rngs, use_bias=use_bias, dtype=dtype)
    if use_bias:
        layer.bias[...] = jax.random.normal(jax.random.key(1), layer.bias.shape)
    x = jax.random.normal(jax.random.key(2), (37, 64), jnp.float32)  # rows not a multiple of any block
    cotangents = [jax.random.normal(jax.random.key(10 + k), (37, 32), dtype) for k in range(3)]
    graphdef, params = nnx.split((norm, layer))

    def fused(x, params):
        norm, layer = nnx.merge(graphdef, params)
        return jnp.split(norm_dense(norm, layer, x), 3, axis=-1)

    def parts(x, params):
        return norm_dense_parts(*nnx.merge(graphdef, params), x, 3)

    (want, want_vjp), (got, got_vjp) = jax.vjp(fused, x, params), jax.vjp(parts, x, params)
    assert [g.shape for g in got] == [(37, 32)] * 3 and all(g.dtype == jnp.dtype(dtype) for g in got)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # Input, norm-scale, kernel and bias gradients. The input's sums three GEMMs' products, each rounded to
    # `dtype` first: within 4 units of the last place (`eps`) of the array's largest value.
    for a, b in zip(jax.tree.leaves(got_vjp(cotangents)), jax.tree.leaves(want_vjp(cotangents)), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0, atol=4 * np.abs(b).max() * float(jnp.finfo(dtype).eps))
    with pytest.raises(ValueError, match="5 parts do not divide the layer's 96 output columns"):
        norm_dense_parts(norm, layer, x, 5)


def test_norm_dense_parts_of_an_fp8_layer_split_its_one_product():
    rngs = nnx.Rngs(4)
    with nnx.use_eager_sharding(False):
        norm = rms_norm(64, rngs=rngs, dtype=jnp.bfloat16, implementation="xla")
        layer = dense(64, 64, ("embed", "heads"), rngs=rngs, use_bias=False, fp8=Fp8Recipe(block=32), dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(5), (40, 64), jnp.bfloat16)
    keys, values = norm_dense_parts(norm, layer, x, 2)
    fused = norm_dense(norm, layer, x)
    np.testing.assert_array_equal(np.asarray(jnp.concatenate([keys, values], -1), np.float32), np.asarray(fused, np.float32))


def test_rope_preserves_norm_and_relative_positions():
    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32)
    rot = lambda x, p: apply_rope(x, rope_table(jnp.array([p]), 8, 10_000.0))
    np.testing.assert_allclose(jnp.linalg.norm(rot(q, 5)), jnp.linalg.norm(q), rtol=1e-6)  # float32: a few u = 6e-8
    # <R_m q, R_n k> depends on m - n only.
    d1 = jnp.sum(rot(q, 7) * rot(k, 3))
    d2 = jnp.sum(rot(q, 14) * rot(k, 10))
    np.testing.assert_allclose(d1, d2, rtol=1e-5)  # float32 cos/sin of larger angles: ~position x u each, 8 terms


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_qk_norm_rope_reference_is_the_flax_norms_then_apply_rope(dtype):
    """The sequence tower's QK-norm + RoPE on the "xla" path (`pallas_kernels.qk_norm_rope`) gives the values and
    gradients of flax's RMSNorm modules followed by `apply_rope`, bit for bit."""
    import pallas_kernels
    from gem_jax.nn.layers import rms_norm

    rng = np.random.default_rng()
    t, h, d = 37, 2, 16
    qkv = jnp.asarray(rng.normal(size=(t, 3, h, d)) * 3, dtype)
    table = rope_table(jnp.asarray(rng.integers(0, 500, t)), d, 10_000.0)
    with nnx.use_eager_sharding(False):
        norms = [rms_norm(d, rngs=nnx.Rngs(0), dtype=jnp.float32) for _ in range(2)]
    for norm in norms:
        norm.scale[...] = jnp.asarray(1 + 0.1 * rng.normal(size=d), jnp.float32)
    (graphdef, q_state), (_, k_state) = map(nnx.split, norms)

    def before(qkv, q_state, k_state):
        q_norm, k_norm = nnx.merge(graphdef, q_state), nnx.merge(graphdef, k_state)
        return apply_rope(q_norm(qkv[:, 0]), table, dtype), apply_rope(k_norm(qkv[:, 1]), table, dtype), qkv[:, 2]

    def after(qkv, q_state, k_state):
        q_norm, k_norm = nnx.merge(graphdef, q_state), nnx.merge(graphdef, k_state)
        return pallas_kernels.qk_norm_rope(
            qkv, q_norm.scale[...], k_norm.scale[...], table.cos, table.sin, eps=q_norm.epsilon, dtype=dtype, implementation="xla"
        )

    scales = (q_state, k_state)
    cts = tuple(jnp.asarray(rng.normal(size=(t, h, d)), dtype) for _ in range(3))
    results = [jax.jit(lambda *a, f=f: (lambda o, vjp: (o, vjp(cts)))(*jax.vjp(f, *a)))(qkv, *scales) for f in (before, after)]
    for a, b in zip(*map(jax.tree.leaves, results)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_qk_norms_of_different_epsilon_are_refused():
    """The QK-norm op takes one eps: a k_norm whose epsilon differs from q_norm's is a clear error, not ignored."""
    from gem_jax.model.sequence_tower import SelfAttentionBlock

    with nnx.use_eager_sharding(False):
        block = SelfAttentionBlock(CONFIG, rngs=nnx.Rngs(1))
    block.k_norm.epsilon = 1e-5
    batch = make_batch(np.random.default_rng(0), [3, 5], capacity=8)
    rope = rope_table(batch.history.positions(), CONFIG.head_dim, CONFIG.rope_base)
    with pytest.raises(ValueError, match="q_norm and k_norm must share epsilon, got 1e-06 and 1e-05"):
        block(jnp.zeros((8, CONFIG.embed_dim)), batch.history, rope)


def test_fp8_switch_swaps_tower_layers_with_the_same_parameters(split_model):
    """`ModelConfig(fp8=True)`: the towers' dense layers become FP8 layers holding the same parameters."""
    from gem_jax.model.sequence_tower import SelfAttentionBlock

    fp8_config = dataclasses.replace(CONFIG, fp8=True)
    with nnx.use_eager_sharding(False):
        _, fp8_params = nnx.split(GEMModel(SPEC, fp8_config, rngs=nnx.Rngs(0)))
        ref_block = SelfAttentionBlock(CONFIG, rngs=nnx.Rngs(1))
        fp8_block = SelfAttentionBlock(fp8_config, rngs=nnx.Rngs(1))
    _, params = split_model
    assert jax.tree.structure(nnx.to_pure_dict(fp8_params)) == jax.tree.structure(nnx.to_pure_dict(params))
    assert isinstance(fp8_block.qkv, Fp8Linear) and isinstance(fp8_block.mlp.up, Fp8Linear)

    batch = make_batch(np.random.default_rng(), [0, 5, 12, 3], capacity=32)
    x = jnp.asarray(np.random.default_rng().normal(size=(32, CONFIG.embed_dim)), jnp.float32)
    history, rope = batch.history, rope_table(batch.history.positions(), CONFIG.head_dim, CONFIG.rope_base)
    ref = np.asarray(ref_block(x, history, rope))[:20]
    out = np.asarray(fp8_block(x, history, rope))[:20]
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    # The block is x + attention(x) + mlp(x): x is exact, and each branch is within one FP8 x FP8 GEMM's error of
    # its float32 value, so the sum is within that share of the output; not zero, else the FP8 path did not run.
    assert rel > 0
    check("FP8 block vs float32", rel, DRAW * product_rms(E4M3, E4M3))


def test_fp8_hadamard_block_is_within_fp8_rounding_like_the_unrotated_one():
    """`ModelConfig(fp8=True, fp8_block=128, fp8_hadamard=True)`: a self-attention block's loss and
    parameter gradients are finite and as close to the float32 block as the unrotated FP8 block's."""
    from gem_jax.model.sequence_tower import SelfAttentionBlock

    plain = dataclasses.replace(CONFIG, embed_dim=128, fp8=True, fp8_block=128)  # whole 128-blocks of features
    batch = make_batch(np.random.default_rng(0), [0, 5, 12, 3], capacity=32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(32, 128)), jnp.float32)
    rope = rope_table(batch.history.positions(), plain.head_dim, plain.rope_base)
    outs = []
    for config in (dataclasses.replace(plain, fp8=False), plain, dataclasses.replace(plain, fp8_hadamard=True)):
        with nnx.use_eager_sharding(False):
            block = SelfAttentionBlock(config, rngs=nnx.Rngs(1))
        outs.append(nnx.jit(nnx.value_and_grad(lambda b: jnp.sum(jnp.sin(b(x, batch.history, rope)[:20]))))(block))
    (value, grads), fp8_outs = outs[0], outs[1:]
    # A parameter's gradient passes through up to three FP8 GEMMs in a row (the forward to the loss, the dgrad
    # back to the layer, the layer's wgrad), each within product_rms(E4M3, E4M3) = 5.1%; their errors can add in
    # the same direction (the loss is a sum of sines of the outputs, whose error feeds every cotangent), so 3x.
    # Measured 7-10% on the loss and each gradient, both FP8 blocks (1.9x under the bound).
    bound = DRAW * 3 * product_rms(E4M3, E4M3)
    for fp8_value, fp8_grads in fp8_outs:
        check("loss", abs(float(fp8_value) - float(value)) / abs(float(value)), bound)
        for (path, g), g8 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(fp8_grads)):
            assert np.all(np.isfinite(np.asarray(g8)))
            check(jax.tree_util.keystr(path), float(np.linalg.norm(np.asarray(g8) - np.asarray(g)) / np.linalg.norm(np.asarray(g))), bound)
    with pytest.raises(ValueError, match="fp8_hadamard must be a bool"):
        ModelConfig(fp8_hadamard="yes")
    with pytest.raises(ValueError, match="blocks of fp8_block=128; embed_dim 96 is not a multiple of it"):
        ModelConfig(embed_dim=96, num_heads=2, fp8=True, fp8_block=128, fp8_hadamard=True)
    with pytest.raises(ValueError, match="Fp8Recipe.block must be 32 or 128, got 0"):
        ModelConfig(embed_dim=96, num_heads=2, fp8=True, fp8_block=0, fp8_hadamard=True)
    # Without the rotation, or with FP8 off, such widths are accepted.
    ModelConfig(embed_dim=96, num_heads=2, fp8=True, fp8_block=128)
    ModelConfig(embed_dim=96, num_heads=2, fp8_block=128, fp8_hadamard=True)
    assert apply_overrides(CONFIG, ["embed_dim=32", "fp8=True", "fp8_hadamard=True"]).fp8_recipe == Fp8Recipe(block=32, hadamard=True)


def test_gradient_norms_bounded_at_init_with_empty_features(split_model):
    """No genres and empty histories give no zero feature token (RMSNorm's 1/sqrt(eps) gradient)."""
    graphdef, params = split_model
    batch = make_batch(np.random.default_rng(), [0, 0, 7], capacity=16)
    batch = Batch(
        history=batch.history, user=batch.user, candidate_item=batch.candidate_item,
        candidate_features={"genres": jnp.zeros_like(batch.candidate_features["genres"])}, labels=batch.labels, weights=batch.weights,
    )
    grads = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p)(batch).sum()))(params)
    norms = {jax.tree_util.keystr(path): float(jnp.linalg.norm(g)) for path, g in jax.tree_util.tree_leaves_with_path(grads)}
    worst = max(norms, key=norms.get)
    assert norms[worst] < 100.0, (worst, norms[worst])


@pytest.mark.parametrize(
    "setting, softmax, gelu", [(None, None, None), ("pallas", "pallas", "pallas"), ("xla", "xla", "xla"), ("cudnn", "cudnn", "xla")]
)
def test_attention_implementation_reaches_each_op(monkeypatch, setting, softmax, gelu):
    """JFA gets the softmax implementation, every GDPA call and the QK-norm + RoPE the GELU one ("cudnn": cuDNN
    + the references)."""
    import dataclasses

    import pallas_kernels

    seen = {"jfa": set(), "gdpa": set(), "qk_norm_rope": set()}

    def recording(name, op):
        def call(*args, implementation=None, **kwargs):
            seen[name].add(implementation)
            return op(*args, implementation="xla", **kwargs)

        return call

    monkeypatch.setattr(pallas_kernels, "jagged_flash_attention", recording("jfa", pallas_kernels.jagged_flash_attention))
    monkeypatch.setattr(pallas_kernels, "gdpa", recording("gdpa", pallas_kernels.gdpa))
    monkeypatch.setattr(pallas_kernels, "qk_norm_rope", recording("qk_norm_rope", pallas_kernels.qk_norm_rope))
    config = dataclasses.replace(CONFIG, attention_implementation=setting)
    with nnx.use_eager_sharding(False):
        model = GEMModel(SPEC, config, rngs=nnx.Rngs(0))
    logits = model(make_batch(np.random.default_rng(), [3, 0, 7], capacity=16))
    assert np.isfinite(np.asarray(logits)).all()
    assert seen == {"jfa": {softmax}, "gdpa": {gelu}, "qk_norm_rope": {gelu}}


@pytest.mark.parametrize("kind", ["sliding_window", "block_local", "causal_silu"])
def test_sequence_attention_kinds_run_and_differ_from_full(split_model, kind):
    """Each `ModelConfig.sequence_attention` runs with the same parameters; a history
    longer than the window / block attends differently from full attention."""
    import dataclasses

    graphdef, params = split_model
    batch = make_batch(np.random.default_rng(0), [12, 0, 3], capacity=20)
    config = dataclasses.replace(CONFIG, sequence_attention=kind, attention_window=2, attention_block_size=4)
    with nnx.use_eager_sharding(False):
        other_graphdef, _ = nnx.split(GEMModel(SPEC, config, rngs=nnx.Rngs(0)))
    full = np.asarray(nnx.merge(graphdef, params)(batch))
    logits = np.asarray(nnx.merge(other_graphdef, params)(batch))
    assert np.isfinite(logits).all()
    assert not np.allclose(logits[0], full[0])


def test_causal_silu_is_hstus_formula(monkeypatch):
    """The causal SiLU history attention asks GDPA for SiLU(Q K^T / sqrt(D)) V / N, N the histories' bound."""
    real_gdpa, calls = pallas_kernels.gdpa, []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real_gdpa(*args, **kwargs)

    monkeypatch.setattr(pallas_kernels, "gdpa", recording)
    config = dataclasses.replace(CONFIG, sequence_attention="causal_silu")
    with nnx.use_eager_sharding(False):
        model = GEMModel(SPEC, config, rngs=nnx.Rngs(0))
    batch = make_batch(np.random.default_rng(), [12, 0, 3], capacity=20)
    assert np.isfinite(np.asarray(model(batch))).all()
    silu = [kw for kw in calls if kw.get("activation") == "silu"]
    assert silu  # one call per layer, or one for the scanned stack
    for kw in silu:
        assert kw["causal"] and kw["scale"] == config.head_dim**-0.5 and kw["output_scale"] == 1.0 / kw["max_seq_len_q"]


# The dense layers of the test model (2 sequence blocks, 1 DHEN layer) by region.
LAYERS = {
    Fp8Region.SEQ_ATTENTION: {f"sequence_tower/blocks/{i}/{n}" for i in (0, 1) for n in ("qkv", "out")},
    Fp8Region.SEQ_MLP: {f"sequence_tower/blocks/{i}/mlp/{n}" for i in (0, 1) for n in ("up", "down")},
    Fp8Region.POOLED: {"sequence_tower/pool/kv"},
    Fp8Region.INTERACTION: {f"{a}/{n}" for a in ("history_context", "feature_to_history") for n in ("q", "kv", "out")},
    Fp8Region.CROSS: {"cross_tower/token_attention/qkv", "cross_tower/token_attention/out", "cross_tower/dhen/0/mix"},
}
ALWAYS_FULL_PRECISION = {
    "embed/item_features/genres", "sequence_tower/pool/out", "cross_tower/dhen/0/dot_expert/proj",
    *(f"cross_tower/dhen/0/cross_expert/layers/{i}" for i in (0, 1)), *(f"heads/{i}/{n}" for i in (0, 1) for n in ("up", "down")),
}  # fmt: skip


def _dense_layers(config: ModelConfig) -> dict[str, type]:
    with nnx.use_eager_sharding(False):
        model = GEMModel(SPEC, config, rngs=nnx.Rngs(0))
    return {"/".join(map(str, p)): type(m) for p, m in nnx.iter_graph(model) if isinstance(m, (nnx.Linear, Fp8Linear))}


@pytest.mark.parametrize(
    "regions",
    [None, (), tuple(Fp8Region), (Fp8Region.SEQ_MLP,), (Fp8Region.INTERACTION, Fp8Region.CROSS)],
    ids=["default", "none", "all", "seq_mlp", "interaction+cross"],
)
def test_regions_choose_exactly_their_layers(regions):
    config = dataclasses.replace(CONFIG, fp8=True) if regions is None else dataclasses.replace(CONFIG, fp8=True, fp8_regions=regions)
    if regions is None:  # the default: the sequence tower's per-token layers
        assert config.fp8_regions == (Fp8Region.SEQ_ATTENTION, Fp8Region.SEQ_MLP, Fp8Region.POOLED)
    layers = _dense_layers(config)
    assert set(layers) == set().union(*LAYERS.values(), ALWAYS_FULL_PRECISION)
    want_fp8 = set().union(*(LAYERS[r] for r in config.fp8_regions))
    assert {name for name, kind in layers.items() if kind is Fp8Linear} == want_fp8


def test_regions_are_ignored_without_fp8_and_the_model_is_unchanged():
    """fp8=False builds plain layers whatever the regions say, with bit-identical logits and gradients."""
    off = dataclasses.replace(CONFIG, fp8_regions=tuple(Fp8Region))
    assert all(kind is nnx.Linear for kind in _dense_layers(off).values())
    batch = make_batch(np.random.default_rng(0), [0, 4, 12, 7], capacity=32)

    def loss_and_grads(config):
        with nnx.use_eager_sharding(False):
            graphdef, params = nnx.split(GEMModel(SPEC, config, rngs=nnx.Rngs(3)))
        loss = lambda p: nnx.merge(graphdef, p)(batch).sum()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    ref, got = loss_and_grads(CONFIG), loss_and_grads(off)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_regions_are_refused_and_overrides_parse_names():
    with pytest.raises(ValueError, match="fp8_regions must be a tuple of"):
        ModelConfig(fp8_regions=("attention",))
    with pytest.raises(ValueError, match="twice"):
        ModelConfig(fp8_regions=(Fp8Region.POOLED, Fp8Region.POOLED))
    assert ModelConfig(fp8_regions=("seq_mlp",)).fp8_regions == (Fp8Region.SEQ_MLP,)
    config = apply_overrides(CONFIG, ["fp8=True", "fp8_regions=SEQ_MLP,CROSS"])
    assert config.fp8_regions == (Fp8Region.SEQ_MLP, Fp8Region.CROSS)
    assert config.fp8_for(Fp8Region.CROSS) == config.fp8_recipe and config.fp8_for(Fp8Region.POOLED) is None
    with pytest.raises(ConfigError, match="fp8_regions"):
        apply_overrides(CONFIG, ["fp8_regions=SEQ_MLP,HEADS"])


def test_start_up_lines_name_each_attention_path_and_the_fp8_options():
    lines = describe_attention(dataclasses.replace(CONFIG, fp8=True, fp8_block=128, fp8_saved_activations=True))
    assert lines[0].startswith("self-attention (full): xla") and lines[1].startswith("GELU attention (GDPA): xla")
    assert lines[2].startswith("QK-norm and RoPE: xla")
    assert lines[3].startswith("RMSNorm (width 16): xla (no Hopper GPU for the Pallas kernels (found cpu)")
    assert lines[4].startswith("MLP GELU backward (sequence tower): the FP8 path")  # the MLPs run in FP8 here
    assert lines[5].startswith("FP8 dense layers (128-wide blocks; seq_attention, seq_mlp, pooled): xla")
    rotated = describe_attention(dataclasses.replace(CONFIG, embed_dim=32, fp8=True, fp8_hadamard=True))[5]
    assert rotated.startswith("FP8 dense layers (32-wide blocks, random Hadamard rotation; seq_attention")
    assert lines[6].startswith("FP8 saved activations (E4M3, 1x128 blocks)")
    assert len(describe_attention(CONFIG)) == 5
    assert len(describe_attention(dataclasses.replace(CONFIG, sequence_attention="block_local"))) == 4  # RoPE in its kernel
    assert describe_attention(dataclasses.replace(CONFIG, mlp_implementation=None))[4].startswith(
        "MLP GELU backward (sequence tower): xla (no Hopper GPU for the Pallas kernels (found cpu)"
    )
    with pytest.raises(pallas_kernels.ImplementationUnavailableError, match=r"^model.mlp_implementation=pallas: gelu_grad_matmul: "):
        describe_attention(dataclasses.replace(CONFIG, mlp_implementation="pallas"))
    assert describe_attention(dataclasses.replace(CONFIG, norm_implementation="xla"))[3].startswith("RMSNorm (width 16): xla (asked for the jnp reference)")
    with pytest.raises(pallas_kernels.ImplementationUnavailableError, match=r"^model.norm_implementation=pallas: rms_norm: implementation='pallas' runs Pallas kernels for Hopper"):
        describe_attention(dataclasses.replace(CONFIG, norm_implementation="pallas"))
    with pytest.raises(pallas_kernels.ImplementationUnavailableError, match=r"^model.attention_implementation=pallas: jagged_flash_attention: "):
        describe_attention(dataclasses.replace(CONFIG, attention_implementation="pallas"))


def test_norm_implementation_is_checked_and_parsed():
    assert ModelConfig(norm_implementation="pallas").norm_implementation is pallas_kernels.Implementation.PALLAS
    assert ModelConfig().norm_implementation is None  # the kernels on a Hopper GPU, flax's computation elsewhere
    assert ModelConfig(norm_implementation="xla").norm_implementation is pallas_kernels.Implementation.XLA
    assert ModelConfig(norm_implementation="PALLAS").norm_implementation is pallas_kernels.Implementation.PALLAS  # as --help-config spells it
    with pytest.raises(ValueError, match="^ModelConfig.norm_implementation must be XLA, PALLAS or None, got CUDNN: RMSNorm has no cuDNN implementation$"):
        ModelConfig(norm_implementation=pallas_kernels.Implementation.CUDNN)
    with pytest.raises(ValueError, match="^ModelConfig.norm_implementation must be XLA, PALLAS or None, got CUDNN: RMSNorm has no cuDNN implementation$"):
        ModelConfig(norm_implementation="cudnn")
    with pytest.raises(ValueError, match="^ModelConfig.norm_implementation must be XLA, PALLAS or None, got 'bogus'$"):
        ModelConfig(norm_implementation="bogus")
    assert apply_overrides(CONFIG, ["norm_implementation=pallas"]).norm_implementation is pallas_kernels.Implementation.PALLAS


def test_the_model_norm_refuses_flax_options_it_does_not_compute():
    for option in ({"use_scale": False}, {"reduction_axes": (-2, -1)}, {"axis_name": "data"}, {"promote_dtype": lambda xs, dtype: xs}):
        with pytest.raises(ValueError, match="RMSNorm computes flax's default"):
            RMSNorm(8, rngs=nnx.Rngs(0), **option)
    assert RMSNorm(8, rngs=nnx.Rngs(0), reduction_axes=-1, use_fast_variance=False).implementation == "xla"


def test_the_xla_norms_are_flax_norms_bit_for_bit():
    """`norm_implementation="xla"` (and the default off a Hopper GPU) computes what flax's `nnx.RMSNorm` computes: the
    model's logits and gradients with every RMSNorm swapped back to flax's class are the same bits (the pre-norm
    blocks' returned inputs included)."""
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GEMModel(SPEC, dataclasses.replace(CONFIG, norm_implementation="xla"), rngs=nnx.Rngs(0)))
    batch = make_batch(np.random.default_rng(5), [3, 0, 7], capacity=16)

    def loss_and_grads(to_flax):
        model = nnx.merge(graphdef, params)
        if to_flax:
            for _, node in nnx.iter_graph(model):
                if isinstance(node, RMSNorm):
                    node.__class__ = nnx.RMSNorm  # the same fields; flax's __call__
        graph, state = nnx.split(model)
        loss = lambda p: jnp.sum(nnx.merge(graph, p)(batch).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(state)

    ours, flax_norms = loss_and_grads(False), loss_and_grads(True)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(flax_norms), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_kernel_norms_in_the_model_match_the_reference():
    """`norm_implementation="pallas"` (the Pallas interpreter on the CPU): every RMSNorm the kernels take runs them
    (the pre-norm blocks pass their residual through them), and the model's loss and gradients are as accurate as
    with flax's norms. Both float32 models are measured against the same model computed in float64 (jax's x64 mode,
    flax's norms, the same parameters and batch): leaf by leaf, the kernels' error is at most twice flax's own
    (the two compute one function with float32 sums in other orders, so their errors are of one size; a floor of
    four float32 ulps keeps a leaf whose flax error happens to be tiny from asking for less). bf16 rounding is the
    op's own test, tests/pallas_kernels/test_rms_norm.py."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    calls = []
    op = pallas_kernels.rms_norm

    def counting(*args, return_input=False, implementation=None, **kwargs):
        calls.append((implementation, return_input))
        return op(*args, return_input=return_input, implementation=implementation, **kwargs)

    batch = make_batch(np.random.default_rng(6), [3, 0, 7], capacity=16)

    def split(setting, dtype):
        config = dataclasses.replace(CONFIG, attention_implementation="xla", norm_implementation=setting, compute_dtype=dtype)
        with nnx.use_eager_sharding(False):
            return nnx.split(GEMModel(SPEC, config, rngs=nnx.Rngs(0)))  # float32 parameters, the same under any setting

    def loss_and_grads(graph, params, inputs, dtype):
        loss = lambda p: jnp.mean(nnx.merge(graph, p)(inputs).astype(dtype) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    with pytest.MonkeyPatch.context() as patch, plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        patch.setattr(pallas_kernels, "rms_norm", counting)
        kernels = loss_and_grads(*split("pallas", "float32"), batch, jnp.float32)
    pallas_calls = [c for c in calls if c[0] == "pallas"]
    # per sequence layer two pre-norms (residual), the final and pooled norms, the cross tower's and the heads'
    assert pallas_calls.count(("pallas", True)) == 2 * CONFIG.num_seq_layers and len(pallas_calls) > 2 * CONFIG.num_seq_layers + 2
    graph, params = split("xla", "float32")
    flax_norms = loss_and_grads(graph, params, batch, jnp.float32)
    graph64, params64 = split("xla", "float64")  # built outside x64: the same float32 parameters as `params`
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params64), strict=True))
    wide = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree)  # noqa: E731
    with jax.enable_x64(True):
        exact = jax.tree.map(lambda a: np.asarray(a, np.float64), loss_and_grads(graph64, wide(params), wide(batch), jnp.float64))
    floor = 4 * 2.0**-24
    leaves = [jax.tree_util.tree_leaves_with_path(t) for t in (kernels, flax_norms, exact)]
    assert len({len(ls) for ls in leaves}) == 1
    for (path, k), (_, f), (_, e) in zip(*leaves):
        k, f = np.asarray(k, np.float64), np.asarray(f, np.float64)
        size = max(np.linalg.norm(e), 1e-30)
        flax_error = max(np.linalg.norm(f - e) / size, floor)
        assert np.linalg.norm(k - e) / size <= 2 * flax_error, (jax.tree_util.keystr(path), np.linalg.norm(k - e) / size, flax_error)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_every_table_exchanges_its_rows_in_the_compute_dtype(compute_dtype):
    """The dtype a sharded table's rows cross the network in is the model's own numerics (each table's
    `exchange_dtype`, from `ModelConfig.compute_dtype`), not something the sharded step passes in; the
    exchange itself honours it (tests/gem_jax/test_shard_context.py); a train state set up for another
    compute dtype is refused."""
    config = dataclasses.replace(CONFIG, compute_dtype=compute_dtype)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GEMModel(SPEC, config, rngs=nnx.Rngs(0)))
    tables = {path: node for path, node in nnx.iter_graph(model) if isinstance(node, EmbeddingTable)}
    assert len(tables) >= 3 + len(SPEC.user_features), sorted(tables)  # item, action, time bucket, each MEAN feature
    assert {node.exchange_dtype for node in tables.values()} == {jnp.dtype(compute_dtype)}
    # A train state for another compute dtype would gather dense weights in one dtype and exchange rows in the other.
    check_exchange_dtypes(model, compute_dtype)
    other = "float32" if compute_dtype == "bfloat16" else "bfloat16"
    with pytest.raises(ValueError, match=rf"embedding table 'embed/\w+' exchanges its rows in {compute_dtype}, but the step's compute dtype is {other}"):
        check_exchange_dtypes(model, other)


def test_tied_qk_init_copies_each_attentions_query_projection_into_its_keys_and_nothing_else():
    with nnx.use_eager_sharding(False):
        plain = dict(nnx.to_flat_state(nnx.state(GEMModel(SPEC, CONFIG, rngs=nnx.Rngs(3)), nnx.Param)))
        tied = dict(nnx.to_flat_state(nnx.state(GEMModel(SPEC, dataclasses.replace(CONFIG, tied_qk_init=True), rngs=nnx.Rngs(3)), nnx.Param)))
    d = CONFIG.embed_dim
    value = {path: np.asarray(v[...]) for path, v in tied.items()}
    keys = {}  # a kernel holding keys -> (the key columns, the query columns they start as)
    for path in value:
        if path[-2:] == ("qkv", "kernel"):  # the sequence tower's blocks and the token attention: [q | k | v]
            keys[path] = (slice(d, 2 * d), value[path][:, :d])
        elif path[-2:] == ("kv", "kernel") and path[0] in ("history_context", "feature_to_history"):  # [k | v], q apart
            keys[path] = (slice(0, d), value[path[:-2] + ("q", "kernel")])
    assert len(keys) == CONFIG.num_seq_layers + 1 + 2, sorted(keys)
    assert set(plain) == set(tied)
    for path, b in value.items():
        a = np.asarray(plain[path][...])
        if path in keys:
            columns, query = keys[path]
            np.testing.assert_array_equal(b[:, columns], query)  # the keys start as the queries
            assert not np.array_equal(a[:, columns], query)
            rest = np.ones(b.shape[1], bool)
            rest[columns] = False
            np.testing.assert_array_equal(b[:, rest], a[:, rest])  # queries and values as drawn
        else:
            np.testing.assert_array_equal(b, a, err_msg=str(path))
    with pytest.raises(ValueError, match="tied_qk_init must be a bool"):
        ModelConfig(tied_qk_init=1)
    assert apply_overrides(CONFIG, ["tied_qk_init=True"]).tied_qk_init is True


def test_tied_qk_init_gives_each_attention_keys_equal_to_its_queries_in_fp8_and_in_the_trainers_init(monkeypatch):
    """The tied columns are the ones each attention op takes as keys: fed the same rows as queries and context, the
    cross attention, the token attention and a self-attention block (every FP8 region, the Hadamard rotation) pass
    the op keys equal to their queries (untied: not). The train state the trainer builds (abstract shapes, then a
    jitted init on a mesh) holds the tie in every attention."""
    import optax
    import pallas_kernels
    from gem_jax.mesh import Topology, make_mesh
    from gem_jax.model.cross_tower import TokenAttention
    from gem_jax.model.interaction import CrossAttention
    from gem_jax.model.sequence_tower import SelfAttentionBlock
    from gem_jax.parallel import DATA_PARALLEL_RULES
    from gem_jax.train.state import create_train_state

    config = dataclasses.replace(CONFIG, embed_dim=32, fp8=True, fp8_regions=tuple(Fp8Region), fp8_hadamard=True)
    seen = []
    for op in ("gdpa", "jagged_flash_attention"):
        def capture(q, k, *args, _op=getattr(pallas_kernels, op), **kwargs):
            seen.append((np.asarray(q), np.asarray(k)))
            return _op(q, k, *args, **kwargs)
        monkeypatch.setattr(pallas_kernels, op, capture)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(12, 32)), jnp.float32)
    offsets = jnp.asarray([0, 5, 12], jnp.int32)
    history = from_lengths(np.ones(12, np.int32), [5, 7], max_seq_len=SPEC.max_seq_len, capacity=12)
    rope = rope_table(jnp.zeros(12, jnp.int32), config.head_dim, config.rope_base)  # one position: q and k rotate alike
    for tied in (True, False):
        with nnx.use_eager_sharding(False):
            modules = [m(dataclasses.replace(config, tied_qk_init=tied), rngs=nnx.Rngs(1)) for m in (CrossAttention, TokenAttention, SelfAttentionBlock)]
        assert all(isinstance(layer, Fp8Linear) for layer in (modules[0].q, modules[0].kv, modules[1].qkv, modules[2].qkv))
        seen.clear()
        modules[0](x, offsets, 7, x, offsets, 7)
        modules[1](x.reshape(3, 4, 32))
        modules[2].attend(x, history, rope)
        assert len(seen) == 3
        for q, k in seen:
            assert np.array_equal(q, k) == tied

    with nnx.use_eager_sharding(False):
        state, _ = create_train_state(lambda rngs: GEMModel(SPEC, dataclasses.replace(config, tied_qk_init=True), rngs=rngs),
                                      optax.sgd(0.1), make_mesh(Topology(), jax.devices()[:1]), DATA_PARALLEL_RULES, 0)
    p, d = jax.tree.map(np.asarray, state.params), config.embed_dim
    for qkv in [*(block["qkv"]["kernel"] for block in p["sequence_tower"]["blocks"].values()), p["cross_tower"]["token_attention"]["qkv"]["kernel"]]:
        np.testing.assert_array_equal(qkv[:, d:2 * d], qkv[:, :d])
    for name in ("history_context", "feature_to_history"):
        np.testing.assert_array_equal(p[name]["kv"]["kernel"][:, :d], p[name]["q"]["kernel"])


def test_tie_key_to_query_refuses_columns_outside_the_kernels():
    from gem_jax.nn.layers import dense, tie_key_to_query

    with nnx.use_eager_sharding(False):
        q, q3 = dense(4, 4, ("embed", "heads"), rngs=nnx.Rngs(0)), dense(3, 4, ("embed", "heads"), rngs=nnx.Rngs(0))
        kv = dense(4, 8, ("embed", "heads"), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"columns \[0, \+4\) of the query kernel \(4, 4\) do not fit columns \[6, \+4\) of the key kernel \(4, 8\)"):
        tie_key_to_query(q, kv, width=4, key_column=6)
    with pytest.raises(ValueError, match=r"the query kernel \(3, 4\) and the key kernel \(4, 8\) take different input widths"):
        tie_key_to_query(q3, kv, width=4, key_column=0)
    for width in (0, -1):
        with pytest.raises(ValueError, match=rf"width must be >= 1, got {width}"):
            tie_key_to_query(q, kv, width=width, key_column=4)
    with pytest.raises(ValueError, match=r"query columns \[0, \+4\) and key columns \[2, \+4\) overlap in one kernel \(4, 8\)"):
        tie_key_to_query(kv, kv, width=4, key_column=2)
    before = np.asarray(kv.kernel[...])
    tie_key_to_query(kv, kv, width=4, key_column=4)  # adjacent ranges of one kernel: fine
    np.testing.assert_array_equal(np.asarray(kv.kernel[...]), np.concatenate([before[:, :4], before[:, :4]], 1))
