"""The GEM-style model: embeddings, sequence tower, cross-feature tower, interaction, task heads.

Architecture after Meta's GEM engineering description (2025): a sequence tower over the
jagged behaviour history and a cross-feature tower over non-sequence features exchanging
information InterFormer-style, then multi-task heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.batch import Batch, FeatureSpec, HistoryField, Task, UserField, validate_ids
from gem_jax.model import remat
from gem_jax.model.config import ModelConfig
from gem_jax.model.cross_tower import CrossFeatureTower, uniform_offsets
from gem_jax.model.interaction import CrossAttention
from gem_jax.nn.layers import MLP, EmbeddingTable, dense, rms_norm
from gem_jax.model.sequence_tower import SequenceTower

NUM_BASE_TOKENS = len(UserField) + 2  # user fields, candidate item, candidate genres
USER_TABLES = "embed/user/"  # path prefix of the user-field tables (`GEMModel.embed.user`): one id per example


class FeatureEmbeddings(nnx.Module):
    """Embedding tables for history events, user fields and the candidate.

    Tables are float32 parameters; rows are summed in float32 and the
    tokens returned in `dtype`, the model's compute dtype.
    """

    def __init__(self, spec: FeatureSpec, dim: int, *, rngs: nnx.Rngs, dtype: jnp.dtype):
        self.dtype = dtype
        self.item = EmbeddingTable(spec.num_items, dim, rngs=rngs)  # shared by history and candidate
        self.action = EmbeddingTable(spec.num_actions, dim, rngs=rngs)
        self.time_bucket = EmbeddingTable(spec.num_time_buckets, dim, rngs=rngs)
        self.user = nnx.List([EmbeddingTable(size, dim, rngs=rngs) for size in spec.user_vocab_sizes()])
        self.genres = dense(spec.num_genres, dim, (None, "embed"), rngs=rngs, dtype=dtype)

    def history(self, values: jax.Array, real: jax.Array) -> jax.Array:
        """int32 `[T_cap, 3]` -> `[T_cap, d]` in `dtype`: sum of item, action and time-bucket embeddings.

        bool `real` `[T_cap]` marks the real rows; slack rows get zeros and are never
        looked up (a sharded table sends only real ids).
        """
        return (
            self.item(values[:, HistoryField.ITEM], real)
            + self.action(values[:, HistoryField.ACTION], real)
            + self.time_bucket(values[:, HistoryField.TIME_BUCKET], real)
        ).astype(self.dtype)

    def feature_tokens(self, batch: Batch) -> jax.Array:
        """`[B, NUM_BASE_TOKENS, d]` in `dtype`: one token per user field, the candidate item, its genres."""
        lookups = [table(batch.user[:, field]) for field, table in zip(UserField, self.user)] + [self.item(batch.candidate_item)]
        genres = batch.candidate_genres / jnp.maximum(batch.candidate_genres.sum(-1, keepdims=True), 1.0)
        return jnp.stack([row.astype(self.dtype) for row in lookups] + [self.genres(genres)], axis=1)


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

    def _build(self, spec: FeatureSpec, config: ModelConfig, rngs: nnx.Rngs) -> None:
        d = config.embed_dim
        self.config = config
        self.spec = spec
        self.num_tokens = NUM_BASE_TOKENS + config.num_pooled_queries
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
        self.head_norm = rms_norm(self.num_tokens * d, rngs=rngs, dtype=config.dtype)
        self.heads = nnx.List(
            [MLP(self.num_tokens * d, config.head_hidden, 1, rngs=rngs, dtype=config.dtype, float32_output=True) for _ in Task]
        )

    def __call__(self, batch: Batch) -> jax.Array:
        """Returns float32 logits `[B, len(Task)]`.

        Raises:
          ValueError: a batch field of the wrong shape (`Batch` documents the layout), or,
            for a concrete batch (called outside `jit`), an id outside its vocabulary
            (field and position named; inside the trainer the loop checks ids on the host).
        """
        self._check_layout(batch)
        dtype = self.config.dtype
        history = batch.history
        b, base = batch.batch_size, NUM_BASE_TOKENS
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

    def _check_layout(self, batch: Batch) -> None:
        b = batch.batch_size
        expected = {
            "history.values": ((None, len(HistoryField)), batch.history.values.shape),
            "user": ((b, len(UserField)), batch.user.shape),
            "candidate_genres": ((b, self.spec.num_genres), batch.candidate_genres.shape),
            "labels": ((b, len(Task)), batch.labels.shape),
            "weights": ((b,), batch.weights.shape),
        }
        for name, (want, got) in expected.items():
            if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got)):
                shown = tuple("T" if w is None else w for w in want)
                raise ValueError(
                    f"Batch.{name} has shape {tuple(got)}, expected {shown} "
                    "(history values are (item, action, time bucket) id columns; see gem_jax.Batch)"
                )
        if not isinstance(batch.history.values, jax.core.Tracer):
            validate_ids(batch, self.spec, where="GEMModel input")


def _heads(modules: tuple[nnx.Module, nnx.List], flat: jax.Array) -> jax.Array:
    """(head norm, task heads), `[B, F * d]` tokens -> float32 logits `[B, len(Task)]`."""
    norm, heads = modules
    flat = norm(flat)
    return jnp.concatenate([head(flat) for head in heads], axis=-1)
