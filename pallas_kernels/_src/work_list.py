"""Integer helpers of the on-device work lists (GDPA, JFA): short lists as one XLA fusion over all pairs.

A work list has some hundreds to tens of thousands of items, and building it is
a chain of tiny integer passes whose cost on a GPU is mostly their launches
(a few microseconds each), not their work. While the pairs' integer work stays
under `OPS_LIMIT`, each helper here compares all pairs in one fused reduction
(one launch), where a cumulative sum is a `reduce_window` kernel, a histogram a
scatter and a sort several kernels. Past it that work (an H100 or H200 does
about 1.7e13 integer operations a second: 132 SMs x 64 lanes x 1.98 GHz) would
outgrow those launches, and the helpers take the scan and sort forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import jagged_layout

OPS_LIMIT = 1 << 25  # integer operations of one pairs fusion: about 2 us on an H100 / H200


def _pairs_fit(pairs: int, ops_per_pair: int) -> bool:
    return pairs * ops_per_pair <= OPS_LIMIT


def running_total(x: jax.Array) -> jax.Array:
    """int32 `[n]`: `jnp.cumsum(x)` of int `x [n]` (taken as int32)."""
    x = x.astype(jnp.int32)
    n = x.shape[0]
    if not _pairs_fit(n * n, 3):  # compare, select, add
        return jnp.cumsum(x, dtype=jnp.int32)
    k = jnp.arange(n, dtype=jnp.int32)
    return jnp.sum(jnp.where(k[None, :] <= k[:, None], x[None, :], 0), axis=1, dtype=jnp.int32)


def counts_at_or_below(values: jax.Array, m: int) -> jax.Array:
    """int32 `[m]`: `c[i]` = how many of the int `values [n]` (taken as int32) are <= i.

    `jagged_layout.counts_at_or_below`.
    """
    values = values.astype(jnp.int32)
    if not _pairs_fit(values.shape[0] * m, 2):  # compare, add
        return jagged_layout.counts_at_or_below(values, m)
    at = jnp.arange(m, dtype=jnp.int32)
    return jnp.sum(values[None, :] <= at[:, None], axis=1, dtype=jnp.int32)


def segment_ids(starts: jax.Array, n: int) -> jax.Array:
    """int32 `[n]`: for each slot i, the last of the non-decreasing int `starts [S]` at or below i
    (`jagged_layout.segment_ids`)."""
    return jnp.clip(counts_at_or_below(starts, n) - 1, 0, starts.shape[0] - 1)


def heaviest_first(records: jax.Array, work: jax.Array) -> jax.Array:
    """`records [n, ...]` sorted by int `work [n]`, heaviest first, ties in index order.

    `records[jnp.argsort(-work, stable=True)]` for int32 work above -2^31 (its negation
    must not wrap; the work lists' are >= -1). In the pairs form each record is
    scattered to its rank, the count of the items heavier than it or as heavy and
    before it.
    """
    work = work.astype(jnp.int32)
    n = work.shape[0]
    if not _pairs_fit(n * n, 7):  # three compares, and, or, select, add
        return records[jnp.argsort(-work, stable=True)]
    k = jnp.arange(n, dtype=jnp.int32)
    ahead = (work[None, :] > work[:, None]) | ((work[None, :] == work[:, None]) & (k[None, :] < k[:, None]))
    rank = jnp.sum(ahead, axis=1, dtype=jnp.int32)
    return jnp.zeros_like(records).at[rank].set(records, unique_indices=True)
