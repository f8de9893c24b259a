"""What a model can reach on a planted log, by what it reads off the history: the oracle and its ceilings.

    PYTHONPATH=. python3 benchmarks/planted_ceilings.py --preset long-range --online --learned-vectors --out benchmarks/results/planted_ceilings_long_range.json

`gem_jax.train.oracle.oracle_report` on the split (`--split`, as `gem-data convert --split` takes it)
scores the oracle, the item-mean baseline, and the oracle without the history or without its long-range
part. Beside them this scores the **categories-only** ceiling: the oracle with its recent term computed
from each item's category mean vector (the mean of its category's items' latent vectors) instead of its
own. That is what a model that knows each history item's category, but not the item's own latent
direction, can reach: the mid and long-range terms are functions of the categories already, and the user
and item effects stay, as a model learns them from the user and item ids. That ceiling still knows the
true effects and weights; the **fitted** row learns them from the train events alone: a logistic
regression of the labels on a bias, one effect per user and per item and the three history signals
before their weights (the categories-only recent signal, mid and long: `generator.category_signals`),
fitted by L-BFGS (scipy) to the mean log loss plus `l2` times the squared effects, `l2` chosen from
`L2_GRID` by the NE of the train events' last tenth in time held out, then refitted on every train
event. It is what a model of exactly the planted form, reading categories, learns from this much data:
what is left between it and the categories-only ceiling is the cost of estimating 22,000 effects from
the train split (a converted log gives a model the same inputs: user ids as its user token, item ids,
categories). **fitted_item_vectors** is the same fit with the recent signal from each item's own latent
vector (the oracle's): a ceiling for a model that has learned the items' latent directions exactly,
the effects still estimated from the train split. Two more fitted rows ask what the user effects are
worth: **fitted_no_user**, the same without them (a model with neither a user id nor its events'
outcomes), and **fitted_past_outcomes**, without them but with the user's click rate over its earlier
events as a fourth signal (`past_click_logit`: what history rows that carry their events' outcomes
tell about the user). With `--online`, the **fitted_online_<passes>** rows ask what the fitted form
learns within a job's budget rather than at convergence: the same inputs trained as the GEM-width job
(`configs/planted_gem.py`) trains, in shuffled batches of 1024 train events with that config's own
optimizer (row-wise Adagrad on the effects, AdamW with warm-up and cosine decay on the bias and
weights; both rates chosen on the held-out tenth), for 1800 steps (the job's 1.07 passes) and for 2, 4
and 8 passes. With `--learned-vectors`, the **learned_<form>_<passes>** rows drop the last thing the fitted
rows are given: the latent vectors. Their recent signal is the mean dot product of vectors learned from the ids
(an embedding table under the job's row-wise Adagrad, the planted `latent_dim` or 1024 wide, trained as the online rows,
rates and the vectors' starting scale chosen on the held-out tenth): `category_vectors`, one per category (what
a model reading the history's categories can learn), and `item_vectors`, each item's category vector plus its
own (the oracle's form, what a model reading item ids can learn), 16 wide for the job's budget and for 4 passes,
and 1024 wide (the GEM width) for the job's budget. They are the planted form learning what a network has to
learn, within the data a job sees. Each row's share of the oracle's AUC lift over the item-mean baseline is reported beside
it. The log is generated in memory (`gem_jax.data.planted.generate`), as `gem-data plant` writes it for
the same preset and seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import optimize

from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.planted import PRESETS, PlantedConfig, generate, log_truth, small
from gem_jax.data.planted.generator import category_signals, recent_affinity
from gem_jax.nn.layers import EMBEDDING_PARAM
from gem_jax.train.config import TrainConfig, load_config
from gem_jax.train.optimizer import make_optimizer
from gem_jax.train.oracle import eval_mask, oracle_report, quality

L2_GRID = (1e-7, 1e-6, 1e-5, 1e-4)  # the fitted row's penalty on squared user and item effects, per mean log loss
VALIDATION_QUANTILE = 0.9  # the train events from this time quantile on choose the penalty


def category_mean_vectors(vectors: np.ndarray, category: np.ndarray) -> np.ndarray:
    """float64 `[I, latent_dim]`: each item's category mean of `vectors` (float `[I, latent_dim]`; `category` int `[I]`, ids from 0)."""
    sums = np.zeros((int(category.max()) + 1, vectors.shape[1]))
    np.add.at(sums, category, vectors)
    return (sums / np.bincount(category)[:, None])[category]


def fitted_logit(params: np.ndarray, user: np.ndarray, item: np.ndarray, signals: np.ndarray, num_users: int) -> np.ndarray:
    """float64 `[N]`: `bias + user effect + item effect + signals @ weights` of `params` (`fit_logistic`'s)."""
    k = signals.shape[1]
    return params[0] + signals @ params[1:1 + k] + params[1 + k:1 + k + num_users][user] + params[1 + k + num_users:][item]


def fit_logistic(user: np.ndarray, item: np.ndarray, signals: np.ndarray, labels: np.ndarray, num_users: int, num_items: int, l2: float) -> np.ndarray:
    """Fits `fitted_logit` to 0/1 `labels` `[N]`: mean log loss + `l2` x (sum of squared user and item effects).

    Ridge-penalised logistic regression (effects as one-hot columns, their gradients summed by `np.bincount`),
    minimised by scipy's L-BFGS-B (Byrd, Lu, Nocedal & Zhu 1995) with the exact gradient.

    Args:
      user, item: int `[N]` ids in `[0, num_users)`, `[0, num_items)`; signals: float `[N, K]`.

    Returns:
      float64 `[1 + K + num_users + num_items]`: bias, signal weights, user effects, item effects.

    Raises:
      RuntimeError: L-BFGS did not converge (its message).
    """
    n, k = signals.shape
    y = labels.astype(np.float64)

    def loss_and_grad(params):
        logit = fitted_logit(params, user, item, signals, num_users)
        effects = params[1 + k:]
        loss = np.mean(np.logaddexp(0.0, logit) - y * logit) + l2 * effects @ effects
        residual = (0.5 * (1.0 + np.tanh(0.5 * logit)) - y) / n  # d loss / d logit (sigmoid, overflow-free)
        grad = np.concatenate([
            [residual.sum()], signals.T @ residual,
            np.bincount(user, residual, minlength=num_users), np.bincount(item, residual, minlength=num_items),
        ])
        grad[1 + k:] += 2.0 * l2 * effects
        return loss, grad

    result = optimize.minimize(loss_and_grad, np.zeros(1 + k + num_users + num_items), jac=True, method="L-BFGS-B", options={"maxiter": 2000})
    if not result.success:
        raise RuntimeError(f"planted_ceilings: the logistic fit did not converge (l2={l2}): {result.message}")
    return result.x


def held_out_tenth(time: np.ndarray, is_eval: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(train, fit_on, held)`: int64 indices of the train events (bool `is_eval` `[N]` False), and of those
    before and from the `VALIDATION_QUANTILE` of their times (`time` int `[N]`): a fit's rates or penalty are
    chosen by the NE of `held` after fitting `fit_on`, then refitted on `train`."""
    train = np.flatnonzero(~is_eval)
    later = time[train] >= np.quantile(time[train], VALIDATION_QUANTILE)
    return train, train[~later], train[later]


def fitted_row(user, item, signals, labels, time, is_eval, num_users: int, num_items: int) -> dict:
    """The fitted row (module docstring): `{"quality": Quality on the eval events, "l2": the chosen penalty,
    "validation_ne": {l2: NE of the held-out train tenth}, "weights": the signals' fitted weights}`."""

    def fit(events, setting):
        return None, fit_logistic(user[events], item[events], signals[events], labels[events], num_users, num_items, setting[0])

    def logit(params, events):
        return fitted_logit(params, user[events], item[events], signals[events], num_users)

    row = chosen_and_refitted(fit, logit, [(l2,) for l2 in L2_GRID], time, is_eval, labels)
    return {"quality": row["quality"], "l2": row["setting"][0], "validation_ne": row["validation_ne"],
            "weights": row["params"][1:1 + signals.shape[1]].tolist()}


# The online rows: the planted form trained as the GEM-width job (configs/planted_gem.py) trains: its batch size
# and OptimConfig through `make_optimizer` (AdamW with its warm-up share and the cosine to 10% of the peak on the bias
# and signal weights, row-wise Adagrad from its accumulator on the effects, a table of one-wide rows), shuffled
# batches; both rates chosen from these grids on the train split's last tenth.
ONLINE_PASSES = (None, 2.0, 4.0, 8.0)  # passes over the train events; None: the job's own budget (num_steps batches)
EFFECT_RATES = (0.03, 0.1, 0.3, 1.0)
WEIGHT_RATES = (3e-3, 1e-2, 3e-2)
JOB_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "planted_gem.py"


def job_optimizer(job: TrainConfig, steps: int, effect_lr: float, weight_lr: float) -> optax.GradientTransformation:
    """`job.optim` through `make_optimizer` with its dense rate `weight_lr`, its embedding rate `effect_lr`, and its
    warm-up share and cosine decay stretched to `steps` updates."""
    warmup = max(1, round(job.optim.warmup_steps / job.loop.num_steps * steps))  # the job's warm-up share of any budget
    return make_optimizer(dataclasses.replace(job.optim, learning_rate=weight_lr, embedding_learning_rate=effect_lr,
                                              warmup_steps=warmup, decay_steps=max(1, steps - warmup)))


def shuffled_batches(n: int, batch: int, steps: int, seed: int = 0) -> np.ndarray:
    """int64 `[steps, batch]` indices into `n` events: each pass its own seeded permutation cut into batches, the
    last, shorter batch of a pass dropped (as the trainer's shuffled batches drop it)."""
    per_pass = n // batch
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(n)[: per_pass * batch] for _ in range(-(-steps // per_pass))])
    return order[: steps * batch].reshape(steps, batch)


def train_online(loss, params, optimizer: optax.GradientTransformation, batches: np.ndarray):
    """`params` after one `optimizer` update of `loss(params, batch)` per row of `batches`, in one `lax.scan`."""

    def step(carry, batch):
        params, state = carry
        updates, state = optimizer.update(jax.grad(loss)(params, batch), state, params)
        return (optax.apply_updates(params, updates), state), None

    (params, _), _ = jax.jit(lambda carry: jax.lax.scan(step, carry, jnp.asarray(batches)))((params, optimizer.init(params)))
    return params


def fit_online(user, item, signals, labels, num_users: int, num_items: int, *, steps: int, effect_lr: float, weight_lr: float,
               job: TrainConfig, seed: int = 0) -> np.ndarray:
    """`steps` minibatch steps of the planted form's mean log loss with `job`'s optimizer (the ONLINE_* comment).

    Args:
      user, item: int `[N]` ids in `[0, num_users)`, `[0, num_items)`; signals: float `[N, K]`; labels: 0/1 `[N]`.
      steps: updates, over `shuffled_batches` of `job.data.batch_size`.
      effect_lr, weight_lr: `job.optim`'s embedding and dense rates, replaced; its schedule is stretched to `steps`
        (`job_optimizer`).
      job: the GEM-width job's config (`load_config(JOB_CONFIG)`).

    Returns:
      float64 `[1 + K + num_users + num_items]` (`fit_logistic`'s layout): bias, signal weights, user and item
      effects; trained in float32.
    """
    k = signals.shape[1]
    user, item = jnp.asarray(user, jnp.int32), jnp.asarray(item, jnp.int32) + num_users
    signals, labels = jnp.asarray(signals, jnp.float32), jnp.asarray(labels, jnp.float32)

    def loss(params, batch):
        effects = params["effects"][EMBEDDING_PARAM][:, 0]
        logit = params["dense"][0] + signals[batch] @ params["dense"][1:] + effects[user[batch]] + effects[item[batch]]
        return jnp.mean(jnp.logaddexp(0.0, logit) - labels[batch] * logit)

    params = {"dense": jnp.zeros(1 + k), "effects": {EMBEDDING_PARAM: jnp.zeros((num_users + num_items, 1))}}
    batches = shuffled_batches(user.size, job.data.batch_size, steps, seed)
    params = train_online(loss, params, job_optimizer(job, steps, effect_lr, weight_lr), batches)
    return np.concatenate([np.asarray(params["dense"], np.float64), np.asarray(params["effects"][EMBEDDING_PARAM][:, 0], np.float64)])


def chosen_and_refitted(fit, logit, grid, time, is_eval, labels) -> dict:
    """Fits `fit(events, setting) -> (steps, params)` on the train split's first nine tenths in time for each setting
    of `grid` (tuples), keeps the one whose `logit(params, events)` has the lowest NE on the last tenth, refits it on
    every train event and scores the eval events: `{"steps", "quality", "setting": list, "validation_ne":
    {"a/b/...": NE}, "params": the refit's}`."""
    train, fit_on, held = held_out_tenth(time, is_eval)
    validation_ne = {setting: quality(logit(fit(fit_on, setting)[1], held), labels[held]).ne for setting in grid}
    chosen = min(validation_ne, key=validation_ne.get)
    steps, params = fit(train, chosen)
    scored = quality(logit(params, np.flatnonzero(is_eval)), labels[is_eval])
    return {"steps": steps, "quality": scored, "setting": list(chosen), "params": params,
            "validation_ne": {"/".join(f"{v:g}" for v in setting): ne for setting, ne in validation_ne.items()}}


def job_passes(passes: float | None, job: TrainConfig, train_events: int) -> float:
    """`passes` over the train events, or for None the job's own budget: `num_steps` batches."""
    return job.loop.num_steps * job.data.batch_size / train_events if passes is None else float(passes)


def online_rows(user, item, signals, labels, time, is_eval, num_users: int, num_items: int, passes_list=ONLINE_PASSES) -> dict:
    """The planted form trained online (`fit_online`) for each of `passes_list` (passes over the train events;
    None: the job's `num_steps` batches): `{f"{passes:.3f}": {"steps", "quality" on the eval events, "rates":
    (effect, weight) chosen by the NE of the train split's last tenth in time after the same passes over the rest,
    "validation_ne"}}`."""
    job = load_config(JOB_CONFIG)
    batch = job.data.batch_size
    labels = labels.astype(np.float64)
    rows = {}
    for passes in passes_list:
        passes = job_passes(passes, job, int((~is_eval).sum()))

        def fit(events, rates):
            steps = max(1, round(passes * events.size / batch))
            params = fit_online(user[events], item[events], signals[events], labels[events], num_users, num_items,
                                steps=steps, effect_lr=rates[0], weight_lr=rates[1], job=job)
            return steps, params

        def logit(params, events):
            return fitted_logit(params, user[events], item[events], signals[events], num_users)

        row = chosen_and_refitted(fit, logit, [(e, w) for e in EFFECT_RATES for w in WEIGHT_RATES], time, is_eval, labels)
        row["rates"] = row.pop("setting")
        rows[f"{passes:.3f}"] = row
    return rows


# The learned-vector rows: the planted form with its recent signal from item vectors learned from the ids, as a
# network has to learn them, trained as the online rows are (the job's batches and optimizer; the vectors are an
# embedding table under its row-wise Adagrad). CATEGORY_VECTORS: one learned vector per category (what the history's
# categories allow); ITEM_VECTORS: each item's category vector plus one of its own (the oracle's form). Each run is
# (form, width, passes, starting scales): vectors `width` wide (None: the planted `latent_dim`), trained for `passes`
# over the train events (None: the job's `num_steps` batches), starting from N(0, scale^2); the rates and the scale
# are chosen on the held-out tenth. The GEM-width runs (1024 wide, ~50 s a fit on a CPU) try one scale.
CATEGORY_VECTORS, ITEM_VECTORS = "category_vectors", "item_vectors"
VECTOR_RUNS = (
    (CATEGORY_VECTORS, None, None, (0.03, 0.1, 0.3)), (CATEGORY_VECTORS, None, 4.0, (0.03, 0.1, 0.3)),
    (ITEM_VECTORS, None, None, (0.03, 0.1, 0.3)), (ITEM_VECTORS, None, 4.0, (0.03, 0.1, 0.3)),
    (CATEGORY_VECTORS, 1024, None, (0.01,)), (ITEM_VECTORS, 1024, None, (0.01,)),
)
VECTOR_EFFECT_RATES = (0.03, 0.1, 0.3)
VECTOR_WEIGHT_RATES = (1e-2, 3e-2)
VECTOR_SCORE_CHUNK = 65_536  # events a scoring call takes


def recent_items(item: np.ndarray, position: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 `[N, window]`: each event's items 1..`window` events back in its user's sequence, and float32 `[N, window]`:
    1 where that event exists (`position` >= its distance), else 0 (its item column is then a filler)."""
    back = np.arange(1, window + 1)
    earlier = np.arange(item.size)[:, None] - back
    return item[np.maximum(earlier, 0)].astype(np.int32), (position[:, None] >= back).astype(np.float32)


def vector_logit(params, inputs: dict, batch, form: str):
    """float32 `[B]`: the planted logit with learned vectors: bias + user and item effects + mid and long weights x
    their signals + recent weight x the mean dot product of the event's item vector with its recent items' (as
    `generator.recent_affinity`), the vectors those of `form` (module comment above `CATEGORY_VECTORS`).

    `inputs` (int32/float32 jnp arrays over the log's N events): `user`, `item` `[N]`, `recent` and `recent_mask`
    `[N, W]` (`recent_items`), `signals` `[N, 2]` (mid, long), `category` `[I]`, `num_users`, `num_categories`."""
    table = params["vectors"][EMBEDDING_PARAM]
    num_categories = inputs["num_categories"]

    def vectors(item):
        own = table[num_categories + item] if form == ITEM_VECTORS else 0.0
        return table[inputs["category"][item]] + own

    mask = inputs["recent_mask"][batch]
    dots = jnp.einsum("bd,bwd->bw", vectors(inputs["item"][batch]), vectors(inputs["recent"][batch]))
    recent = jnp.sum(dots * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    dense, effects = params["dense"], params["effects"][EMBEDDING_PARAM][:, 0]
    return (dense[0] + dense[1] * recent + inputs["signals"][batch] @ dense[2:] + effects[inputs["user"][batch]]
            + effects[inputs["num_users"] + inputs["item"][batch]])


def fit_online_vectors(inputs: dict, labels, events: np.ndarray, *, form: str, num_items: int, width: int, steps: int,
                       effect_lr: float, weight_lr: float, init_scale: float, job: TrainConfig, seed: int = 0) -> dict:
    """`steps` minibatch steps of `vector_logit`'s mean log loss over `events` (int indices into `inputs`' events;
    0/1 float32 `labels` `[N]`) with `job`'s optimizer (`job_optimizer`): the bias and weights start at 0 but the
    recent weight at 1, the effects at 0, the vectors at N(0, `init_scale`^2). Returns the params (jnp pytree)."""
    rows = inputs["num_categories"] + (num_items if form == ITEM_VECTORS else 0)
    params = {
        "dense": jnp.array([0.0, 1.0, 0.0, 0.0]),
        "effects": {EMBEDDING_PARAM: jnp.zeros((inputs["num_users"] + num_items, 1))},
        "vectors": {EMBEDDING_PARAM: init_scale * jax.random.normal(jax.random.key(seed), (rows, width))},
    }

    def loss(params, batch):
        logit = vector_logit(params, inputs, batch, form)
        return jnp.mean(jnp.logaddexp(0.0, logit) - labels[batch] * logit)

    batches = events[shuffled_batches(events.size, job.data.batch_size, steps, seed)]
    return train_online(loss, params, job_optimizer(job, steps, effect_lr, weight_lr), batches)


def vector_rows(log, config: PlantedConfig, signals: np.ndarray, is_eval: np.ndarray, runs=VECTOR_RUNS) -> dict:
    """The learned-vector rows (comment above `CATEGORY_VECTORS`) of the planted `log` generated from `config`, with its
    mid and long `signals` `[N, 2]`: `{f"{form}_{width}_{passes:.3f}": chosen_and_refitted's row, its setting (effect
    rate, weight rate, init scale)}` for each of `runs`."""
    job = load_config(JOB_CONFIG)
    position = np.arange(log.num_events) - log.user_offsets[log.user]
    recent, recent_mask = recent_items(log.item, position, config.recent_window)
    inputs = {
        "user": jnp.asarray(log.user, jnp.int32), "item": jnp.asarray(log.item, jnp.int32), "recent": jnp.asarray(recent),
        "recent_mask": jnp.asarray(recent_mask), "signals": jnp.asarray(signals, jnp.float32),
        "category": jnp.asarray(log.item_category, jnp.int32), "num_users": config.num_users, "num_categories": config.num_categories,
    }
    labels = log.click.astype(np.float64)
    labels32 = jnp.asarray(labels, jnp.float32)
    scorers = {form: jax.jit(lambda params, batch, form=form: vector_logit(params, inputs, batch, form))
               for form in (CATEGORY_VECTORS, ITEM_VECTORS)}
    rows = {}
    for form, width, passes, scales in runs:
        width = config.latent_dim if width is None else width
        passes = job_passes(passes, job, int((~is_eval).sum()))

        def logit(params, events, score=scorers[form]):
            return np.concatenate([np.asarray(score(params, jnp.asarray(events[lo:lo + VECTOR_SCORE_CHUNK])), np.float64)
                                   for lo in range(0, events.size, VECTOR_SCORE_CHUNK)])

        def fit(events, setting, form=form, width=width, passes=passes):
            steps = max(1, round(passes * events.size / job.data.batch_size))
            return steps, fit_online_vectors(inputs, labels32, events, form=form, num_items=config.num_items, width=width,
                                             steps=steps, effect_lr=setting[0], weight_lr=setting[1], init_scale=setting[2], job=job)

        grid = [(e, w, s) for e in VECTOR_EFFECT_RATES for w in VECTOR_WEIGHT_RATES for s in scales]
        rows[f"{form}_{width}_{passes:.3f}"] = chosen_and_refitted(fit, logit, grid, log.time, is_eval, labels)
    return rows


PAST_PRIOR_EVENTS = 5.0  # past_click_logit's pseudo-events at the train click rate


def past_click_logit(click: np.ndarray, user_offsets: np.ndarray, user: np.ndarray, prior_rate: float) -> np.ndarray:
    """float64 `[N]`: the logit of each event's user click rate over its earlier events, shrunk toward
    `prior_rate` by `PAST_PRIOR_EVENTS` pseudo-events: `(clicks before + 5 r) / (events before + 5)`.

    `click` is 0/1 `[N]` for events grouped by user in time order (`user_offsets` `[U + 1]`, `user` `[N]`).
    """
    clicks = click.astype(np.float64)
    before = np.cumsum(clicks) - clicks
    first = user_offsets[user]
    before -= np.concatenate([[0.0], np.cumsum(clicks)])[first]
    rate = (before + PAST_PRIOR_EVENTS * prior_rate) / (np.arange(click.size) - first + PAST_PRIOR_EVENTS)
    return np.log(rate) - np.log1p(-rate)


def ceilings(config: PlantedConfig, rule: SplitRule, online_passes=(), vector_runs=()) -> dict:
    """AUC and NE of the oracle, the categories-only ceiling, no history and the item-mean baseline on `rule`'s
    eval events of the log `config` generates, with each one's share of the oracle's AUC lift (module docstring);
    with `online_passes`, the fitted form trained online for each (`online_rows`) under "online"; with
    `vector_runs`, the learned-vector forms trained online for each (`vector_rows`) under "vectors".

    Raises:
      ValueError: the split leaves no train or no eval events (`oracle_report`).
    """
    log = generate(config)
    truth = log_truth(log)
    position = np.arange(log.num_events) - log.user_offsets[log.user]
    affinity = recent_affinity(config, category_mean_vectors(log.item_vectors, log.item_category), log.item, position)
    recent = config.recent_weight * affinity
    by_category = dataclasses.replace(truth, logit=truth.logit - truth.terms["recent"] + recent, terms={**truth.terms, "recent": recent})
    report = oracle_report(truth, rule)
    mid, long = category_signals(config, log.user, log.item_category[log.item], position)
    signals = np.stack([affinity, mid, long], axis=1)  # the planted signals before their weights
    is_eval, _ = eval_mask(truth, rule)
    fitted = fitted_row(log.user, log.item, signals, log.click, log.time, is_eval, config.num_users, config.num_items)
    anyone = np.zeros_like(log.user)  # one user: no user effects
    no_user = fitted_row(anyone, log.item, signals, log.click, log.time, is_eval, 1, config.num_items)
    own = recent_affinity(config, log.item_vectors, log.item, position)  # the recent signal from each item's own vector
    known_vectors = fitted_row(log.user, log.item, np.stack([own, mid, long], axis=1), log.click, log.time, is_eval,
                               config.num_users, config.num_items)
    past = past_click_logit(log.click, log.user_offsets, log.user, float(log.click[~is_eval].mean()))
    past_outcomes = fitted_row(anyone, log.item, np.column_stack([signals, past]), log.click, log.time, is_eval, 1, config.num_items)
    online = online_rows(log.user, log.item, signals, log.click, log.time, is_eval, config.num_users, config.num_items, online_passes)
    rows = {
        "oracle": report.oracle, "categories_only": oracle_report(by_category, rule).oracle,
        "fitted_item_vectors": known_vectors["quality"], "fitted": fitted["quality"],
        "fitted_past_outcomes": past_outcomes["quality"], "fitted_no_user": no_user["quality"],
        "no_history": report.no_history, "item_mean": report.item_mean,
    }
    rows |= {f"fitted_online_{passes}": row["quality"] for passes, row in online.items()}
    vectors = vector_rows(log, config, signals[:, 1:], is_eval, vector_runs) if vector_runs else {}
    rows |= {f"learned_{name}": row["quality"] for name, row in vectors.items()}
    lift = report.oracle.auc - report.item_mean.auc
    return {
        "split": report.split,
        "eval_events": report.eval_events,
        "auc": {name: q.auc for name, q in rows.items()},
        "ne": {name: q.ne for name, q in rows.items()},
        "lift_share": {name: (q.auc - report.item_mean.auc) / lift for name, q in rows.items()},
        "fitted": {
            "l2": fitted["l2"], "validation_ne": fitted["validation_ne"],
            "weights": dict(zip(("recent", "mid", "long"), fitted["weights"])),
            "true_weights": {"recent": config.recent_weight, "mid": config.mid_weight, "long": config.long_weight},
        },
        "fitted_item_vectors": {
            "l2": known_vectors["l2"], "validation_ne": known_vectors["validation_ne"],
            "weights": dict(zip(("recent", "mid", "long"), known_vectors["weights"])),
        },
        "fitted_no_user": {"l2": no_user["l2"], "validation_ne": no_user["validation_ne"]},
        "fitted_past_outcomes": {
            "l2": past_outcomes["l2"], "validation_ne": past_outcomes["validation_ne"],
            "weights": dict(zip(("recent", "mid", "long", "past_click_logit"), past_outcomes["weights"])),
        },
        "online": {passes: {"steps": row["steps"], "rates": row["rates"], "validation_ne": row["validation_ne"]} for passes, row in online.items()},
        "vectors": {name: {"steps": row["steps"], "setting": row["setting"], "validation_ne": row["validation_ne"],
                           "weights": dict(zip(("bias", "recent", "mid", "long"), np.asarray(row["params"]["dense"]).tolist()))}
                    for name, row in vectors.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="long-range")
    parser.add_argument("--small", action="store_true", help="1/10 of the users, items and categories")
    parser.add_argument("--split", default="time:0.9", help="the split, as gem-data convert --split takes it")
    parser.add_argument("--online", action="store_true", help=f"also the online rows: the fitted form trained as the GEM-width job trains, for {len(ONLINE_PASSES)} budgets")
    parser.add_argument("--learned-vectors", action="store_true",
                        help=f"also the learned-vector rows: the planted form learning its vectors from ids, {len(VECTOR_RUNS)} runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = small(PRESETS[args.preset]) if args.small else PRESETS[args.preset]
    result = {"preset": args.preset, "small": args.small, **ceilings(config, SplitRule.parse(args.split), ONLINE_PASSES if args.online else (),
                                                                       VECTOR_RUNS if args.learned_vectors else ())}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
