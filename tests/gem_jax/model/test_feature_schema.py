"""A `FeatureSpec` of any user features, item features and tasks: pooling, layout checks, table names."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.batch import PAD_ID, CategoricalFeature, FeatureSpec, Pooling, check_layout, random_batch, validate_ids
from gem_jax.model.config import ModelConfig
from gem_jax.model.gem import FeatureEmbeddings, GEMModel, example_tables
from gem_jax.model.flops import flop_model

TAGS = CategoricalFeature("tags", 7, 3)  # multi-valued, MEAN
SPEC = FeatureSpec(
    num_items=30,
    num_actions=4,
    num_time_buckets=5,
    tasks=("click", "share", "buy"),
    user_features=(CategoricalFeature("user", 9), CategoricalFeature("country", 1), CategoricalFeature("langs", 5, 2)),
    item_features=(TAGS, CategoricalFeature("category", 4, 2, Pooling.MULTI_HOT)),
    max_seq_len=6,
)
CONFIG = ModelConfig(embed_dim=8, num_heads=2, num_seq_layers=1, num_pooled_queries=1, head_hidden=8)


def forward(model: GEMModel, batch) -> np.ndarray:
    """The model's logits, jitted (an eager forward compiles every op on its own)."""
    graphdef, params = nnx.split(model)
    return np.asarray(jax.jit(lambda p, b: nnx.merge(graphdef, p)(b))(params, batch))


def embeddings(seed: int) -> FeatureEmbeddings:
    with nnx.use_eager_sharding(False):
        return FeatureEmbeddings(SPEC, 8, rngs=nnx.Rngs(seed), dtype=jnp.float32)


def test_mean_pooling_averages_the_non_pad_rows_and_an_empty_row_takes_pads_row():
    embed = embeddings(0)
    table = np.asarray(embed.item_features["tags"].embedding[...])
    batch = random_batch(SPEC, np.random.default_rng(0), [1, 2, 0], capacity=4)
    ids = np.array([[3, PAD_ID, 5], [PAD_ID, PAD_ID, PAD_ID], [6, 6, 1]], np.int32)
    batch = dataclasses.replace(batch, candidate_features={**batch.candidate_features, "tags": jnp.asarray(ids)})
    tokens = np.asarray(embed.feature_tokens(batch))
    tags = tokens[:, len(SPEC.user_features) + 1]  # user features, candidate item, then tags
    np.testing.assert_allclose(tags[0], (table[3] + table[5]) / 2, rtol=1e-6)
    np.testing.assert_allclose(tags[1], table[PAD_ID], rtol=1e-6)
    np.testing.assert_allclose(tags[2], (2 * table[6] + table[1]) / 3, rtol=1e-6)  # a repeated id counts twice
    user = np.asarray(embed.user["user"].embedding[...])
    np.testing.assert_allclose(tokens[:, 0], user[np.asarray(batch.user["user"])[:, 0]], rtol=1e-6)


def test_multi_hot_pooling_projects_the_normalized_set_of_ids():
    embed = embeddings(1)
    layer = embed.item_features["category"]
    kernel, bias = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
    assert kernel.shape == (3, 8)  # ids 1..3, PAD has no column
    batch = random_batch(SPEC, np.random.default_rng(0), [1, 0, 0], capacity=2)
    ids = np.array([[2, 3], [PAD_ID, PAD_ID], [1, 1]], np.int32)
    batch = dataclasses.replace(batch, candidate_features={**batch.candidate_features, "category": jnp.asarray(ids)})
    category = np.asarray(embed.feature_tokens(batch))[:, -1]
    np.testing.assert_allclose(category, [(kernel[1] + kernel[2]) / 2 + bias, bias, kernel[0] + bias], rtol=1e-6, atol=1e-7)


def test_the_model_takes_any_schema_and_names_its_tables_by_feature():
    with nnx.use_eager_sharding(False):
        model = GEMModel(SPEC, CONFIG, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model))
    assert set(params["embed"]["user"]) == {"user", "country", "langs"}
    assert set(params["embed"]["item_features"]) == {"tags", "category"}
    assert set(params["embed"]["item_features"]["category"]) == {"kernel", "bias"}
    assert len(params["heads"]) == 3
    assert model.token_type.shape == (SPEC.num_feature_tokens + CONFIG.num_pooled_queries, 8) and SPEC.num_feature_tokens == 6
    logits = forward(model, random_batch(SPEC, np.random.default_rng(), [0, 6, 3], capacity=12))
    assert logits.shape == (3, 3) and np.isfinite(logits).all()
    assert example_tables(SPEC) == {"embed/user/user": 1, "embed/user/country": 1, "embed/user/langs": 2, "embed/item_features/tags": 3}
    assert flop_model(CONFIG, SPEC).per_example > 0


def test_a_schema_without_item_features_and_one_task():
    spec = FeatureSpec(num_items=10, num_actions=2, num_time_buckets=3, tasks=("click",), user_features=(CategoricalFeature("user", 4),), max_seq_len=4)
    with nnx.use_eager_sharding(False):
        model = GEMModel(spec, CONFIG, rngs=nnx.Rngs(0))
    batch = random_batch(spec, np.random.default_rng(), [2, 0], capacity=4)
    assert batch.candidate_features == {} and batch.labels.shape == (2, 1)
    assert forward(model, batch).shape == (2, 1)


def test_random_batch_gives_pad_for_a_vocabulary_of_pad_only():
    batch = random_batch(SPEC, np.random.default_rng(), [1, 1], capacity=2)
    np.testing.assert_array_equal(batch.user["country"], [[PAD_ID], [PAD_ID]])
    assert batch.user["langs"].shape == (2, 2) and batch.candidate_features["tags"].shape == (2, 3)
    validate_ids(batch, SPEC)


def test_layout_and_ids_are_checked_with_the_feature_named():
    batch = random_batch(SPEC, np.random.default_rng(), [1, 1], capacity=2)
    without = dataclasses.replace(batch, user={k: v for k, v in batch.user.items() if k != "langs"})
    with pytest.raises(ValueError, match=r"Batch.user holds features \['country', 'user'\].*missing \['langs'\]"):
        check_layout(without, SPEC)
    narrow = dataclasses.replace(batch, candidate_features={**batch.candidate_features, "tags": batch.candidate_features["tags"][:, :2]})
    with pytest.raises(ValueError, match=r"candidate_features\['tags'\] has shape \(2, 2\), expected \(2, 3\)"):
        check_layout(narrow, SPEC)
    # The field that disagrees with the others' example count is the one named.
    one_more = dataclasses.replace(batch, candidate_item=jnp.concatenate([batch.candidate_item, batch.candidate_item[:1]]))
    with pytest.raises(ValueError, match=r"Batch.candidate_item has shape \(3,\), expected \(2,\)"):
        check_layout(one_more, SPEC)
    offsets = dataclasses.replace(batch, history=dataclasses.replace(batch.history, offsets=batch.history.offsets[:2]))
    with pytest.raises(ValueError, match=r"Batch.history.offsets has shape \(2,\), expected \(3,\)"):
        check_layout(offsets, SPEC)
    # Features are checked against the core fields' count, even when several are stale: each is named.
    stale = dataclasses.replace(batch, user={k: np.concatenate([v, v]) for k, v in batch.user.items()},
                                candidate_features={k: np.concatenate([v, v]) for k, v in batch.candidate_features.items()})
    with pytest.raises(ValueError, match=(
        r"^batch: Batch.user\['user'\] has shape \(4, 1\), expected \(2, 1\); Batch.user\['country'\] has shape \(4, 1\), expected \(2, 1\); "
        r"Batch.user\['langs'\] has shape \(4, 2\), expected \(2, 2\); Batch.candidate_features\['tags'\] has shape \(4, 3\), expected \(2, 3\); "
        r"Batch.candidate_features\['category'\] has shape \(4, 2\), expected \(2, 2\) \(history values are "
    )):
        check_layout(stale, SPEC)
    with pytest.raises(ValueError, match=r"Batch.weights is a list, not an array"):
        check_layout(dataclasses.replace(batch, weights=[1.0, 1.0]), SPEC)
    labels = dataclasses.replace(batch, labels=batch.labels[:, :2])
    with pytest.raises(ValueError, match=r"Batch.labels has shape \(2, 2\), expected \(2, 3\)"):
        with nnx.use_eager_sharding(False):
            GEMModel(SPEC, CONFIG, rngs=nnx.Rngs(0))(labels)
    bad = dataclasses.replace(batch, user={**batch.user, "langs": jnp.array([[1, 0], [2, 5]], jnp.int32)})
    with pytest.raises(ValueError, match=r"user feature 'langs' id 5 at example 1, value 1 is outside the vocabulary \[0, 5\)"):
        validate_ids(bad, SPEC)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tasks": ()}, "tasks is empty"),
        ({"tasks": ("a", "a")}, r"tasks repeats \['a'\]"),
        ({"tasks": ("auc/x",)}, "task name 'auc/x'"),
        ({"user_features": (CategoricalFeature("u", 3), CategoricalFeature("u", 4))}, r"user_features repeats \['u'\]"),
    ],
)
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FeatureSpec(**{"num_items": 5, "num_actions": 2, "num_time_buckets": 2, "tasks": ("t",), **kwargs})


@pytest.mark.parametrize(
    "args, message",
    [(("a b", 3), "feature name 'a b'"), (("x", 0), "'x': vocab_size must be an int >= 1"), (("x", 3, 0), "max_values must be an int >= 1"),
     (("x", 1, 1, Pooling.MULTI_HOT), "vocab_size must be an int >= 2")],
)
def test_bad_features_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        CategoricalFeature(*args)


HISTORY_SPEC = dataclasses.replace(SPEC, history_item_features=True)


def test_history_rows_add_their_items_pooled_features_from_the_candidates_tables():
    """A history token is item + action + time bucket + each item feature pooled as a candidate's (the same
    tables); slack rows stay zero and their ids, out of every vocabulary, are never looked up."""
    assert HISTORY_SPEC.history_feature_columns == {"tags": slice(3, 6), "category": slice(6, 8)} and HISTORY_SPEC.history_width == 8
    with nnx.use_eager_sharding(False):
        embed = FeatureEmbeddings(HISTORY_SPEC, 8, rngs=nnx.Rngs(2), dtype=jnp.float32)
    values = np.array([
        # item, action, bucket, tags x3, category x2
        [4, 1, 2, 3, PAD_ID, 5, 2, 3],
        [7, 2, 1, PAD_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID],  # no values: PAD's row of tags, the bias of category
        [9, 3, 4, 6, 6, 1, 1, PAD_ID],
        [-1, 99, 99, 99, -7, 99, 99, 99],  # slack
    ], np.int32)
    real = np.array([True, True, True, False])
    tokens = np.asarray(embed.history(jnp.asarray(values), jnp.asarray(real)))
    table = {name: np.asarray(getattr(embed, name).embedding[...]) for name in ("item", "action", "time_bucket")}
    tags = np.asarray(embed.item_features["tags"].embedding[...])
    layer = embed.item_features["category"]
    kernel, bias = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
    base = table["item"][values[:3, 0]] + table["action"][values[:3, 1]] + table["time_bucket"][values[:3, 2]]
    expected = base + np.stack([
        (tags[3] + tags[5]) / 2 + (kernel[1] + kernel[2]) / 2 + bias,
        tags[PAD_ID] + bias,
        (2 * tags[6] + tags[1]) / 3 + kernel[0] + bias,
    ])
    np.testing.assert_allclose(tokens[:3], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(tokens[3], 0.0)
    # The same ids as a candidate's features give the same pooled vectors.
    batch = random_batch(SPEC, np.random.default_rng(0), [1, 1, 1], capacity=3)
    batch = dataclasses.replace(batch, candidate_features={"tags": jnp.asarray(values[:3, 3:6]), "category": jnp.asarray(values[:3, 6:8])})
    candidate = np.asarray(embed.feature_tokens(batch))[:, len(SPEC.user_features) + 1 :]
    np.testing.assert_allclose(tokens[:3] - base, candidate.sum(1), rtol=1e-5, atol=1e-6)


def test_history_features_train_the_candidates_tables_and_skip_slack_rows():
    """The gradient of a model on a history-feature batch reaches the tags table's rows of the history rows'
    tags, no row through slack rows (NaN-poisoned values), and the logits are finite."""
    with nnx.use_eager_sharding(False):
        model = GEMModel(HISTORY_SPEC, CONFIG, rngs=nnx.Rngs(0))
    batch = random_batch(HISTORY_SPEC, np.random.default_rng(3), [0, 5, 2], capacity=12, slack_value=-(2**20))
    validate_ids(batch, HISTORY_SPEC)
    graphdef, params = nnx.split(model)

    def loss(p, b):
        return nnx.merge(graphdef, p)(b).sum()

    logits = forward(model, batch)
    assert logits.shape == (3, 3) and np.isfinite(logits).all()
    grads = jax.jit(jax.grad(loss))(params, batch)
    tags_grad = np.asarray(grads["embed"]["item_features"]["tags"]["embedding"][...])
    assert np.isfinite(tags_grad).all()
    history_tags = np.asarray(batch.history.values)[:7, 3:6]
    candidate_tags = np.asarray(batch.candidate_features["tags"])
    touched = set(np.flatnonzero(np.abs(tags_grad).sum(-1)))
    used = set(history_tags[history_tags != PAD_ID].tolist()) | set(candidate_tags[candidate_tags != PAD_ID].tolist())
    assert set(history_tags[history_tags != PAD_ID].tolist()) - set(candidate_tags.ravel().tolist())  # rows only the history uses
    assert touched <= used | {PAD_ID} and touched >= set(history_tags[history_tags != PAD_ID].tolist())


def test_every_wrong_field_of_a_batch_is_named_in_one_error():
    """A batch wrong in several fields: one error names each, in the batch's field order after the fields that are
    not arrays and the feature dicts of other names, each shape with the one expected for the B most core fields give."""
    batch = random_batch(SPEC, np.random.default_rng(), [1, 1], capacity=2)
    wrong = dataclasses.replace(
        batch,
        candidate_item=batch.candidate_item[:1],  # B = 2 by history.offsets and labels (weights is no array)
        user={**batch.user, "langs": batch.user["langs"][:, :1]},
        candidate_features={"tags": batch.candidate_features["tags"], "colour": batch.candidate_features["category"]},
        labels=batch.labels[:, :2],
        weights=[1.0, 1.0],
    )
    with pytest.raises(ValueError) as error:
        check_layout(wrong, SPEC, where="step 7")
    message = str(error.value)
    assert message.startswith(
        "step 7: Batch.weights is a list, not an array (numpy or jax); "
        "Batch.candidate_features holds features ['colour', 'tags'], the spec ['category', 'tags'] (missing ['category'], unknown ['colour']); "
        "Batch.candidate_item has shape (1,), expected (2,); Batch.user['langs'] has shape (2, 1), expected (2, 2); "
        "Batch.labels has shape (2, 2), expected (2, 3) (history values are (item, action, time bucket) id columns"
    ), message
    assert message.endswith("labels [B, tasks]; see gem_jax.Batch)") and message.count("Batch.") == 5
    # No example: the fields that are not arrays are named beside the counts the others give; no shape is compared.
    empty = dataclasses.replace(
        batch, history=dataclasses.replace(batch.history, offsets=batch.history.offsets[:1]), candidate_item=batch.candidate_item[:0],
        labels=batch.labels[:0], weights=[],
    )
    with pytest.raises(ValueError, match=(
        r"^batch: Batch.weights is a list, not an array \(numpy or jax\); a batch holds at least one example; the example counts its "
        r"fields give: history.offsets 0, candidate_item 0, labels 0, weights none \(not an array\)$"
    )):
        check_layout(empty, SPEC)
    # Scalars give no count: B = 2 from history.offsets alone, and each scalar is named with the shape it should have.
    scalars = dataclasses.replace(batch, candidate_item=np.int32(5), labels=np.float32(0), weights=np.float32(1))
    with pytest.raises(ValueError) as error:
        check_layout(scalars, SPEC)
    assert "Batch.candidate_item has shape (), expected (2,); " in str(error.value) and "Batch.labels has shape (), expected (2, 3)" in str(error.value)
    assert "Batch.weights has shape (), expected (2,)" in str(error.value) and "at least one example" not in str(error.value)
    # A feature field that is not a dict is named as such, beside the other wrong fields.
    with pytest.raises(ValueError, match=(
        r"^batch: Batch.user is a NoneType, not a dict of feature name to array; Batch.candidate_item has shape \(\), expected \(2,\)"
    )):
        check_layout(dataclasses.replace(scalars, user=None), SPEC)


def test_history_feature_columns_are_checked_with_the_row_named():
    batch = random_batch(HISTORY_SPEC, np.random.default_rng(), [2, 1], capacity=4)
    with pytest.raises(ValueError, match=r"history.values has shape \(4, 8\), expected \('T', 3\)"):
        check_layout(batch, SPEC)
    values = np.asarray(batch.history.values).copy()
    values[2, 4] = 7  # row 2, the second tags column: tags' vocabulary is [0, 7)
    bad = dataclasses.replace(batch, history=batch.history.replace_values(jnp.asarray(values)))
    with pytest.raises(ValueError, match=r"history item feature 'tags' id 7 at history row 2, value 1 is outside the vocabulary \[0, 7\)"):
        validate_ids(bad, HISTORY_SPEC)
