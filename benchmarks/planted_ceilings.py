"""What a model can reach on a planted log, by what it reads off the history: the oracle and its ceilings.

    PYTHONPATH=. python3 benchmarks/planted_ceilings.py --preset long-range --online --out benchmarks/results/planted_ceilings_long_range.json

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
and 8 passes. Each row's share of the oracle's AUC lift over the item-mean baseline is reported beside
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
    "validation_ne": {l2: NE of the held-out train tenth}}`."""
    train, fit_on, held = held_out_tenth(time, is_eval)
    validation_ne = {}
    for l2 in L2_GRID:
        params = fit_logistic(user[fit_on], item[fit_on], signals[fit_on], labels[fit_on], num_users, num_items, l2)
        validation_ne[l2] = quality(fitted_logit(params, user[held], item[held], signals[held], num_users), labels[held]).ne
    chosen = min(validation_ne, key=validation_ne.get)
    params = fit_logistic(user[train], item[train], signals[train], labels[train], num_users, num_items, chosen)
    held_out = np.flatnonzero(is_eval)
    scored = quality(fitted_logit(params, user[held_out], item[held_out], signals[held_out], num_users), labels[held_out])
    return {"quality": scored, "l2": chosen, "validation_ne": {str(k): v for k, v in validation_ne.items()}, "weights": params[1:1 + signals.shape[1]].tolist()}


# The online rows: the planted form trained as the GEM-width job (configs/planted_gem.py) trains: its batch size
# and OptimConfig through `make_optimizer` (AdamW with its warm-up share and the cosine to 10% of the peak on the bias
# and signal weights, row-wise Adagrad from its accumulator on the effects, a table of one-wide rows), shuffled
# batches; both rates chosen from these grids on the train split's last tenth.
ONLINE_PASSES = (None, 2.0, 4.0, 8.0)  # passes over the train events; None: the job's own budget (num_steps batches)
EFFECT_RATES = (0.03, 0.1, 0.3, 1.0)
WEIGHT_RATES = (3e-3, 1e-2, 3e-2)
JOB_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "planted_gem.py"


def fit_online(user, item, signals, labels, num_users: int, num_items: int, *, steps: int, effect_lr: float, weight_lr: float,
               job: TrainConfig, seed: int = 0) -> np.ndarray:
    """`steps` minibatch steps of the planted form's mean log loss with `job`'s optimizer (the ONLINE_* comment).

    Args:
      user, item: int `[N]` ids in `[0, num_users)`, `[0, num_items)`; signals: float `[N, K]`; labels: 0/1 `[N]`.
      steps: updates; each pass over the N events is its own seeded permutation cut into batches of
        `job.data.batch_size` (the last, shorter batch of a pass dropped, as the trainer's shuffled batches drop it).
      effect_lr, weight_lr: `job.optim`'s embedding and dense rates, replaced; its schedule is stretched to `steps`.
      job: the GEM-width job's config (`load_config(JOB_CONFIG)`).

    Returns:
      float64 `[1 + K + num_users + num_items]` (`fit_logistic`'s layout): bias, signal weights, user and item
      effects; trained in float32, one `lax.scan`.
    """
    n, k = signals.shape
    batch = job.data.batch_size
    per_pass = n // batch
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(n)[: per_pass * batch] for _ in range(-(-steps // per_pass))])
    warmup = max(1, round(job.optim.warmup_steps / job.loop.num_steps * steps))  # the job's warm-up share of any budget
    optim = dataclasses.replace(job.optim, learning_rate=weight_lr, embedding_learning_rate=effect_lr,
                                warmup_steps=warmup, decay_steps=max(1, steps - warmup))
    optimizer = make_optimizer(optim)
    user, item = jnp.asarray(user, jnp.int32), jnp.asarray(item, jnp.int32) + num_users
    signals, labels = jnp.asarray(signals, jnp.float32), jnp.asarray(labels, jnp.float32)

    def loss(params, batch):
        effects = params["effects"][EMBEDDING_PARAM][:, 0]
        logit = params["dense"][0] + signals[batch] @ params["dense"][1:] + effects[user[batch]] + effects[item[batch]]
        return jnp.mean(jnp.logaddexp(0.0, logit) - labels[batch] * logit)

    def step(carry, batch):
        params, state = carry
        updates, state = optimizer.update(jax.grad(loss)(params, batch), state, params)
        return (optax.apply_updates(params, updates), state), None

    params = {"dense": jnp.zeros(1 + k), "effects": {EMBEDDING_PARAM: jnp.zeros((num_users + num_items, 1))}}
    batches = jnp.asarray(order[: steps * batch].reshape(steps, batch))
    (params, _), _ = jax.jit(lambda carry: jax.lax.scan(step, carry, batches))((params, optimizer.init(params)))
    return np.concatenate([np.asarray(params["dense"], np.float64), np.asarray(params["effects"][EMBEDDING_PARAM][:, 0], np.float64)])


def online_rows(user, item, signals, labels, time, is_eval, num_users: int, num_items: int, passes_list=ONLINE_PASSES) -> dict:
    """The planted form trained online (`fit_online`) for each of `passes_list` (passes over the train events;
    None: the job's `num_steps` batches): `{f"{passes:.3f}": {"steps", "quality" on the eval events, "rates":
    (effect, weight) chosen by the NE of the train split's last tenth in time after the same passes over the rest,
    "validation_ne"}}`."""
    job = load_config(JOB_CONFIG)
    batch = job.data.batch_size
    train, fit_on, held = held_out_tenth(time, is_eval)
    held_out = np.flatnonzero(is_eval)
    labels = labels.astype(np.float64)
    rows = {}
    for passes in passes_list:
        passes = job.loop.num_steps * batch / train.size if passes is None else float(passes)

        def fitted(events, rates):
            steps = max(1, round(passes * events.size / batch))
            params = fit_online(user[events], item[events], signals[events], labels[events], num_users, num_items,
                                steps=steps, effect_lr=rates[0], weight_lr=rates[1], job=job)
            return steps, params

        validation_ne = {}
        for rates in ((e, w) for e in EFFECT_RATES for w in WEIGHT_RATES):
            params = fitted(fit_on, rates)[1]
            validation_ne[rates] = quality(fitted_logit(params, user[held], item[held], signals[held], num_users), labels[held]).ne
        chosen = min(validation_ne, key=validation_ne.get)
        steps, params = fitted(train, chosen)
        scored = quality(fitted_logit(params, user[held_out], item[held_out], signals[held_out], num_users), labels[held_out])
        rows[f"{passes:.3f}"] = {"steps": steps, "quality": scored, "rates": list(chosen),
                                 "validation_ne": {f"{e:g}/{w:g}": v for (e, w), v in validation_ne.items()}}
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


def ceilings(config: PlantedConfig, rule: SplitRule, online_passes=()) -> dict:
    """AUC and NE of the oracle, the categories-only ceiling, no history and the item-mean baseline on `rule`'s
    eval events of the log `config` generates, with each one's share of the oracle's AUC lift (module docstring);
    with `online_passes`, the fitted form trained online for each (`online_rows`) under "online".

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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="long-range")
    parser.add_argument("--small", action="store_true", help="1/10 of the users, items and categories")
    parser.add_argument("--split", default="time:0.9", help="the split, as gem-data convert --split takes it")
    parser.add_argument("--online", action="store_true", help=f"also the online rows: the fitted form trained as the GEM-width job trains, for {len(ONLINE_PASSES)} budgets")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = small(PRESETS[args.preset]) if args.small else PRESETS[args.preset]
    result = {"preset": args.preset, "small": args.small, **ceilings(config, SplitRule.parse(args.split), ONLINE_PASSES if args.online else ())}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
