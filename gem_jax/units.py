"""Byte counts as people read them, one format for every start-up line and report."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """`n` bytes as GB, MB or kB (powers of 1000, as `budget_gb`), three significant digits, e.g. "106 MB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"
