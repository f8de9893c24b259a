"""Package faces whose names load on first use (PEP 562), so importing a package stays light."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`'s `__init__`: each name of `exports` comes from its module when first read.

    Args:
      package: the package's `__name__` (for error messages).
      exports: public name -> the module that defines it.

    Returns:
      The two module-level functions; assign them to `__getattr__` and `__dir__`.
    """

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
