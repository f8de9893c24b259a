"""Index helpers for the jagged `[T_cap, ...]` + `offsets [B+1]` layout.

Shared by the kernels' jnp references and by `gem_jax.jagged`. All but
`check_offsets` are pure jnp, jit-friendly, and gather only real rows, so NaN in
slack rows stays out of results and gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def check_offsets(offsets, capacity: int, max_seq_len: int, *, name: str = "offsets", error=ValueError) -> None:
    """Checks concrete offsets on the host; traced ones (under `jit`) pass unchecked.

    Under `jit` the conditions below are preconditions the caller guarantees (the
    data pipeline builds its offsets to satisfy them).

    Args:
      offsets: integer `[B+1]` row offsets of B sequences into a `[capacity, ...]` buffer.
      capacity: rows of that buffer.
      max_seq_len: bound on every sequence length.
      name: what the messages call the offsets (e.g. "kv_offsets").
      error: the exception class raised.

    Raises:
      `error` (ValueError by default), naming `name` and the first bad index:
      offsets not a 1-D integer array of B+1 >= 1 entries, `offsets[0] != 0`,
      offsets decreasing, `offsets[B] > capacity`, or a length above `max_seq_len`.
    """
    if isinstance(offsets, jax.core.Tracer):
        return
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.shape[0] < 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise error(f"{name} must be a 1-D integer array of B+1 >= 1 entries, got {offsets.dtype} {offsets.shape}")
    if offsets[0] != 0:
        raise error(f"{name}[0] must be 0, got {int(offsets[0])}")
    lengths = np.diff(offsets)
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        i = int(bad[0])
        raise error(f"{name} not monotone: {name}[{i + 1}]={int(offsets[i + 1])} < {name}[{i}]={int(offsets[i])}")
    if offsets[-1] > capacity:
        raise error(f"capacity exceeded: {name}[B]={int(offsets[-1])} > capacity {capacity}")
    long = np.flatnonzero(lengths > max_seq_len)
    if long.size:
        i = int(long[0])
        raise error(f"{name}: sequence {i} has length {int(lengths[i])} > max_seq_len {max_seq_len}")


def counts_at_or_below(values: jax.Array, n: int) -> jax.Array:
    """int32 `[n]`: `c[i]` = how many of the int `values` are <= i.

    Equivalent to `jnp.searchsorted(jnp.sort(values), jnp.arange(n), side="right")`,
    computed as a histogram and a cumulative sum: on a GPU that is two small
    kernels, where a binary search is a loop of tiny ones and a sort several.
    """
    # Negative values count from bin 0 (an index < 0 would wrap); values >= n never count.
    histogram = jnp.zeros((n,), jnp.int32).at[jnp.maximum(values, 0)].add(1, mode="drop")
    return jnp.cumsum(histogram, dtype=jnp.int32)


def segment_ids(offsets: jax.Array, capacity: int) -> jax.Array:
    """int32 `[capacity]`: sequence index of each row; `B` marks slack rows."""
    return (counts_at_or_below(offsets, capacity) - 1).clip(0, offsets.shape[0] - 1)


def positions_in_sequence(offsets: jax.Array, capacity: int) -> jax.Array:
    """int32 `[capacity]`: index of each row inside its sequence; 0 on slack rows."""
    seg = segment_ids(offsets, capacity)
    starts = jnp.concatenate([offsets[:-1], offsets[-1:]])[seg]
    return jnp.where(seg < offsets.shape[0] - 1, jnp.arange(capacity, dtype=jnp.int32) - starts, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def to_padded(values: jax.Array, offsets: jax.Array, max_seq_len: int, fill_value=0) -> jax.Array:
    """Jagged `[T_cap, ...]` -> padded `[B, max_seq_len, ...]`.

    Equivalent to stacking `values[offsets[b]:offsets[b+1]]` padded with
    `fill_value`. Rows past `max_seq_len` in a sequence are not representable:
    validate first. Gathers only real rows, so NaN in slack stays out.

    The gradient is `from_padded` of the cotangent: each real row sits at exactly one
    padded position, so the transpose of this gather is a gather too (jax's own VJP
    would be a scatter-add, slow for bf16 on GPUs).
    """
    return _to_padded(values, offsets, max_seq_len, fill_value)


def _to_padded(values, offsets, max_seq_len, fill_value):
    batch = offsets.shape[0] - 1
    pos = jnp.arange(max_seq_len, dtype=jnp.int32)
    rows = offsets[:-1, None] + pos[None, :]
    valid = pos[None, :] < (offsets[1:] - offsets[:-1])[:, None]
    if values.shape[0] == 0:  # zero capacity: every sequence is empty
        return jnp.full((batch, max_seq_len) + values.shape[1:], fill_value, values.dtype)
    safe_rows = jnp.where(valid, rows, 0)
    gathered = values[safe_rows.reshape(-1)].reshape((batch, max_seq_len) + values.shape[1:])
    mask = valid.reshape(valid.shape + (1,) * (values.ndim - 1))
    return jnp.where(mask, gathered, jnp.asarray(fill_value, values.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def from_padded(padded: jax.Array, offsets: jax.Array, capacity: int, fill_value=0) -> jax.Array:
    """Padded `[B, N, ...]` -> jagged values `[capacity, ...]`; slack rows filled.

    The inverse of `to_padded` for the rows that exist; its gradient is `to_padded` of
    the cotangent (a gather, as for `to_padded`).
    """
    return _from_padded(padded, offsets, capacity, fill_value)


def _from_padded(padded, offsets, capacity, fill_value):
    batch, max_len = padded.shape[:2]
    seg = segment_ids(offsets, capacity)
    pos = positions_in_sequence(offsets, capacity)
    valid = jnp.arange(capacity) < offsets[-1]
    flat = padded.reshape((batch * max_len,) + padded.shape[2:])
    idx = jnp.where(valid, jnp.minimum(seg, batch - 1) * max_len + jnp.minimum(pos, max_len - 1), 0)
    out = flat[idx] if batch * max_len else jnp.zeros((capacity,) + padded.shape[2:], padded.dtype)
    mask = valid.reshape(valid.shape + (1,) * (padded.ndim - 2))
    return jnp.where(mask, out, jnp.asarray(fill_value, padded.dtype))


def _to_padded_fwd(values, offsets, max_seq_len, fill_value):
    shape_only = jnp.zeros((values.shape[0], 0), values.dtype)  # carries the capacity to the backward
    return _to_padded(values, offsets, max_seq_len, fill_value), (offsets, shape_only)


def _to_padded_bwd(max_seq_len, fill_value, residuals, cotangent):
    offsets, shape_only = residuals
    return _from_padded(cotangent, offsets, shape_only.shape[0], 0).astype(shape_only.dtype), None


def _from_padded_fwd(padded, offsets, capacity, fill_value):
    shape_only = jnp.zeros((0,) + padded.shape[:2], padded.dtype)  # carries B and N to the backward
    return _from_padded(padded, offsets, capacity, fill_value), (offsets, shape_only)


def _from_padded_bwd(capacity, fill_value, residuals, cotangent):
    offsets, shape_only = residuals
    return _to_padded(cotangent, offsets, shape_only.shape[2], 0).astype(shape_only.dtype), None


to_padded.defvjp(_to_padded_fwd, _to_padded_bwd)
from_padded.defvjp(_from_padded_fwd, _from_padded_bwd)
