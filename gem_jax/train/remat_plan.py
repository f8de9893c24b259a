"""The rematerialization planner: a policy per model region so that the train step fits a memory budget.

Costs are measured once, on the train step as one device traces it, at the token
capacity a batch reaches (`planning_batch`; nothing runs on a device):

- **Saved bytes** of a region under each policy (`gem_jax.model.remat.RematPolicy`):
  what its backward keeps (`gem_jax.train.residuals.residual_bytes`: JAX's residuals
  as XLA materializes them), on the region's function at its place in the step, its
  inputs included, parameters not.
- **Recompute time** of a region under each policy: the matmul FLOPs its backward
  recomputes (the `dot_general`s of the region's forward-and-backward program under
  the policy, less those without rematerialization), plus the analytic FLOPs of its
  attention kernel (`gem_jax.model.flops.attention_flops`, at real history lengths)
  when the policy reruns the attention, at `CostModel.matmul_flops_per_s`; and the
  freed bytes written and read once more at `CostModel.bytes_per_s`.
- **The step**: the residual bytes of the device's whole loss under a set of policies
  (traced again for each plan considered), and the state's bytes (parameters,
  optimizer state, gradients; per device, from their shardings).

The peak is estimated as state + the step's residuals + what the backward's
recomputation adds (`recompute_peak_bytes`). The planner starts from no
rematerialization and, while the estimate exceeds the budget, moves the region whose
next cheaper-in-memory policy costs the least recompute time per byte freed (a greedy
walk over each region's time/memory Pareto front, as Checkmate's greedy baseline: Jain
et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization",
2020); each plan it stops at is checked on the traced residuals of the whole step, and
the walk goes on if they do not fit. Memory XLA needs beyond the residuals (working
buffers of the largest fusion or GEMM, fragmentation) is not counted: leave headroom.
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
from gem_jax.model.config import ModelConfig, describe_attention
from gem_jax.model.flops import attention_flops
from gem_jax.model.gem import GEMModel
from gem_jax.model.remat import RematConfig, RematPolicy
from gem_jax.nn.layers import EMBEDDING_PARAM
from gem_jax.parallel.placement import BatchPlacement
from gem_jax.parallel.spmd import ShardedModel
from gem_jax.pytree import path_keys
from gem_jax.train.residuals import dot_flops, residual_bytes
from gem_jax.train.state import StateSetup
from gem_jax.units import format_bytes

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
        """Recompute time of `flops` GEMM FLOPs plus writing and reading back `freed_bytes` bytes, in seconds."""
        return flops / self.matmul_flops_per_s + 2.0 * freed_bytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class RegionCost:
    """One region's measured costs under each policy.

    Attributes:
      name: the region (`gem_jax.model.remat.region_names`).
      saved_bytes: per policy, bytes of the residuals the region keeps for its
        backward on one device (its inputs included, parameters not).
      recompute_flops: per policy, the GEMM and attention-kernel FLOPs its backward
        recomputes.
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
      recompute_bytes: what the backward's recomputation adds to the activations at its
        peak (`recompute_peak_bytes`).
      budget_bytes: the budget it was chosen for; None for explicit policies.
      tokens: the token capacity the costs were measured at (history rows per device).
    """

    policies: dict[str, RematPolicy]
    regions: tuple[RegionCost, ...]
    state_bytes: int
    activation_bytes: int
    recompute_bytes: int
    budget_bytes: int | None
    tokens: int

    @property
    def peak_bytes(self) -> int:
        """The estimated peak: state + activations + recomputation."""
        return self.state_bytes + self.activation_bytes + self.recompute_bytes

    @property
    def recompute_s(self) -> float:
        """Estimated recompute seconds per step, all regions."""
        return sum(r.recompute_s[self.policies[r.name]] for r in self.regions)

    @property
    def remat_config(self) -> RematConfig:
        """The plan as explicit policies for `ModelConfig.remat`."""
        return RematConfig(policies=tuple(self.policies.items()))

    def rows(self) -> list[dict]:
        """One dict per region: region, policy, saved_bytes, recompute_ms, and what the
        estimate is made of: recompute_flops and freed_bytes (SAVE_ALL's bytes less these)."""
        rows = []
        for r in self.regions:
            p = self.policies[r.name]
            rows.append({
                "region": r.name, "policy": p.name, "saved_bytes": r.saved_bytes[p], "recompute_ms": 1e3 * r.recompute_s[p],
                "recompute_flops": r.recompute_flops[p], "freed_bytes": r.saved_bytes[RematPolicy.SAVE_ALL] - r.saved_bytes[p],
            })
        return rows

    def table(self) -> str:
        """The plan as a text table, with the memory estimate against the budget."""
        lines = [f"{'region':<20} {'policy':<13} {'saved':>10} {'recompute ms':>13}"]
        for row in self.rows():
            lines.append(f"{row['region']:<20} {row['policy']:<13} {format_bytes(row['saved_bytes']):>10} {row['recompute_ms']:>13.3g}")
        budget = "explicit policies" if self.budget_bytes is None else f"budget {format_bytes(self.budget_bytes)}"
        lines.append(
            f"estimated peak {format_bytes(self.peak_bytes)} per device ({budget}): state {format_bytes(self.state_bytes)}, "
            f"activations {format_bytes(self.activation_bytes)}, recomputed {format_bytes(self.recompute_bytes)}; "
            f"recompute {1e3 * self.recompute_s:.3g} ms per step; measured at {self.tokens} history rows per device"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The plan as JSON values: per-region rows, the byte totals of the estimate, recompute ms, budget."""
        return {
            "regions": self.rows(),
            "state_bytes": self.state_bytes,
            "activation_bytes": self.activation_bytes,
            "recompute_bytes": self.recompute_bytes,
            "peak_bytes_estimate": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "recompute_ms": 1e3 * self.recompute_s,
            "tokens_per_device": self.tokens,
        }


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
    recompute = {p: flops[p] - base + (attention if p in reruns_attention else 0.0) for p in RematPolicy}
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


class StepCosts:
    """The measured costs of one device's train step, from which plans are chosen (`measure_step`).

    Attributes:
      config: the model measured (its `remat` is not used).
      regions: every region's costs, in forward order.
      activation_bytes_saved: the step's residual bytes with no rematerialization.
      state_bytes: parameters, optimizer state and gradients (`state_bytes`).
      tokens: the history rows per device measured at.
      kernels: the self-attention's implementation the step was traced with, and why
        (`describe_attention`'s line): the kernels decide what the backward keeps.
    """

    def __init__(self, config: ModelConfig, spec: FeatureSpec, setup: StateSetup, batch: Batch, lengths: np.ndarray, *,
                 row_wise_tables: bool, cost_model: CostModel):
        self.config, self._spec, self._setup, self._batch = config, spec, setup, batch
        self.kernels = describe_attention(config)[0]
        num_shards = setup.mesh.devices.size
        attention = {name: w.total(np.asarray(lengths)) / num_shards for name, w in attention_flops(config, spec).items()}
        costs = {}

        def observe(name, fn, params, args):
            costs[name] = _region_cost(name, fn, params, args, attention.get(name, 0.0), cost_model)

        box = {}

        def fn(local_loss, params):
            with remat.observe_regions(observe):  # in the forward pass alone, outside any differentiation
                local_loss(params)
            box["bytes"] = residual_bytes(local_loss, params)

        self._model(RematConfig()).trace_local_loss(fn, setup.abstract.params, batch)
        self.activation_bytes_saved = box["bytes"]
        missing = [name for name in config.region_names if name not in costs]
        if missing:
            raise RuntimeError(f"the model ran without regions {missing}; gem_jax.model.remat.region_names is out of date")
        self.regions = tuple(costs[name] for name in config.region_names)
        self.state_bytes = state_bytes(setup, row_wise_tables=row_wise_tables)
        self.tokens = int(batch.history.values.shape[1])

    def _model(self, policies: RematConfig) -> ShardedModel:
        graphdef = model_graphdef(self._spec, dataclasses.replace(self.config, remat=policies))
        return ShardedModel(graphdef, self._setup.plan, self._setup.mesh, self._setup.compute_dtype)

    def activation_bytes(self, policies: RematConfig) -> int:
        """Residual bytes of one device's step under `policies` (parameters excluded), traced."""
        box = {}

        def fn(local_loss, params):
            box["bytes"] = residual_bytes(local_loss, params)

        self._model(policies).trace_local_loss(fn, self._setup.abstract.params, self._batch)
        return box["bytes"]

    def plan(self, policies: dict[str, RematPolicy], budget_bytes: int | None, activation_bytes: int | None = None) -> RematPlan:
        """`policies` as a `RematPlan` (the step's activations traced unless given)."""
        if activation_bytes is None:
            activation_bytes = self.activation_bytes(RematConfig(policies=tuple(policies.items())))
        return RematPlan(policies, self.regions, self.state_bytes, activation_bytes, recompute_peak_bytes(self.regions, policies), budget_bytes, self.tokens)


def measure_step(
    config: ModelConfig,
    spec: FeatureSpec,
    setup: StateSetup,
    batch: Batch,
    lengths: np.ndarray,
    *,
    row_wise_tables: bool = True,
    cost_model: CostModel = CostModel(),
) -> StepCosts:
    """Measures the regions' costs and the state's bytes of one device's train step (traced, nothing runs).

    Args:
      config: the model.
      spec: the data set's feature spec.
      setup: the train state's shapes and shardings, mesh and sharding plan.
      batch: a stacked batch (arrays or `jax.ShapeDtypeStruct`s) at the capacity to
        plan for (`planning_batch`).
      lengths: real history lengths of a global batch (int `[n]`), for attention FLOPs.
      row_wise_tables: the step updates unsharded tables row by row
        (`OptimConfig.sparse_embedding_updates`; see `state_bytes`).
      cost_model: recompute seconds of FLOPs and bytes.
    """
    return StepCosts(config, spec, setup, batch, lengths, row_wise_tables=row_wise_tables, cost_model=cost_model)


def recompute_peak_bytes(regions: Sequence[RegionCost], policies: dict[str, RematPolicy]) -> int:
    """Bytes the backward's recomputation adds to the saved activations at its peak.

    The backward visits the regions last to first: while region r recomputes its
    residuals (its SAVE_ALL bytes less those it saved), the regions after it have
    released theirs. The peak addition is the largest of `recomputed(r) - saved(regions
    after r)`, or 0. `regions` are in forward order.
    """
    extra, later = 0, 0
    for r in reversed(regions):
        saved = r.saved_bytes[policies[r.name]]
        extra = max(extra, r.saved_bytes[RematPolicy.SAVE_ALL] - saved - later)
        later += saved
    return extra


def choose_policies(regions: Sequence[RegionCost], fixed_bytes: int, budget_bytes: int, start: dict[str, RematPolicy] | None = None) -> dict[str, RematPolicy] | None:
    """The greedy walk: policies whose estimate fits `budget_bytes`, or None if none does.

    The estimate of a set of policies is `fixed_bytes` + the regions' saved bytes + the
    largest region's recomputed bytes. From `start` (default: SAVE_ALL everywhere), each
    move takes one region one or more steps down its Pareto front (`RegionCost.front`),
    the move with the least added recompute seconds per byte freed first.
    """
    policies = dict(start or {r.name: RematPolicy.SAVE_ALL for r in regions})

    def estimate() -> int:
        return fixed_bytes + sum(r.saved_bytes[policies[r.name]] for r in regions) + recompute_peak_bytes(regions, policies)

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
    num_real = min(dataset.batch_size, dataset.info.num_train_examples)
    host = dataset.train_batch(range(num_real))
    per = dataset.batch_size // placement.num_shards
    buckets = dataset.token_buckets
    expected = per * buckets.mean_length + buckets.sigmas * math.sqrt(per) * buckets.std_length
    capacities = buckets.capacities(per)
    capacity = pick_capacity(min(math.ceil(expected), capacities[-1]), capacities)  # never past B/D x max_seq_len
    batch = placement.abstract(host, capacity)
    return batch, np.diff(np.asarray(host.history.offsets))[:num_real]  # real examples first, then padding


def plan_remat(costs: StepCosts, remat_config: RematConfig) -> RematPlan:
    """The regions' policies `remat_config` asks for, with their costs and the step's memory estimate.

    With `budget_gb`, chooses them (module docstring); with explicit `policies`, takes
    them as given.

    Raises:
      RematBudgetError: the budget is below the state plus the activations with every
        region at its smallest policy (the smallest budget that fits is named).
      ValueError: `remat_config` sets neither a budget nor policies.
    """
    regions, state = costs.regions, costs.state_bytes
    if remat_config.budget_gb is None:
        if not remat_config.policies:
            raise ValueError("plan_remat: the RematConfig sets neither budget_gb nor policies: nothing to plan")
        return costs.plan({r.name: remat_config.policy(r.name) for r in regions}, None)
    budget = int(remat_config.budget_gb * BYTES_PER_GB)
    fixed = state + costs.activation_bytes_saved - sum(r.saved_bytes[RematPolicy.SAVE_ALL] for r in regions)
    policies = {r.name: RematPolicy.SAVE_ALL for r in regions}
    while True:
        policies = choose_policies(regions, fixed, budget, start=policies)
        if policies is None:
            least = costs.plan({r.name: r.front()[-1] for r in regions}, budget)
            if least.peak_bytes <= budget:  # the walk's estimate was above the traced residuals
                return least
            raise RematBudgetError(
                f"RematConfig.budget_gb = {remat_config.budget_gb:g} GB does not fit the step: the state (parameters, "
                f"optimizer state, gradients) takes {format_bytes(state)} and the activations with the recompute buffer at "
                f"least {format_bytes(least.peak_bytes - state)} with every region at its smallest policy, at {costs.tokens} "
                f"history rows per device, measured with this process's kernels, {costs.kernels}; for a job on another "
                f"device, plan there or with benchmarks/offline_compile.py; the smallest budget is "
                f"budget_gb = {math.ceil(least.peak_bytes / 1e3) / 1e6:g}"
            )
        saved = all(p is RematPolicy.SAVE_ALL for p in policies.values())
        plan = costs.plan(policies, budget, costs.activation_bytes_saved if saved else None)
        if plan.peak_bytes <= budget:
            return plan
        # The regions' bytes do not add up exactly to the step's: correct the estimate by the
        # difference (> 0 here, so the walk moves on or ends) and continue.
        fixed = state + plan.activation_bytes - sum(r.saved_bytes[policies[r.name]] for r in regions)
