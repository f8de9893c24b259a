"""Rematerialization regions: named parts of the model whose activations the backward may recompute.

Each region is a call the model makes through `region(name, remat, modules, fn, *args)`.
With its policy SAVE_ALL (the default) the call is `fn(modules, *args)` unchanged;
otherwise it runs under `jax.checkpoint` with a JAX checkpoint policy, which decides
which of the region's intermediate values are kept for the backward pass and which are
recomputed from the region's inputs there. The technique is gradient checkpointing
(Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016) with a policy per
region, selective recomputation (Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models", 2022); values are chosen by name through
`jax.ad_checkpoint.checkpoint_name` and `jax.checkpoint_policies`, as MaxText's
`remat_policy` settings do.

Regions of `GEMModel` (`region_names`), in forward order:

- `history_context`: history tokens attend to the example's feature tokens (interaction).
- `seq{i}/attention`, `seq{i}/mlp`: the two halves of sequence layer i.
- `pooled_attention`: learned queries attend over the history.
- `feature_to_history`: feature tokens attend to the history (interaction).
- `token_attention`: attention among the feature tokens (cross-feature tower).
- `dhen{j}`: DHEN layer j with all its experts.
- `heads`: the head norm and the task heads.

`gem_jax.train.remat_plan` chooses the policies from a memory budget; `RematConfig`
can also name them by region pattern.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import fnmatch
import math
from collections.abc import Callable, Iterator, Sequence

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.jagged_flash_attention import SAVED_NAME as JFA_SAVED_NAME

HISTORY_CONTEXT = "history_context"
POOLED_ATTENTION = "pooled_attention"
FEATURE_TO_HISTORY = "feature_to_history"
TOKEN_ATTENTION = "token_attention"
HEADS = "heads"

# `checkpoint_name` of every attention output the model computes (before its output projection).
ATTENTION_OUTPUT = "attention_output"
# What SAVE_NAMED keeps: attention outputs, and the JFA kernel's output and softmax
# log-sum-exp (its custom VJP's residuals, named inside `pallas_kernels`).
SAVED_NAMES = (ATTENTION_OUTPUT, JFA_SAVED_NAME)


def seq_attention(layer: int) -> str:
    """Region name of sequence layer `layer`'s attention half (norm, qkv, attention, output projection)."""
    return f"seq{layer}/attention"


def seq_mlp(layer: int) -> str:
    """Region name of sequence layer `layer`'s MLP half (norm, MLP)."""
    return f"seq{layer}/mlp"


def dhen(layer: int) -> str:
    """Region name of DHEN layer `layer` (norm, every expert, the mix)."""
    return f"dhen{layer}"


def region_names(num_seq_layers: int, num_dhen_layers: int) -> tuple[str, ...]:
    """Every region of a `GEMModel` with these layer counts, in forward order."""
    seq = [name for i in range(num_seq_layers) for name in (seq_attention(i), seq_mlp(i))]
    return (HISTORY_CONTEXT, *seq, POOLED_ATTENTION, FEATURE_TO_HISTORY, TOKEN_ATTENTION, *map(dhen, range(num_dhen_layers)), HEADS)


class RematPolicy(enum.Enum):
    """What a region keeps for the backward pass.

    SAVE_ALL: everything the backward needs (no rematerialization).
    SAVE_DOTS: the outputs of matmuls without batch dimensions (the dense layers'
      GEMMs, `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); elementwise
      work, norms and attention kernels are recomputed.
    SAVE_NAMED: the values named in `SAVED_NAMES` (attention outputs and the JFA
      softmax statistics, `jax.checkpoint_policies.save_only_these_names`); the
      projections feeding the attention are recomputed, the attention kernel's forward
      is not. A region that computes no attention keeps only its inputs, as SAVE_NOTHING.
    SAVE_NOTHING: only the region's inputs (`jax.checkpoint_policies.nothing_saveable`);
      the backward runs the region's forward again.
    """

    SAVE_ALL = "save_all"
    SAVE_DOTS = "save_dots"
    SAVE_NAMED = "save_named"
    SAVE_NOTHING = "save_nothing"


def checkpoint_policy(policy: RematPolicy) -> Callable | None:
    """The `jax.checkpoint` policy of `policy`; None for SAVE_ALL (no checkpoint at all)."""
    return {
        RematPolicy.SAVE_ALL: None,
        RematPolicy.SAVE_DOTS: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        RematPolicy.SAVE_NAMED: jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
        RematPolicy.SAVE_NOTHING: jax.checkpoint_policies.nothing_saveable,
    }[policy]


@dataclasses.dataclass(frozen=True)
class RematConfig:
    """Which regions recompute their activations in the backward pass.

    At most one of the two is set; neither (the default) keeps every activation, the
    step without any `jax.checkpoint`.

    Attributes:
      budget_gb: the step's device memory budget in GB (1e9 bytes; None: no budget,
        `policies` decide): the trainer's planner (`gem_jax.train.remat_plan`) chooses
        every region's policy so that parameters, optimizer state, gradients and the
        activations fit in it. The model alone does not plan: it applies `policies` only.
      policies: `(pattern, policy)` pairs; a pattern is a region name or an
        `fnmatch` pattern over region names (`seq*/mlp`, `*`). A region takes the
        policy of the last pattern that matches it, SAVE_ALL if none does.
        Policies may be given by name (`"SAVE_NOTHING"`).

    Raises:
      TypeError, ValueError: a malformed pair or policy, a budget that is not a
        finite number > 0, or both fields set (the field is named).
    """

    budget_gb: float | None = None
    policies: tuple[tuple[str, RematPolicy], ...] = ()

    def __post_init__(self):
        if self.budget_gb is not None:
            if isinstance(self.budget_gb, bool) or not isinstance(self.budget_gb, (int, float)):
                raise TypeError(f"RematConfig.budget_gb must be a number or None, got {self.budget_gb!r}")
            if not (math.isfinite(self.budget_gb) and self.budget_gb > 0):
                raise ValueError(f"RematConfig.budget_gb must be finite and > 0, got {self.budget_gb}")
        pairs = []
        for i, pair in enumerate(self.policies):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
                raise TypeError(f"RematConfig.policies[{i}] must be a (pattern, policy) pair, got {pair!r}")
            pattern, policy = pair
            if isinstance(policy, str) and policy.upper() in RematPolicy.__members__:
                policy = RematPolicy[policy.upper()]
            if not isinstance(policy, RematPolicy):
                raise ValueError(f"RematConfig.policies[{i}]: {policy!r} is not a RematPolicy (one of {list(RematPolicy.__members__)})")
            pairs.append((pattern, policy))
        object.__setattr__(self, "policies", tuple(pairs))
        if self.budget_gb is not None and self.policies:
            raise ValueError("RematConfig: set budget_gb (the planner chooses) or policies (explicit), not both")

    def policy(self, region_name: str) -> RematPolicy:
        """The policy of region `region_name`: the last matching pattern's, SAVE_ALL if none matches."""
        chosen = RematPolicy.SAVE_ALL
        for pattern, policy in self.policies:
            if fnmatch.fnmatchcase(region_name, pattern):
                chosen = policy
        return chosen

    def check_regions(self, regions: Sequence[str]) -> None:
        """Every pattern of `policies` matches at least one of `regions`.

        Raises:
          ValueError: a pattern that matches no region (named, with the regions listed).
        """
        for pattern, _ in self.policies:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in regions):
                raise ValueError(f"RematConfig.policies: {pattern!r} matches no region of the model; regions: {', '.join(regions)}")


# Called as `observer(name, fn, params, args)` by every `region` call while `observe_regions` is active.
_OBSERVER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("remat_region_observer", default=None)


@contextlib.contextmanager
def observe_regions(observer: Callable[[str, Callable, nnx.State, tuple], None]) -> Iterator[None]:
    """Calls `observer(name, fn, params, args)` for every region the model runs inside the block.

    `fn(params, *args)` is the region as a pure function of its modules' state
    `params` (an `nnx.State`) and its array arguments `args` (other values it uses,
    such as offsets and RoPE tables, are constants to it), called at the region's place
    in the trace: a cost model can trace it there (`jax.make_jaxpr`), inside the same
    `shard_map` and sharded-step context.
    """
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def region(name: str, remat: RematConfig, modules, fn: Callable, *args):
    """`fn(modules, *args)` as region `name`, under the policy `remat` gives it.

    Args:
      name: the region's name (`region_names`).
      remat: the model's rematerialization settings.
      modules: the nnx modules (one, or a tuple) whose parameters the region uses.
      fn: `fn(modules, *args)`, the region's computation; it may close over static
        values and arrays that need no gradient (offsets, RoPE tables).
      args: the region's array inputs (arrays or pytrees of arrays).

    Returns:
      `fn(modules, *args)`: called as it is under SAVE_ALL; under any other policy,
      through `jax.checkpoint` of a pure function of the modules' state and `args`
      (`nnx.split` / `nnx.merge`), which gives the same values and gradients.
    """
    policy = remat.policy(name)
    observer = _OBSERVER.get()
    if policy is RematPolicy.SAVE_ALL and observer is None:
        return fn(modules, *args)
    graphdef, params = nnx.split(modules)

    def pure(params, *args):
        return fn(nnx.merge(graphdef, params), *args)

    if observer is not None:
        observer(name, pure, params, args)
    return checkpointed(pure, policy)(params, *args)


def checkpointed(fn: Callable, policy: RematPolicy) -> Callable:
    """`fn` under `policy`: itself for SAVE_ALL, else `jax.checkpoint(fn, policy=checkpoint_policy(policy))`."""
    if policy is RematPolicy.SAVE_ALL:
        return fn
    return jax.checkpoint(fn, policy=checkpoint_policy(policy))


def name_attention_output(x: jax.Array) -> jax.Array:
    """`x` named `ATTENTION_OUTPUT` for the SAVE_NAMED policy (an identity otherwise)."""
    return checkpoint_name(x, ATTENTION_OUTPUT)
