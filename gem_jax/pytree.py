"""Names of pytree leaves: one spelling of a key path for every module that matches paths."""

from __future__ import annotations

from collections.abc import Sequence

import jax


def path_keys(path: Sequence) -> tuple:
    """A `jax.tree_util` key path as a tuple of plain keys (dict key, attribute name or index)."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def path_str(path: Sequence) -> str:
    """A key path as `a/b/0/c`."""
    return "/".join(str(k) for k in path_keys(path))



def mirrored_params(tree, params) -> list[tuple | None]:
    """The parameter each leaf of `tree` (an optimizer state) mirrors.

    A leaf mirrors the parameter whose key path ends the leaf's key path and whose
    shape it has (Adam moments, element-wise Adagrad accumulators), or, for a parameter
    of two or more dimensions, the shape of its rows' index `shape[:-1]` (row-wise
    Adagrad accumulators, one per table row: `mirrors_rows`); step counts and masked
    placeholders mirror none.

    Args:
      tree: any pytree, e.g. an optax state of `params`.
      params: the parameter pytree.

    Returns:
      One entry per leaf of `tree` (`jax.tree.leaves` order): the mirrored
      parameter's key path as plain keys (`path_keys`), or None.
    """
    shapes = {path_keys(path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)}

    def mirrors(shape, leaf_shape):
        return shape is not None and (shape == leaf_shape or mirrors_rows(shape, leaf_shape))

    def pick(path, leaf):
        keys = path_keys(path)
        return next((keys[start:] for start in range(len(keys)) if mirrors(shapes.get(keys[start:]), leaf.shape)), None)

    return [pick(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def mirrors_rows(param_shape: tuple, leaf_shape: tuple) -> bool:
    """Whether a leaf of `leaf_shape` holds one value per row of a parameter of `param_shape` (two or more dims)."""
    return len(param_shape) >= 2 and tuple(leaf_shape) == tuple(param_shape[:-1])
