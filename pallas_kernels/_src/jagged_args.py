"""Attention operands given as arrays or as jagged containers.

A jagged container is any object with `.values` (`[T, ...]` rows) and
`.offsets` (int32 `[B+1]`), optionally a static `.max_seq_len` (gem_jax's
`Jagged` is one). The ops take either form, read offsets and bounds from the
containers they are given, and hand back their result in q's container.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def is_jagged(x) -> bool:
    """True for a jagged container (has `.values` and `.offsets`), False for an array."""
    return not isinstance(x, (jax.Array, np.ndarray)) and hasattr(x, "values") and hasattr(x, "offsets")


def values_of(x):
    """The `[T, ...]` rows of a container, or `x` itself."""
    return x.values if is_jagged(x) else x


def with_values(container, values):
    """`container` with its values replaced: `dataclasses.replace` or the container's `.replace(values=...)`.

    Raises:
      TypeError: a container that is neither a dataclass nor has a `replace` method.
    """
    if dataclasses.is_dataclass(container):
        return dataclasses.replace(container, values=values)
    replace = getattr(container, "replace", None)
    if callable(replace):
        return replace(values=values)
    raise TypeError(
        f"cannot return a {type(container).__name__}: a jagged container must be a dataclass or have replace(values=...)"
    )


def shared_offsets(explicit, explicit_name: str, **operands):
    """The offsets `explicit` or the jagged `operands` give, checked to agree; None when none gives any.

    Offsets that are the same array, or concrete and equal, agree. Traced offsets
    (under `jit`) that are different arrays of one shape are taken as agreeing:
    the caller guarantees it.

    Raises:
      ValueError: offsets of different shapes, or concrete offsets that differ
        (naming the first differing index).
    """
    sources = [(explicit_name, explicit)] if explicit is not None else []
    sources += [(f"{name}.offsets", x.offsets) for name, x in operands.items() if is_jagged(x)]
    if not sources:
        return None
    (first_name, first), *rest = sources
    for name, other in rest:
        check_same(first_name, first, name, other)
    return first


def check_same(a_name: str, a, b_name: str, b) -> None:
    """Checks that offsets `a` and `b` agree (see `shared_offsets`).

    Raises:
      ValueError: different shapes, or concrete values that differ (naming the first index).
    """
    if a is b:
        return
    if np.shape(a) != np.shape(b):
        raise ValueError(f"{a_name} {np.shape(a)} and {b_name} {np.shape(b)} disagree: one jagged layout needs one offsets")
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return
    a, b = np.asarray(a), np.asarray(b)
    differ = np.flatnonzero(a != b)
    if differ.size:
        i = int(differ[0])
        raise ValueError(f"{a_name} and {b_name} disagree: {a_name}[{i}]={int(a[i])} != {b_name}[{i}]={int(b[i])}")


def is_count(value) -> bool:
    """Whether `value` is a static int >= 0 (a Python or numpy integer; not a bool, float or array)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= 0


def bound(explicit: int | None, container, explicit_name: str, what: str) -> int:
    """`explicit`, else the container's `max_seq_len`.

    Raises:
      ValueError: neither gives a bound, or it is not a non-negative integer.
    """
    bound_ = explicit if explicit is not None else getattr(container, "max_seq_len", None) if is_jagged(container) else None
    if bound_ is None:
        raise ValueError(f"{explicit_name} missing: pass it, or {what} as a jagged container with a max_seq_len")
    if not is_count(bound_):
        raise ValueError(f"{explicit_name} must be an int >= 0 (a static bound on every sequence length), got {bound_!r}")
    return int(bound_)


def self_attention_operands(q, k, v, offsets, max_seq_len):
    """The operands of a jagged self-attention op (one offsets array for q, k and v), unpacked.

    q, k, v may be arrays or jagged containers; offsets and the bound default from them.

    Returns:
      `(container, q, k, v, offsets, max_seq_len)`: the container q came in (None for an
      array), the three `[T, H, D]` value arrays, the offsets and the bound.

    Raises:
      ValueError: offsets missing or disagreeing, a missing bound, or q, k, v of different shapes
        or of different or non-floating dtypes.
    """
    container = q if is_jagged(q) else None
    offsets = shared_offsets(offsets, "offsets", q=q, k=k, v=v)
    if offsets is None:
        raise ValueError("offsets missing: pass offsets=, or q, k, v as jagged containers (with .values and .offsets)")
    max_seq_len = bound(max_seq_len, container, "max_seq_len", "q")
    q, k, v = (values_of(x) for x in (q, k, v))
    if q.ndim != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one [T, H, D] shape; got {q.shape}, {k.shape}, {v.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating) or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one floating dtype (bfloat16, float16 or float32); got {q.dtype}, {k.dtype}, {v.dtype}")
    return container, q, k, v, offsets, max_seq_len
