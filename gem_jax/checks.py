"""Type and range checks for config dataclass fields, raising errors that name the field.

Config dataclasses call these from `__post_init__`, so a bad value is refused where
the config is built (a config file, `--set`, `run.json`), not steps later.
"""

from __future__ import annotations

import math
from typing import Any


def _where(obj: Any, name: str) -> str:
    return f"{type(obj).__name__}.{name}"


def check_int(obj: Any, name: str, *, minimum: int | None = None) -> None:
    """`obj.name` is an int (not a bool, float or string) and `>= minimum`.

    Raises:
      TypeError: not an int (the field, value and its type named).
      ValueError: below `minimum`.
    """
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_where(obj, name)} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{_where(obj, name)} must be >= {minimum}, got {value}")


def check_float(obj: Any, name: str, *, minimum: float | None = None, positive: bool = False) -> None:
    """`obj.name` is a finite real number (int or float, not a bool or string), `>= minimum` or `> 0` if `positive`.

    Raises:
      TypeError: not a number (the field, value and its type named).
      ValueError: not finite, or out of range.
    """
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_where(obj, name)} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{_where(obj, name)} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{_where(obj, name)} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{_where(obj, name)} must be >= {minimum}, got {value}")


def check_bool(obj: Any, name: str) -> None:
    """`obj.name` is a bool (not an int or string).

    Raises:
      TypeError: not a bool (the field, value and its type named).
    """
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise TypeError(f"{_where(obj, name)} must be a bool, got {value!r} ({type(value).__name__})")
