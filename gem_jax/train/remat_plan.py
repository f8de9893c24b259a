"""The rematerialization planner: a policy per model region so that the train step fits a memory budget.

Costs are measured once, on the train step as one device traces it, at the token
capacity a batch reaches (no device runs):

- **Saved bytes** of a region under each policy (`gem_jax.model.remat.RematPolicy`): the
  residuals its backward keeps, from JAX's own accounting of what `jax.vjp` saves
  (`saved_residuals`) on the region's function at its place in the step (the region's
  inputs included, parameters not).
- **Recompute time** of a region under each policy: the matmul FLOPs its backward
  recomputes (the `dot_general`s of the region's forward-and-backward program under
  the policy, less those without rematerialization), plus the analytic FLOPs of its
  attention kernel (`gem_jax.model.flops.attention_flops`, at the batch's real
  lengths) when the policy reruns the attention, at `CostModel.matmul_flops_per_s`;
  and the freed bytes written and read once more at `CostModel.bytes_per_s`.
- **Activations of the whole step**: the residual bytes of the device's loss (exact,
  for a given set of policies), beside the state's bytes (parameters, optimizer state
  and one gradient per parameter, per device from their shardings).

The step's peak is estimated as state + activations + the largest region's recomputed
residuals (a region's backward rebuilds them while the others hold theirs). The
planner starts from no rematerialization and, while the estimate exceeds the budget,
moves the region whose next cheaper-in-memory policy costs the least recompute time
per byte saved (a greedy walk over each region's time/memory Pareto front, as in
Checkmate's greedy baseline: Jain et al., "Checkmate: Breaking the Memory Wall with
Optimal Tensor Rematerialization", 2020); each plan is checked on the exact
residuals of the whole step. Memory XLA needs beyond the residuals (working buffers,
fragmentation) is not counted: leave headroom in the budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax.batch import Batch, FeatureSpec
from gem_jax.data.pipeline import Dataset
from gem_jax.jagged import pick_capacity
from gem_jax.model import remat
from gem_jax.model.config import ModelConfig
from gem_jax.model.flops import attention_flops
from gem_jax.model.gem import GEMModel
from gem_jax.model.remat import RematConfig, RematPolicy
from gem_jax.nn.layers import EMBEDDING_PARAM
from gem_jax.parallel.placement import BatchPlacement, stack_batch
from gem_jax.parallel.spmd import ShardedModel
from gem_jax.pytree import path_keys
from gem_jax.train.residuals import dot_flops, residual_bytes
from gem_jax.train.state import StateSetup

BYTES_PER_GB = 1e9


class RematBudgetError(ValueError):
    """The memory budget is below what the step needs with every region at its smallest policy."""


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Recompute seconds = matmul FLOPs / `matmul_flops_per_s` + 2 x freed bytes / `bytes_per_s`.

    The freed bytes (residuals a policy no longer keeps) are written once more by the
    recomputation and read once by the backward. Defaults are for one H200: 60% of its
    989 TFLOP/s dense bf16 peak (the step's GEMMs) and 3.5 TB/s (73% of its 4.8 TB/s
    HBM bandwidth, what XLA's elementwise fusions reach); calibrate them from the step
    profile (`benchmarks/train_bench.py --profile`).
    """

    matmul_flops_per_s: float = 600e12
    bytes_per_s: float = 3.5e12

    def seconds(self, flops: float, freed_bytes: float) -> float:
        return flops / self.matmul_flops_per_s + 2.0 * freed_bytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class RegionCost:
    """One region's measured costs under each policy.

    Attributes:
      name: the region (`gem_jax.model.remat.region_names`).
      saved_bytes: per policy, bytes of the residuals the region keeps for its
        backward on one device (its inputs included, parameters not).
      recompute_flops: per policy, matmul FLOPs its backward recomputes.
      recompute_s: per policy, the `CostModel`'s seconds of that recomputation.
    """

    name: str
    saved_bytes: dict[RematPolicy, int]
    recompute_flops: dict[RematPolicy, float]
    recompute_s: dict[RematPolicy, float]

    def front(self) -> list[RematPolicy]:
        """The policies on the time/memory Pareto front, most memory first.

        A policy that keeps no fewer bytes and takes no less time than another is
        dropped; of policies equal in both, the later `RematPolicy` member stays (a
        region without attention under SAVE_NAMED is SAVE_NOTHING).
        """
        members = list(RematPolicy)
        ordered = sorted(members, key=lambda p: (self.saved_bytes[p], self.recompute_s[p], -members.index(p)))
        front, fastest = [], math.inf
        for p in ordered:
            if self.recompute_s[p] < fastest:
                front.append(p)
                fastest = self.recompute_s[p]
        return front[::-1]


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """Every region's policy, with its costs and the step's memory estimate (bytes per device).

    Attributes:
      policies: region name -> policy, in forward order.
      regions: the measured costs of every region.
      state_bytes: parameters, optimizer state and gradients.
      activation_bytes: residuals of the whole step under `policies` (exact).
      transient_bytes: the largest region's recomputed residuals.
      budget_bytes: the budget it was chosen for; None for explicit policies.
      tokens: the token capacity the costs were measured at (history rows per device).
    """

    policies: dict[str, RematPolicy]
    regions: tuple[RegionCost, ...]
    state_bytes: int
    activation_bytes: int
    transient_bytes: int
    budget_bytes: int | None
    tokens: int

    @property
    def peak_bytes(self) -> int:
        """The estimated peak: state + activations + transient."""
        return self.state_bytes + self.activation_bytes + self.transient_bytes

    @property
    def recompute_s(self) -> float:
        """Estimated recompute seconds per step, all regions."""
        return sum(r.recompute_s[self.policies[r.name]] for r in self.regions)

    @property
    def remat_config(self) -> RematConfig:
        """The plan as explicit policies for `ModelConfig.remat`."""
        return RematConfig(policies=tuple(self.policies.items()))

    def rows(self) -> list[dict]:
        """One dict per region: region, policy, saved_bytes, recompute_ms."""
        return [
            {"region": r.name, "policy": self.policies[r.name].name, "saved_bytes": r.saved_bytes[self.policies[r.name]],
             "recompute_ms": 1e3 * r.recompute_s[self.policies[r.name]]}
            for r in self.regions
        ]

    def table(self) -> str:
        """The plan as a text table, with the memory estimate against the budget."""
        lines = [f"{'region':<20} {'policy':<13} {'saved':>10} {'recompute ms':>13}"]
        for row in self.rows():
            lines.append(f"{row['region']:<20} {row['policy']:<13} {format_bytes(row['saved_bytes']):>10} {row["recompute_ms"]:>13.3g}")
        budget = "explicit policies" if self.budget_bytes is None else f"budget {format_bytes(self.budget_bytes)}"
        lines.append(
            f"estimated peak {format_bytes(self.peak_bytes)} per device ({budget}): state {format_bytes(self.state_bytes)}, "
            f"activations {format_bytes(self.activation_bytes)}, recompute buffer {format_bytes(self.transient_bytes)}; "
            f"recompute {1e3 * self.recompute_s:.2f} ms per step; measured at {self.tokens} history rows per device"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "regions": self.rows(),
            "state_bytes": self.state_bytes,
            "activation_bytes": self.activation_bytes,
            "transient_bytes": self.transient_bytes,
            "peak_bytes_estimate": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "recompute_ms": 1e3 * self.recompute_s,
            "tokens_per_device": self.tokens,
        }


def format_bytes(n: float) -> str:
    """`n` bytes as GB, MB or kB (powers of 1000), three significant digits."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def record(plan: RematPlan | None) -> dict | None:
    """`plan.to_json()`, or None without rematerialization (for benchmark records)."""
    return None if plan is None else plan.to_json()


def _fwd_bwd(fn: Callable, *args):
    out, vjp = jax.vjp(fn, *args)
    return vjp(jax.tree.map(jnp.ones_like, out))


def _region_cost(name: str, fn: Callable, params, args: tuple, attention: float, cost_model: CostModel) -> RegionCost:
    saved, flops = {}, {}
    for policy in RematPolicy:
        g = remat.checkpointed(fn, policy)
        saved[policy] = residual_bytes(g, params, *args)
        flops[policy] = dot_flops(jax.make_jaxpr(lambda *a: _fwd_bwd(g, *a))(params, *args).jaxpr)
    base = flops[RematPolicy.SAVE_ALL]
    reruns_attention = (RematPolicy.SAVE_DOTS, RematPolicy.SAVE_NOTHING)
    recompute = {p: max(flops[p] - base, 0.0) + (attention if p in reruns_attention else 0.0) for p in RematPolicy}
    seconds = {p: cost_model.seconds(recompute[p], saved[RematPolicy.SAVE_ALL] - saved[p]) for p in RematPolicy}
    return RegionCost(name, saved, recompute, seconds)


def model_graphdef(spec: FeatureSpec, config: ModelConfig) -> nnx.GraphDef:
    """The structure of `GEMModel(spec, config)` (`nnx.split`), built abstractly."""
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: GEMModel(spec, config, rngs=nnx.Rngs(0))))[0]


def state_bytes(setup: StateSetup, *, row_wise_tables: bool) -> int:
    """Bytes per device of the train state (parameters, optimizer state) and of the gradients.

    Every parameter has a gradient of its shard's size, except, with `row_wise_tables`
    (`OptimConfig.sparse_embedding_updates`), the unsharded embedding tables, whose
    step differentiates only the rows it looks up (`gem_jax.train.sparse_tables`; those
    rows are counted with the activations).
    """

    def local(x: jax.ShapeDtypeStruct) -> int:
        return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize

    def has_dense_grad(path) -> bool:
        keys = path_keys(path)
        placement = setup.plan.tables.get("/".join(map(str, keys[:-1]))) if keys[-1] == EMBEDDING_PARAM else None
        return not (row_wise_tables and placement is not None and not placement.row_axes)

    grads = sum(local(x) for path, x in jax.tree_util.tree_leaves_with_path(setup.abstract.params) if has_dense_grad(path))
    return sum(local(x) for x in jax.tree.leaves(setup.abstract)) + grads


class _Step:
    """The device's loss under a set of policies: measures its residuals and its regions' costs."""

    def __init__(self, config: ModelConfig, spec: FeatureSpec, setup: StateSetup, batch: Batch, lengths: np.ndarray, cost_model: CostModel):
        self.config, self.spec, self.setup, self.batch, self.cost_model = config, spec, setup, batch, cost_model
        num_shards = setup.mesh.devices.size
        self.attention = {name: w.total(lengths) / num_shards for name, w in attention_flops(config).items()}

    def _model(self, policies: RematConfig) -> ShardedModel:
        graphdef = model_graphdef(self.spec, dataclasses.replace(self.config, remat=policies))
        return ShardedModel(graphdef, self.setup.plan, self.setup.mesh, self.setup.compute_dtype)

    def activation_bytes(self, policies: RematConfig) -> int:
        """Exact residual bytes of one device's step under `policies` (parameters excluded)."""
        box = {}

        def fn(local_loss, params):
            box["bytes"] = residual_bytes(local_loss, params)

        self._model(policies).trace_local_loss(fn, self.setup.abstract.params, self.batch)
        return box["bytes"]

    def measure(self) -> tuple[tuple[RegionCost, ...], int]:
        """Every region's costs, measured at its place in the step, and the step's
        residual bytes without rematerialization."""
        costs, box = {}, {}

        def observe(name, fn, params, args):
            costs[name] = _region_cost(name, fn, params, args, self.attention.get(name, 0.0), self.cost_model)

        def fn(local_loss, params):
            with remat.observe_regions(observe):
                local_loss(params)
            box["bytes"] = residual_bytes(local_loss, params)

        self._model(RematConfig()).trace_local_loss(fn, self.setup.abstract.params, self.batch)
        missing = set(self.config.region_names) - set(costs)
        if missing:
            raise RuntimeError(f"the model ran without regions {sorted(missing)}; gem_jax.model.remat.region_names is out of date")
        return tuple(costs[name] for name in self.config.region_names), box["bytes"]


def _transient(regions: Sequence[RegionCost], policies: dict[str, RematPolicy]) -> int:
    return max((r.saved_bytes[RematPolicy.SAVE_ALL] - r.saved_bytes[policies[r.name]] for r in regions), default=0)


def choose_policies(regions: Sequence[RegionCost], fixed_bytes: int, budget_bytes: int, start: dict[str, RematPolicy] | None = None) -> dict[str, RematPolicy] | None:
    """The greedy walk: policies whose estimate fits `budget_bytes`, or None if none does.

    The estimate of a set of policies is `fixed_bytes` + the regions' saved bytes + the
    largest region's recomputed bytes. From `start` (default: SAVE_ALL everywhere), each
    move takes one region one or more steps down its Pareto front (`RegionCost.front`),
    the move with the least added recompute seconds per byte freed first.
    """
    policies = dict(start or {r.name: RematPolicy.SAVE_ALL for r in regions})

    def estimate() -> int:
        return fixed_bytes + sum(r.saved_bytes[policies[r.name]] for r in regions) + _transient(regions, policies)

    fronts = {r.name: r.front() for r in regions}
    while estimate() > budget_bytes:
        best = None
        for r in regions:
            now = policies[r.name]
            for p in fronts[r.name]:
                freed = r.saved_bytes[now] - r.saved_bytes[p]
                if freed <= 0:
                    continue
                ratio = (r.recompute_s[p] - r.recompute_s[now]) / freed
                if best is None or ratio < best[0]:
                    best = (ratio, r.name, p)
        if best is None:
            return None
        policies[best[1]] = best[2]
    return policies


def planning_batch(dataset: Dataset, placement: BatchPlacement) -> tuple[Batch, np.ndarray]:
    """An abstract stacked batch at the capacity the planner plans for, and real history lengths.

    The capacity is the smallest token bucket that holds `sigmas` standard deviations
    above a device's expected rows (`TokenBuckets`): batches beyond it (rare, a larger
    coarse bucket) need more memory than planned. The lengths are those of the first
    train batch (int `[B]`), for the attention FLOPs.
    """
    host = dataset.train_batch(range(min(dataset.batch_size, dataset.info.num_train_examples)))
    num_shards = placement.num_shards
    per = dataset.batch_size // num_shards
    buckets = dataset.token_buckets
    expected = per * buckets.mean_length + buckets.sigmas * math.sqrt(per) * buckets.std_length
    capacity = pick_capacity(math.ceil(expected), buckets.capacities(per))
    stacked = stack_batch(host, num_shards, buckets)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=placement.sharding), stacked)
    values = abstract.history.values
    values = jax.ShapeDtypeStruct((values.shape[0], capacity, *values.shape[2:]), values.dtype, sharding=values.sharding)
    batch = dataclasses.replace(abstract, history=abstract.history.replace_values(values))
    weights = np.asarray(host.weights) > 0
    return batch, np.diff(np.asarray(host.history.offsets))[weights]


def plan_remat(
    config: ModelConfig,
    spec: FeatureSpec,
    setup: StateSetup,
    batch: Batch,
    lengths: np.ndarray,
    *,
    row_wise_tables: bool = True,
    cost_model: CostModel = CostModel(),
) -> RematPlan:
    """The regions' policies for `config.remat`, with their measured costs.

    With `config.remat.budget_gb`, chooses the policies (module docstring); with
    explicit `policies`, measures them as given.

    Args:
      config: the model; its `remat` says what to plan.
      spec: the data set's feature spec.
      setup: the train state's shapes and shardings, mesh and sharding plan.
      batch: a stacked batch (arrays or `jax.ShapeDtypeStruct`s) at the capacity to
        plan for (`planning_batch`).
      lengths: real history lengths of a global batch (int `[n]`), for attention FLOPs.
      row_wise_tables: the step updates unsharded tables row by row
        (`OptimConfig.sparse_embedding_updates`; see `state_bytes`).
      cost_model: recompute seconds of FLOPs and bytes.

    Raises:
      RematBudgetError: the budget is below the state plus the activations with every
        region at its smallest policy (the smallest budget that fits is named).
      ValueError: `config.remat` sets neither a budget nor policies.
    """
    if config.remat.budget_gb is None and not config.remat.policies:
        raise ValueError("plan_remat: ModelConfig.remat sets neither budget_gb nor policies: nothing to plan")
    step = _Step(config, spec, setup, batch, np.asarray(lengths), cost_model)
    regions, activations = step.measure()
    state = state_bytes(setup, row_wise_tables=row_wise_tables)
    tokens = int(batch.history.values.shape[1])

    def finish(policies: dict[str, RematPolicy], activations: int, budget: int | None) -> RematPlan:
        return RematPlan(policies, regions, state, activations, _transient(regions, policies), budget, tokens)

    if config.remat.budget_gb is None:
        policies = {r.name: config.remat.policy(r.name) for r in regions}
        if any(p is not RematPolicy.SAVE_ALL for p in policies.values()):
            activations = step.activation_bytes(RematConfig(policies=tuple(policies.items())))
        return finish(policies, activations, None)

    budget = int(config.remat.budget_gb * BYTES_PER_GB)
    fixed = state + activations - sum(r.saved_bytes[RematPolicy.SAVE_ALL] for r in regions)
    policies = {r.name: RematPolicy.SAVE_ALL for r in regions}
    while True:
        policies = choose_policies(regions, fixed, budget, start=policies)
        if policies is None:
            smallest = {r.name: r.front()[-1] for r in regions}
            least = step.activation_bytes(RematConfig(policies=tuple(smallest.items()))) + _transient(regions, smallest)
            raise RematBudgetError(
                f"RematConfig.budget_gb = {config.remat.budget_gb:g} GB does not fit the step: the state (parameters, optimizer "
                f"state, gradients) takes {format_bytes(state)} and the activations at least {format_bytes(least)} with every "
                f"region at its smallest policy, at {tokens} history rows per device; the smallest budget is "
                f"budget_gb = {math.ceil((state + least) / 1e6) / 1e3:g}"
            )
        if all(p is RematPolicy.SAVE_ALL for p in policies.values()):
            return finish(policies, activations, budget)  # measured above
        exact = step.activation_bytes(RematConfig(policies=tuple(policies.items())))
        if state + exact + _transient(regions, policies) <= budget:
            return finish(policies, exact, budget)
        # The regions' bytes do not add up exactly to the step's: correct the estimate by the
        # difference (> 0 here, so the walk moves on or ends) and continue.
        fixed = state + exact - sum(r.saved_bytes[policies[r.name]] for r in regions)
