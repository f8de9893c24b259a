"""Split an event log by time, per user, into train and eval targets.

Each user with n >= 2 events holds out their last `max(1, floor(eval_fraction * n))`
events as eval targets; every earlier event (and every event of a user with a
single event) is a train target. Each event is the target of exactly one
example, so no eval target is ever a train target. This is the per-user
"leave the last events out" protocol of sequential recommenders (SASRec, Kang &
McAuley 2018; HSTU, Zhai et al. 2024), generalised from one event to a fraction.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gem_jax.data.events import EventLog


@dataclasses.dataclass(frozen=True)
class Split:
    """Train and eval target events of an `EventLog` (indices into its arrays).

    Attributes:
      user_offsets: int64 `[num_users + 1]`, the log's per-user event ranges.
      eval_start: int64 `[num_users]`: user u's eval events are
        `[eval_start[u], user_offsets[u + 1])`, their train events
        `[user_offsets[u], eval_start[u])`.
      train_targets: int64 `[E_train]` sorted event indices.
      eval_targets: int64 `[E_eval]` sorted event indices.
    """

    user_offsets: np.ndarray
    eval_start: np.ndarray
    train_targets: np.ndarray
    eval_targets: np.ndarray

    def horizon(self, user: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """int64 `[E]`: the end of the span of events that may define a target's label.

        For a train target it is the user's `eval_start` (held-out events never
        shape a training label); for an eval target, the end of the user's events.
        """
        is_eval = targets >= self.eval_start[user]
        return np.where(is_eval, self.user_offsets[user + 1], self.eval_start[user])


def split_by_time(log: EventLog, eval_fraction: float) -> Split:
    """Splits each user's time-ordered events into train and eval targets.

    Args:
      log: a sorted `EventLog`.
      eval_fraction: in (0, 1): the share of each user's latest events held out.

    Returns:
      A `Split`.

    Raises:
      ValueError: `eval_fraction` outside (0, 1).
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    offsets = log.user_offsets
    counts = np.diff(offsets)
    num_eval = np.where(counts >= 2, np.maximum(1, np.floor(eval_fraction * counts)), 0).astype(np.int64)
    eval_start = offsets[1:] - num_eval
    events = np.arange(log.num_events, dtype=np.int64)
    is_eval = events >= eval_start[log.user]
    return Split(
        user_offsets=offsets,
        eval_start=eval_start,
        train_targets=np.flatnonzero(~is_eval).astype(np.int64),
        eval_targets=np.flatnonzero(is_eval).astype(np.int64),
    )
