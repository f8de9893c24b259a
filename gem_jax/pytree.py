"""Names of pytree leaves: one spelling of a key path for every module that matches paths."""

from __future__ import annotations

from collections.abc import Sequence


def path_keys(path: Sequence) -> tuple:
    """A `jax.tree_util` key path as a tuple of plain keys (dict key, attribute name or index)."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def path_str(path: Sequence) -> str:
    """A key path as `a/b/0/c`."""
    return "/".join(str(k) for k in path_keys(path))
