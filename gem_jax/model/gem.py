"""The GEM-style model: embeddings, sequence tower, cross-feature tower, interaction, task heads.

Architecture after Meta's GEM engineering description (2025): a sequence tower over the
jagged behaviour history and a cross-feature tower over non-sequence features exchanging
information InterFormer-style, then multi-task heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.batch import PAD_ID, Batch, CategoricalFeature, FeatureSpec, HistoryField, Pooling, check_layout, validate_ids
from gem_jax.model import remat
from gem_jax.model.config import ModelConfig
from gem_jax.model.cross_tower import CrossFeatureTower, uniform_offsets
from gem_jax.model.interaction import CrossAttention
from gem_jax.nn.layers import MLP, EmbeddingTable, dense, name_layers, rms_norm
from gem_jax.model.sequence_tower import SequenceTower

USER_TABLES = "embed/user/"  # path prefix of the user features' modules (`GEMModel.embed.user[name]`)
ITEM_FEATURE_TABLES = "embed/item_features/"  # path prefix of the candidate's side features' modules


def example_tables(spec: FeatureSpec) -> dict[str, int]:
    """The embedding tables looked up once per example, by path, with the ids each example sends.

    Every MEAN-pooled user or item feature: `max_values` ids per example (the history's
    tables look up one id per history row instead; MULTI_HOT features have no table).
    """
    sides = ((USER_TABLES, spec.user_features), (ITEM_FEATURE_TABLES, spec.item_features))
    return {prefix + f.name: f.max_values for prefix, features in sides for f in features if f.pooling is Pooling.MEAN}


def _feature_module(feature: CategoricalFeature, dim: int, rngs: nnx.Rngs, dtype: jnp.dtype) -> EmbeddingTable | nnx.Linear:
    if feature.pooling is Pooling.MULTI_HOT:
        return dense(feature.vocab_size - 1, dim, (None, "embed"), rngs=rngs, dtype=dtype)
    return EmbeddingTable(feature.vocab_size, dim, rngs=rngs, exchange_dtype=dtype)


def _pool(
    feature: CategoricalFeature, module: EmbeddingTable | nnx.Linear, ids: jax.Array, dtype: jnp.dtype, real: jax.Array | None = None
) -> jax.Array:
    """int32 `[n, max_values]` ids -> `[n, d]` in `dtype`, as `feature.pooling` says (`gem_jax.batch.Pooling`).

    bool `real` `[n]` (history rows: False on slack rows) gives zeros on the other rows; a MEAN
    table never looks those up (a sharded table sends only real ids). None: every row is real
    (a candidate's or user's features). A real row without values takes PAD's row (MEAN) or the
    layer's bias (MULTI_HOT).
    """
    ids = jnp.asarray(ids)
    if feature.pooling is Pooling.MULTI_HOT:  # a small vocabulary: the `[n, vocabulary]` multi-hot is small
        b = ids.shape[0]
        hot = jnp.zeros((b, feature.vocab_size), jnp.float32).at[jnp.arange(b)[:, None], ids].set(1.0, mode="drop")[:, 1:]
        pooled = module(hot / jnp.maximum(hot.sum(-1, keepdims=True), 1.0))
        return pooled if real is None else jnp.where(real[:, None], pooled, 0).astype(dtype)
    if feature.max_values == 1 and real is None:
        return module(ids[:, 0]).astype(dtype)
    given = ids != PAD_ID if real is None else (ids != PAD_ID) & real[:, None]
    count = given.sum(-1)
    empty = count == 0 if real is None else real & (count == 0)
    looked_up = given.at[:, 0].set(given[:, 0] | empty)  # a row of PAD only takes PAD's row
    rows = module(ids, looked_up)  # [n, max_values, d] float32 (a sharded table's in its exchange dtype), zeros where not looked up
    return (rows.sum(1) / jnp.maximum(count, 1)[:, None].astype(rows.dtype)).astype(dtype)


class FeatureEmbeddings(nnx.Module):
    """Embedding tables for history events, the candidate item, and the user's and candidate's features.

    Tables are float32 parameters; rows are summed in float32, except a sharded table's, which
    arrive and are summed in `dtype` (each table's `exchange_dtype`), and the tokens are returned
    in `dtype`, the model's compute dtype. Each feature has its own module, named by the
    feature: `user[name]` (`embed/user/<name>`) and `item_features[name]`
    (`embed/item_features/<name>`), an `EmbeddingTable` (MEAN pooling) or a dense layer
    (MULTI_HOT).
    """

    def __init__(self, spec: FeatureSpec, dim: int, *, rngs: nnx.Rngs, dtype: jnp.dtype):
        self.dtype = dtype
        self.spec = spec
        self.item = EmbeddingTable(spec.num_items, dim, rngs=rngs, exchange_dtype=dtype)  # shared by history and candidate
        self.action = EmbeddingTable(spec.num_actions, dim, rngs=rngs, exchange_dtype=dtype)
        self.time_bucket = EmbeddingTable(spec.num_time_buckets, dim, rngs=rngs, exchange_dtype=dtype)
        self.user = nnx.Dict({f.name: _feature_module(f, dim, rngs, dtype) for f in spec.user_features})
        self.item_features = nnx.Dict({f.name: _feature_module(f, dim, rngs, dtype) for f in spec.item_features})

    def history(self, values: jax.Array, real: jax.Array) -> jax.Array:
        """int32 `[T_cap, spec.history_width]` -> `[T_cap, d]` in `dtype`: the sum of the item, action and
        time-bucket embeddings, and with `spec.history_item_features` each item feature's pooled
        embedding, from the candidate's tables (`item_features[name]`).

        bool `real` `[T_cap]` marks the real rows; slack rows get zeros and are never
        looked up (a sharded table sends only real ids).
        """
        tokens = (
            self.item(values[:, HistoryField.ITEM], real)
            + self.action(values[:, HistoryField.ACTION], real)
            + self.time_bucket(values[:, HistoryField.TIME_BUCKET], real)
        )
        columns = self.spec.history_feature_columns
        for feature in self.spec.item_features:
            if feature.name in columns:
                tokens += _pool(feature, self.item_features[feature.name], values[:, columns[feature.name]], jnp.float32, real)
        return tokens.astype(self.dtype)

    def feature_tokens(self, batch: Batch) -> jax.Array:
        """`[B, spec.num_feature_tokens, d]` in `dtype`: one token per user feature, the candidate item, one per item feature."""
        spec, dtype = self.spec, self.dtype
        tokens = [_pool(f, self.user[f.name], batch.user[f.name], dtype) for f in spec.user_features]
        tokens.append(self.item(batch.candidate_item).astype(dtype))
        tokens += [_pool(f, self.item_features[f.name], batch.candidate_features[f.name], dtype) for f in spec.item_features]
        return jnp.stack(tokens, axis=1)


class GEMModel(nnx.Module):
    """Predicts one logit per task for each example of a `Batch`.

    Flow: history embeddings get the example's feature context (cross attention, long Q
    short KV) -> sequence tower (JFA self-attention blocks, GDPA pooled attention) ->
    feature tokens + pooled tokens attend to the history (short Q, long KV) ->
    cross-feature tower (GDPA token attention, DHEN) -> per-task MLP heads.
    """

    def __init__(self, spec: FeatureSpec, config: ModelConfig, *, rngs: nnx.Rngs):
        # Parameters carry logical axis names ("embed", "table_rows", ...) for the sharding
        # planner (`gem_jax.parallel.rules`), not mesh axes: build them unsharded, so the
        # model can be made anywhere, with or without a mesh.
        with nnx.use_eager_sharding(False):
            self._build(spec, config, rngs)
        name_layers(self)  # tables and FP8 layers know their paths: a sharded step's context is keyed by them

    def _build(self, spec: FeatureSpec, config: ModelConfig, rngs: nnx.Rngs) -> None:
        d = config.embed_dim
        self.config = config
        self.spec = spec
        self.num_tokens = spec.num_feature_tokens + config.num_pooled_queries
        self.embed = FeatureEmbeddings(spec, d, rngs=rngs, dtype=config.dtype)
        # A learned embedding per feature-token slot: tells the tokens apart, and keeps a token
        # whose features are empty (no genres, an empty history's pooled output) away from the
        # zero vector, where RMSNorm's gradient is 1/sqrt(eps).
        self.token_type = nnx.Param(
            nnx.with_partitioning(nnx.initializers.normal(d**-0.5), (None, "embed"))(rngs.params(), (self.num_tokens, d))
        )
        self.history_context = CrossAttention(config, rngs=rngs)
        self.sequence_tower = SequenceTower(config, rngs=rngs)
        self.feature_to_history = CrossAttention(config, rngs=rngs)
        self.cross_tower = CrossFeatureTower(self.num_tokens, config, rngs=rngs)
        self.head_norm = rms_norm(self.num_tokens * d, rngs=rngs, dtype=config.dtype, implementation=config.norm_implementation)
        self.heads = nnx.List(
            [MLP(self.num_tokens * d, config.head_hidden, 1, rngs=rngs, dtype=config.dtype, float32_output=True) for _ in spec.tasks]
        )

    def __call__(self, batch: Batch) -> jax.Array:
        """Returns float32 logits `[B, K]`, one column per task (`spec.tasks`).

        Raises:
          ValueError: a batch field of the wrong shape (`Batch` documents the layout), or,
            for a concrete batch (called outside `jit`), an id outside its vocabulary
            (field and position named; inside the trainer the loop checks ids on the host).
        """
        check_layout(batch, self.spec, where="GEMModel input")
        if not isinstance(batch.history.values, jax.core.Tracer):
            validate_ids(batch, self.spec, where="GEMModel input")
        dtype = self.config.dtype
        history = batch.history
        b, base = batch.batch_size, self.spec.num_feature_tokens
        token_type = self.token_type[...].astype(dtype)
        tokens = self.embed.feature_tokens(batch) + token_type[:base]
        x = self.embed.history(history.values, history.valid_mask())
        regions = self.config.remat
        x = remat.region(
            remat.HISTORY_CONTEXT, regions, self.history_context,
            lambda attend, x, context: attend(x, history.offsets, history.max_seq_len, context, uniform_offsets(b, base), base),
            x, tokens.reshape(b * base, -1),
        )
        x, pooled = self.sequence_tower(x, history.replace_values(x))
        tokens = jnp.concatenate([tokens, pooled + token_type[base:]], axis=1)
        f = self.num_tokens
        tokens = remat.region(
            remat.FEATURE_TO_HISTORY, regions, self.feature_to_history,
            lambda attend, tokens, x: attend(tokens, uniform_offsets(b, f), f, x, history.offsets, history.max_seq_len),
            tokens.reshape(b * f, -1), x,
        ).reshape(b, f, -1)
        tokens = self.cross_tower(tokens)
        return remat.region(remat.HEADS, regions, (self.head_norm, self.heads), _heads, tokens.reshape(b, -1))


def _heads(modules: tuple[nnx.Module, nnx.List], flat: jax.Array) -> jax.Array:
    """(head norm, task heads), `[B, F * d]` tokens -> float32 logits `[B, K]`."""
    norm, heads = modules
    flat = norm(flat)
    return jnp.concatenate([head(flat) for head in heads], axis=-1)
