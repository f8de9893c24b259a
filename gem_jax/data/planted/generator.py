"""The planted source: a synthetic event log whose click probabilities are known.

Every event's click probability `p` is a fixed function of the user, the item
and the user's earlier events, and its label is a Bernoulli(p) draw, so the
best possible predictor (the oracle) is known, and so is what each part of the
history contributes to it. The log is written like a user's own log
(`gem_jax.data.planted.files`) and goes through `gem-data convert`; the oracle is
measured on any split of it by `gem_jax.train.oracle`. Every draw follows from
`PlantedConfig.seed` (numpy `default_rng([seed, stream])`, one stream per part),
so the same config gives the same log, bit for bit.

**Catalogue.** `num_items` items in `num_categories` categories of equal size
(item k is in category `k * num_categories // num_items`). Each item has a
popularity weight `exp(item_popularity_sigma * z)`, a unit latent vector
`normalize(sqrt(s) mu_c + sqrt(1 - s) eps_i)` (s = `category_share`; `mu_c`
shared by its category, `eps_i` its own, both standard normal in
`latent_dim` dimensions) and an effect `item_scale * z`. Each category has a
popularity weight `exp(category_popularity_sigma * z)`; each user an effect
`user_scale * z`.

**Histories.** User u has `L_u = clip(floor(median_length * exp(length_sigma * z)),
min_length, max_length)` events (lognormal: a long tail, clipped at
`max_length`: 1024 by default; set 4096 for a longer variant). Its events
are spread uniformly over `[start_time, start_time + time_span)`: sorted
uniform draws, in whole seconds, made strictly increasing within the user
(a tie moves the later event one second on, rarely past the end), so a user's events have one
time order and a global time split (`time:Q`) holds out the last part of
every user's history. A user's sequence is a series of interest phases: each
event starts a new phase with probability `1 / phase_length` (the first
always does), and a phase's category is drawn by category popularity. Each
event's item is drawn in one of three ways (`Draw`):

- FOCUS (probability `focus_prob`): from the phase's category, by item popularity;
- RETURN (probability `return_prob`, only at history position >= `long_window[0]`):
  from a category the user engaged with long ago and not recently: up to
  `return_tries` events `long_window[0]..long_window[1]` back (uniform
  distance) are tried, and the first whose category has at least
  `long_min_count` events in that window and none in the last `mid_window`
  events is taken; then an item of that category, by item popularity;
- EXPLORE (otherwise, and when no try succeeds): from the whole catalogue, by
  item popularity.

**Click probability.** For event t with item i of user u, whose earlier events
(history, position 0 = oldest) are known,

    logit = base_logit + user_u + item_i + recent_weight * recent + mid_weight * mid + long_weight * long
    p = sigmoid(logit),  click ~ Bernoulli(p)

- recent: the mean dot product of item i's latent vector with those of the
  last `recent_window` (8) history items (fewer at the start, 0 without history);
- mid: the share of the events `recent_window + 1` to `mid_window` (9..64) back
  whose item is in i's category (0 when there are none);
- long: 1 when at least `long_min_count` (3) of the events `long_window`
  (256..1000) back are in i's category and none of the last `mid_window` (64)
  are, else 0: returning to a long-ago interest. A RETURN draw always has
  long = 1; other draws can have it by chance.

All three are functions of the history's item ids (and the catalogue), which a
sequence model sees; long needs events at least 256 back (a trainer sees all of
its window with `max_seq_len >= long_window[1]`). The weighted terms
are kept per event (`PlantedLog.terms`), so the oracle without a signal is its
logit minus that term.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from gem_jax.data.planted.config import PlantedConfig

TERMS = ("user", "item", "recent", "mid", "long")  # the logit's terms besides base_logit, in PlantedLog.terms
HISTORY_TERMS = ("recent", "mid", "long")
LONG_RANGE_TERMS = ("long",)
_LENGTHS, _CATALOGUE, _SEQUENCE, _RETURNS, _TIMES, _CLICKS = range(6)  # random streams
_CHUNK = 1 << 20  # events per block of the recent-signal dot products


class Draw(enum.IntEnum):
    """How an event's item was drawn (module docstring)."""

    FOCUS = 0
    RETURN = 1
    EXPLORE = 2


@dataclasses.dataclass(frozen=True)
class PlantedLog:
    """N events of U users over I items, sorted by (user, time).

    Attributes:
      config: what generated it.
      user_offsets: int64 `[U + 1]`: user u's events are `user_offsets[u]:user_offsets[u + 1]`.
      user, item: int64 `[N]` user and item index of each event.
      time: int64 `[N]` Unix seconds, strictly increasing within a user.
      draw: uint8 `[N]` `Draw` of each event's item.
      item_category: int64 `[I]` category of each item.
      item_vectors: float64 `[I, latent_dim]` unit latent vector of each item.
      terms: float64 `[N]` per name of `TERMS`: the logit's terms (weights applied).
      logit: float64 `[N]`: `config.base_logit` plus the terms.
      p: float64 `[N]`: `sigmoid(logit)`, the click probability.
      click: uint8 `[N]` in {0, 1}: the label, a Bernoulli(p) draw.
    """

    config: PlantedConfig
    user_offsets: np.ndarray
    user: np.ndarray
    item: np.ndarray
    time: np.ndarray
    draw: np.ndarray
    item_category: np.ndarray
    item_vectors: np.ndarray
    terms: dict[str, np.ndarray]
    logit: np.ndarray
    p: np.ndarray
    click: np.ndarray

    @property
    def num_events(self) -> int:
        return int(self.user.shape[0])


@dataclasses.dataclass(frozen=True)
class _Catalogue:
    category: np.ndarray  # int64 [I]
    first: np.ndarray  # int64 [C]: category c holds items first[c]:first[c + 1] ([C + 1])
    popularity_cdf: np.ndarray  # float64 [I + 1]: cumulative item weights from 0
    category_cdf: np.ndarray  # float64 [C]: cumulative category probabilities
    vectors: np.ndarray  # float64 [I, latent_dim], unit rows
    item_effect: np.ndarray  # float64 [I]
    user_effect: np.ndarray  # float64 [U]


def _rng(config: PlantedConfig, stream: int) -> np.random.Generator:
    return np.random.default_rng([config.seed, stream])


def _catalogue(config: PlantedConfig) -> _Catalogue:
    rng = _rng(config, _CATALOGUE)
    num_items, num_categories = config.num_items, config.num_categories
    category = np.arange(num_items, dtype=np.int64) * num_categories // num_items
    first = np.searchsorted(category, np.arange(num_categories + 1))
    weights = np.exp(config.item_popularity_sigma * rng.standard_normal(num_items))
    category_weights = np.exp(config.category_popularity_sigma * rng.standard_normal(num_categories))
    centres = rng.standard_normal((num_categories, config.latent_dim))
    own = rng.standard_normal((num_items, config.latent_dim))
    vectors = np.sqrt(config.category_share) * centres[category] + np.sqrt(1.0 - config.category_share) * own
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return _Catalogue(
        category=category,
        first=first,
        popularity_cdf=np.concatenate([[0.0], np.cumsum(weights)]),
        category_cdf=np.cumsum(category_weights) / category_weights.sum(),
        vectors=vectors,
        item_effect=config.item_scale * rng.standard_normal(num_items),
        user_effect=config.user_scale * rng.standard_normal(config.num_users),
    )


def _popular_items(catalogue: _Catalogue, category: np.ndarray | None, uniform: np.ndarray) -> np.ndarray:
    """int64 items drawn by popularity with uniforms `uniform`: within `category` (int64 `[n]`), or from all items (None)."""
    cdf = catalogue.popularity_cdf
    if category is None:
        low, high = np.zeros_like(uniform, dtype=np.int64), np.full(uniform.shape, cdf.size - 1, dtype=np.int64)
    else:
        low, high = catalogue.first[category], catalogue.first[category + 1]
    target = cdf[low] + uniform * (cdf[high] - cdf[low])
    return np.clip(np.searchsorted(cdf, target, side="right") - 1, low, high - 1)


def _lengths(config: PlantedConfig) -> np.ndarray:
    z = _rng(config, _LENGTHS).standard_normal(config.num_users)
    lengths = np.floor(config.median_length * np.exp(config.length_sigma * z))
    return np.clip(lengths, config.min_length, config.max_length).astype(np.int64)


def _categories(config: PlantedConfig, offsets: np.ndarray, planned: np.ndarray, want_return: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each event's category, with the RETURN draws resolved position by position.

    Args:
      offsets: int64 `[U + 1]` user event ranges.
      planned: int64 `[N]` the category if the event is not a RETURN.
      want_return: bool `[N]` events drawn as RETURN (position >= long_window[0]).

    Returns:
      int64 `[N]` categories and bool `[N]`: the RETURN draws that found a category.
    """
    near, far = config.long_window
    window = config.mid_window
    lengths = np.diff(offsets)
    rows = np.argsort(-lengths, kind="stable")  # longest first: the users still active at position t are a prefix
    row_start, row_length = offsets[:-1][rows], lengths[rows]
    tries = _rng(config, _RETURNS).random((int(want_return.sum()), config.return_tries))
    try_row = np.cumsum(want_return) - 1
    counts = np.int16 if far <= np.iinfo(np.int16).max else np.int32
    recent_count = np.zeros((config.num_users, config.num_categories), counts)
    far_count = np.zeros((config.num_users, config.num_categories), counts)
    category = planned.copy()
    returned = np.zeros(planned.shape, bool)
    for t in range(int(row_length[0])):
        k = int(np.searchsorted(-row_length, -t, side="left"))  # rows longer than t
        starts, active = row_start[:k], np.arange(k)
        # Slide the windows to events [t - mid_window, t) and [t - far, t - near].
        if t >= 1:
            recent_count[active, category[starts + t - 1]] += 1
        if t > window:
            recent_count[active, category[starts + t - window - 1]] -= 1
        if t >= near:
            far_count[active, category[starts + t - near]] += 1
        if t > far:
            far_count[active, category[starts + t - far - 1]] -= 1
        events = starts + t
        asking = np.flatnonzero(want_return[events])
        if asking.size == 0:
            continue
        asked = events[asking]
        back = near + np.floor(tries[try_row[asked]] * (min(far, t) - near + 1)).astype(np.int64)
        candidates = category[asked[:, None] - back]
        fits = (far_count[asking[:, None], candidates] >= config.long_min_count) & (recent_count[asking[:, None], candidates] == 0)
        first = np.argmax(fits, axis=1)
        found = fits[np.arange(asking.size), first]
        category[asked[found]] = candidates[found, first[found]]
        returned[asked[found]] = True
    return category, returned


def window_counts(group: np.ndarray, position: np.ndarray, near: int, far: int, stride: int) -> np.ndarray:
    """int64 `[N]`: for each event, the events of its group at positions `[position - far, position - near]`.

    Args:
      group: int64 `[N]` a key per event (here: user and category), >= 0.
      position: int64 `[N]` history position within the user, < `stride`.
      near, far: the window, `1 <= near <= far` events back.
      stride: a bound on positions (keys are `group * stride + position`).
    """
    base = group * stride
    keys = np.sort(base + position)
    upper = position - near
    left = np.searchsorted(keys, base + np.maximum(position - far, 0), side="left")
    right = np.searchsorted(keys, base + upper, side="right")
    return np.where(upper >= 0, right - left, 0)


def recent_affinity(config: PlantedConfig, vectors: np.ndarray, item: np.ndarray, position: np.ndarray) -> np.ndarray:
    """float64 `[N]`: mean dot product of each event's item vector with the last `recent_window` items' (0 at position 0).

    The recent signal before its weight, for any item vectors `[I, latent_dim]` (the catalogue's, or
    others: `benchmarks/planted_ceilings.py` scores the signal a model could read off the categories).
    `item` and `position` are int `[N]`: each event's item and its position in its user's sequence.
    """
    total = np.zeros(item.shape, np.float64)
    for lo in range(0, item.size, _CHUNK):
        index = np.arange(lo, min(lo + _CHUNK, item.size))
        own = vectors[item[index]]
        for k in range(1, config.recent_window + 1):
            earlier = vectors[item[np.maximum(index - k, 0)]]
            total[index] += np.where(position[index] >= k, np.einsum("nd,nd->n", own, earlier), 0.0)
    return total / np.maximum(np.minimum(position, config.recent_window), 1)


def category_signals(config: PlantedConfig, user: np.ndarray, category: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(mid, long)`, float64 `[N]` each: the mid-range and long-range signals before their weights.

    Functions of the categories of each user's events (module docstring): mid, the share of the events
    `recent_window + 1` to `mid_window` back in the event's category; long, 1 where at least
    `long_min_count` of the events `long_window` back are in it and none of the last `mid_window`.
    `user`, `category` (the event's item's) and `position` (in the user's sequence, < `max_length + 1`)
    are int `[N]`, events grouped by user in sequence order.
    """
    stride = config.max_length + 1
    group = user * config.num_categories + category
    mid_events = np.clip(position - config.recent_window, 0, config.mid_window - config.recent_window)
    mid = window_counts(group, position, config.recent_window + 1, config.mid_window, stride) / np.maximum(mid_events, 1)
    engaged = window_counts(group, position, *config.long_window, stride) >= config.long_min_count
    seen_recently = window_counts(group, position, 1, config.mid_window, stride) > 0
    return mid, (engaged & ~seen_recently).astype(np.float64)


def _times(config: PlantedConfig, user: np.ndarray, position: np.ndarray) -> np.ndarray:
    """int64 `[N]` Unix seconds: sorted uniform draws per user, strictly increasing (module docstring)."""
    uniform = _rng(config, _TIMES).random(user.size)
    uniform = uniform[np.lexsort((uniform, user))]  # events are grouped by user: sorts within each user
    seconds = config.start_time + np.floor(uniform * config.time_span).astype(np.int64)
    lift = user * (np.int64(config.time_span) + config.max_length + 1)  # later users above earlier ones: one running max
    return np.maximum.accumulate(seconds - position + lift) - lift + position


def generate(config: PlantedConfig) -> PlantedLog:
    """Draws the planted log of `config` (module docstring); deterministic in `config`.

    Time and memory grow with the events: about 2.5 s and 0.4 GB per million
    events on one core (the `int16 [U, C]` window counts add `4 U C` bytes; C = num_categories).
    """
    catalogue = _catalogue(config)
    lengths = _lengths(config)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    user = np.repeat(np.arange(config.num_users, dtype=np.int64), lengths)
    position = np.arange(n, dtype=np.int64) - offsets[user]

    rng = _rng(config, _SEQUENCE)
    phase = np.cumsum((position == 0) | (rng.random(n) < 1.0 / config.phase_length)) - 1
    phase_category = np.searchsorted(catalogue.category_cdf, rng.random(int(phase[-1]) + 1), side="right")
    focus_category = np.minimum(phase_category, config.num_categories - 1)[phase]
    how = rng.random(n)
    focus = how < config.focus_prob
    want_return = ~focus & (how < config.focus_prob + config.return_prob) & (position >= config.long_window[0])
    explored = _popular_items(catalogue, None, rng.random(n))
    in_category = rng.random(n)
    planned = np.where(focus, focus_category, catalogue.category[explored])
    category, returned = _categories(config, offsets, planned, want_return)
    item = np.where(focus | returned, _popular_items(catalogue, category, in_category), explored)
    draw = np.where(focus, Draw.FOCUS, np.where(returned, Draw.RETURN, Draw.EXPLORE)).astype(np.uint8)

    mid, long = category_signals(config, user, category, position)
    terms = {
        "user": catalogue.user_effect[user],
        "item": catalogue.item_effect[item],
        "recent": config.recent_weight * recent_affinity(config, catalogue.vectors, item, position),
        "mid": config.mid_weight * mid,
        "long": config.long_weight * long,
    }
    logit = config.base_logit + sum(terms[name] for name in TERMS)
    p = 1.0 / (1.0 + np.exp(-logit))
    click = (_rng(config, _CLICKS).random(n) < p).astype(np.uint8)
    return PlantedLog(
        config=config,
        user_offsets=offsets,
        user=user,
        item=item,
        time=_times(config, user, position),
        draw=draw,
        item_category=catalogue.category,
        item_vectors=catalogue.vectors,
        terms=terms,
        logit=logit,
        p=p,
        click=click,
    )
