"""Runs written before the feature schema: their spec and parameter names in today's terms.

Such a run's `run.json` records the fixed MovieLens-shaped spec (`num_users`, `num_genres`,
`num_ages`, `num_genders`, `num_occupations`; labels "primary" and "secondary") and its
checkpoints name the user tables by column (`embed/user/0` .. `embed/user/3`: user, age,
gender, occupation) and the genre layer `embed/genres`. In the schema that layout is
the user features "user", "age", "gender", "occupation" and the MULTI_HOT item feature
"genres" (`embed/user/<name>`, `embed/item_features/genres`), with the same shapes, so
`gem_jax.train.restore.load_params` reads such a run through the renaming below. A run
cannot be resumed across the change (`gem_jax.train.run_record` refuses it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from gem_jax.batch import CategoricalFeature, FeatureSpec, Pooling

USER_COLUMNS = ("user", "age", "gender", "occupation")  # the fixed layout's user columns, in order
GENRES = "genres"


def is_legacy_spec(tree: Any) -> bool:
    """Whether a recorded spec is the fixed layout's (it has no task names)."""
    return isinstance(tree, Mapping) and "tasks" not in tree and "num_genres" in tree


def spec_from_legacy(tree: Mapping[str, Any], tasks: tuple[str, ...]) -> FeatureSpec:
    """The schema instance of a recorded fixed-layout spec; `tasks` names its two label columns."""
    sizes = (tree["num_users"], tree.get("num_ages", 1), tree.get("num_genders", 1), tree.get("num_occupations", 1))
    genres = int(tree["num_genres"])
    return FeatureSpec(
        num_items=tree["num_items"],
        num_actions=tree["num_actions"],
        num_time_buckets=tree["num_time_buckets"],
        tasks=tasks,
        user_features=tuple(CategoricalFeature(name, int(size)) for name, size in zip(USER_COLUMNS, sizes)),
        item_features=(CategoricalFeature(GENRES, genres + 1, genres, Pooling.MULTI_HOT),),
        max_seq_len=tree.get("max_seq_len", 200),
    )


def _is_params(x: Any) -> bool:
    return isinstance(x, Mapping) and isinstance(x.get("embed"), Mapping)


def _rename(params: Mapping, to_legacy: bool) -> dict:
    embed = dict(params["embed"])
    if to_legacy:
        user = embed.pop("user")
        embed["user"] = {k: user[name] for k, name in enumerate(USER_COLUMNS)}
        features = dict(embed.pop("item_features"))
        embed[GENRES] = features.pop(GENRES)
    else:
        user = embed.pop("user")
        embed["user"] = {name: user[k] for k, name in enumerate(USER_COLUMNS)}
        embed["item_features"] = {GENRES: embed.pop(GENRES)}
    return {**params, "embed": embed}


def legacy_names(tree: Any) -> Any:
    """`tree` (a `TrainState`, parameters, or any pytree holding parameter dicts such as
    optimizer moments) with every parameter dict's tables under their fixed-layout names."""
    return jax.tree.map(lambda x: _rename(x, True) if _is_params(x) else x, tree, is_leaf=_is_params)


def schema_names(tree: Any) -> Any:
    """The inverse of `legacy_names`: fixed-layout table names to the schema's."""
    return jax.tree.map(lambda x: _rename(x, False) if _is_params(x) else x, tree, is_leaf=_is_params)
