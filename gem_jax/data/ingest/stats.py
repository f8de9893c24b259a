"""Sequence-length statistics of an event log: `length_summary` is the distribution the
manifest records (token capacities are planned from it); `text_histogram` prints it."""

from __future__ import annotations

import numpy as np


def length_summary(lengths: np.ndarray) -> dict:
    """The distribution of sequence lengths (int `[u]`, one per user, each >= 1).

    Returns:
      `{"count", "events", "mean", "std", "min", "max", "quantiles": {"p50", "p90", "p99"},
      "histogram": {"edges", "counts"}}`; the histogram's bins are powers of two:
      `counts[i]` users have `edges[i] <= length < edges[i + 1]`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return {"count": 0, "events": 0, "mean": 0.0, "std": 0.0, "min": 0, "max": 0, "quantiles": {}, "histogram": {"edges": [1, 2], "counts": [0]}}
    top = int(lengths.max())
    edges = [1 << k for k in range(max(1, top.bit_length()) + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return {
        "count": int(lengths.size),
        "events": int(lengths.sum()),
        "mean": float(lengths.mean()),
        "std": float(lengths.std()),
        "min": int(lengths.min()),
        "max": top,
        "quantiles": {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)},
        "histogram": {"edges": edges, "counts": counts.tolist()},
    }


def text_histogram(summary: dict, width: int = 40) -> str:
    """The summary's histogram as text bars, one line per power-of-two bin."""
    edges, counts = summary["histogram"]["edges"], summary["histogram"]["counts"]
    top = max(counts) if counts and max(counts) else 1
    lines = []
    for low, high, count in zip(edges, edges[1:], counts):
        label = f"{low}" if high == low + 1 else f"{low}-{high - 1}"
        lines.append(f"  {label:>13} | {'#' * round(width * count / top):<{width}} {count}")
    return "\n".join(lines)
