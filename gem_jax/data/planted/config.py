"""`PlantedConfig`: every knob of the planted source, and its named presets.

The defaults are the long-range preset (`LONG_RANGE`); `SHORT_RANGE` plants no
long-range signal (long weight 0) and a stronger recent one (weight 5 against 4),
which keeps its oracle AUC at the long-range preset's (both about 0.77 on a
`time:0.9` split, `benchmarks/quality.md`); its item draws are the same. `small`
shrinks either to a log that generates in well under a second (for tests). What
each knob does is in `gem_jax.data.planted.generator`.
"""

from __future__ import annotations

import dataclasses

from gem_jax.checks import check_float, check_int


@dataclasses.dataclass(frozen=True)
class PlantedConfig:
    """What the planted generator draws (`gem_jax.data.planted.generator` says how).

    Attributes:
      num_users, num_items, num_categories: how many of each; items are split
        into categories of equal size (within one item), so
        `num_items >= num_categories`.
      latent_dim: dimension of the item latent vectors.
      category_share: share of an item vector's variance that its category
        sets (the rest is the item's own), in [0, 1].
      median_length, length_sigma: history lengths are lognormal,
        `floor(median_length * exp(length_sigma * z))`,
      min_length, max_length: then clipped to [min_length, max_length] (the
        clipping is part of the distribution: many users sit at each end).
      start_time, time_span: each user's events are spread uniformly over
        [start_time, start_time + time_span) (Unix seconds).
      item_popularity_sigma, category_popularity_sigma: popularity weights are
        `exp(sigma * z)`: items within their category and in exploration
        draws, categories when an interest phase starts.
      phase_length: mean length (events) of an interest phase; a new phase
        starts at each event with probability 1 / phase_length.
      focus_prob: probability that an event's item comes from the current
        phase's category.
      return_prob: probability that an event at least `long_window[0]` events
        into the user's history returns to a long-ago category (one engaged
        with `long_window` events back, not seen in the last `mid_window`);
        otherwise (and when no such category is found) the item is an
        exploration draw from the whole catalogue.
      return_tries: candidate long-ago events tried per return.
      recent_window: the recent signal uses the last `recent_window` events.
      mid_window: the mid-range signal uses events `recent_window + 1` to
        `mid_window` back; "not seen recently" means not in the last `mid_window`.
      long_window: `(near, far)`: the long-range signal uses events `near` to
        `far` back.
      long_min_count: a category counts as engaged long ago when at least this
        many of those events are in it.
      base_logit: the click logit's constant.
      user_scale, item_scale: standard deviations of the per-user and per-item
        logit effects.
      recent_weight, mid_weight, long_weight: weights of the three history
        signals in the logit (0 removes one).
      seed: every draw follows from it.
    """

    num_users: int = 12_000
    num_items: int = 10_000
    num_categories: int = 500
    latent_dim: int = 16
    category_share: float = 0.5
    median_length: float = 100.0
    length_sigma: float = 1.0
    min_length: int = 8
    max_length: int = 1024
    start_time: int = 1_704_067_200  # 2024-01-01T00:00:00Z
    time_span: int = 180 * 86_400
    item_popularity_sigma: float = 0.35
    category_popularity_sigma: float = 0.35
    phase_length: float = 24.0
    focus_prob: float = 0.5
    return_prob: float = 0.3
    return_tries: int = 8
    recent_window: int = 8
    mid_window: int = 64
    long_window: tuple[int, int] = (256, 1000)
    long_min_count: int = 3
    base_logit: float = -1.5
    user_scale: float = 0.3
    item_scale: float = 0.5
    recent_weight: float = 4.0
    mid_weight: float = 2.0
    long_weight: float = 3.0
    seed: int = 0

    def __post_init__(self):
        for name in ("num_users", "num_items", "num_categories", "latent_dim", "min_length", "return_tries", "recent_window", "long_min_count"):
            check_int(self, name, minimum=1)
        for name in ("max_length", "mid_window", "start_time", "time_span", "seed"):
            check_int(self, name, minimum=0)
        for name in ("median_length", "phase_length"):
            check_float(self, name, positive=True)
        for name in ("length_sigma", "item_popularity_sigma", "category_popularity_sigma", "focus_prob", "return_prob", "category_share", "user_scale", "item_scale"):
            check_float(self, name, minimum=0.0)
        for name in ("base_logit", "recent_weight", "mid_weight", "long_weight"):
            check_float(self, name)
        if self.num_items < self.num_categories:
            raise ValueError(f"PlantedConfig.num_items must be >= num_categories (each category holds an item), got {self.num_items} < {self.num_categories}")
        if self.max_length < self.min_length:
            raise ValueError(f"PlantedConfig.max_length must be >= min_length, got {self.max_length} < {self.min_length}")
        if self.phase_length < 1:
            raise ValueError(f"PlantedConfig.phase_length must be >= 1 (events), got {self.phase_length}")
        if self.category_share > 1 or self.focus_prob + self.return_prob > 1:
            raise ValueError(f"PlantedConfig: category_share and focus_prob + return_prob must be <= 1, got {self.category_share} and {self.focus_prob} + {self.return_prob}")
        if not (isinstance(self.long_window, tuple) and len(self.long_window) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in self.long_window)):
            raise TypeError(f"PlantedConfig.long_window must be a tuple of two ints (near, far), got {self.long_window!r}")
        near, far = self.long_window
        if not self.recent_window < self.mid_window < near <= far:
            raise ValueError(
                f"PlantedConfig windows must satisfy recent_window < mid_window < long_window[0] <= long_window[1], "
                f"got {self.recent_window}, {self.mid_window}, {self.long_window}"
            )


LONG_RANGE = PlantedConfig()
SHORT_RANGE = dataclasses.replace(LONG_RANGE, long_weight=0.0, recent_weight=5.0)
PRESETS = {"long-range": LONG_RANGE, "short-range": SHORT_RANGE}


def small(config: PlantedConfig) -> PlantedConfig:
    """`config` with 1/10 of the users, items and categories (about 1/10 of the events); all else kept."""
    return dataclasses.replace(config, num_users=config.num_users // 10, num_items=config.num_items // 10, num_categories=config.num_categories // 10)
