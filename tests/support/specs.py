"""Small feature specs of the MovieLens layout for model tests: user, age, gender, occupation and multi-hot genres."""

from gem_jax.batch import CategoricalFeature, FeatureSpec, Pooling


def movielens_spec(*, users: int = 9, genres: int = 6, max_genres: int = 5, max_seq_len: int = 12, num_items: int = 40) -> FeatureSpec:
    """A `FeatureSpec` with the built-in MovieLens sources' feature layout at test sizes (tasks `like`, `love`)."""
    return FeatureSpec(
        num_items=num_items,
        num_actions=11,
        num_time_buckets=8,
        tasks=("like", "love"),
        user_features=tuple(CategoricalFeature(name, size) for name, size in (("user", users), ("age", 4), ("gender", 3), ("occupation", 6))),
        item_features=(CategoricalFeature("genres", genres, max_genres, Pooling.MULTI_HOT),),
        max_seq_len=max_seq_len,
    )
