"""Per-event feature encodings shared by the readers and the batch builder."""

from __future__ import annotations

import numpy as np

NUM_HALF_STAR_ACTIONS = 11  # PAD_ID plus half-star ratings 0.5..5.0 -> 1..10


def multi_hot_ids(hot: np.ndarray, width: int) -> np.ndarray:
    """0/1 rows `[n, G]` -> int32 ids `[n, width]`: column j as id j + 1, each row's ids ascending, then PAD_ID (0).

    Raises:
      ValueError: a row sets more than `width` columns.
    """
    hot = np.asarray(hot) != 0
    most = int(hot.sum(axis=1).max(initial=0))
    if most > width:
        raise ValueError(f"a row sets {most} columns, more than the {width} values it may hold")
    order = np.argsort(~hot, axis=1, kind="stable")[:, :width]  # set columns first, in column order
    return np.where(np.take_along_axis(hot, order, axis=1), order + 1, 0).astype(np.int32)


def half_star_action(rating: np.ndarray) -> np.ndarray:
    """Star ratings (0.5..5 in steps of 0.5) -> action ids 1..10 (int32, `rating * 2`).

    Raises:
      ValueError: a rating is not a multiple of 0.5 in [0.5, 5].
    """
    doubled = np.asarray(rating, dtype=np.float64) * 2.0
    action = np.rint(doubled)
    bad = np.flatnonzero((action != doubled) | (action < 1) | (action > 10))
    if bad.size:
        raise ValueError(f"rating {float(np.asarray(rating)[bad[0]])} at index {int(bad[0])} is not a half-star in [0.5, 5]")
    return action.astype(np.int32)


def time_bucket(age: np.ndarray, num_time_buckets: int) -> np.ndarray:
    """Log-scaled age buckets: `1 + min(floor(log2(1 + age)), num_time_buckets - 2)`.

    Age 0 -> 1, 1..2 -> 2, 3..6 -> 3, 7..14 -> 4, ...; the last bucket
    (`num_time_buckets - 1`) holds every older age. Ages are in the source's
    time unit (seconds for MovieLens, positions for Amazon Beauty). The log
    scale follows the time-bucketed relative position features of HSTU
    (Zhai et al., 2024) and GEM's event-time features.

    Args:
      age: integer `[...]`, >= 0: target time minus event time.
      num_time_buckets: vocabulary size including PAD_ID, >= 2.

    Returns:
      int32 `[...]` in 1..num_time_buckets-1.

    Raises:
      ValueError: a negative age, or `num_time_buckets < 2`.
    """
    if num_time_buckets < 2:
        raise ValueError(f"num_time_buckets must be >= 2, got {num_time_buckets}")
    age = np.asarray(age)
    if age.size and age.min() < 0:
        raise ValueError(f"negative event age {int(age.min())}: events must precede their target")
    # frexp(x) = (m, e) with x = m * 2**e, 0.5 <= m < 1, so floor(log2(x)) = e - 1 exactly.
    _, exponent = np.frexp(age.astype(np.float64) + 1.0)
    return (1 + np.minimum(exponent - 1, num_time_buckets - 2)).astype(np.int32)
