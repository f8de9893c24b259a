"""bfloat16 gradients for the parameters a loss uses only in bfloat16 (`OptimConfig.gradient_dtype`).

A float32 master parameter that the loss casts to bfloat16 and uses only through that
cast has a bfloat16 gradient widened to float32 by the cast's transpose: the step then
materialises a float32 gradient that holds exactly the widened bfloat16 values.
Differentiating with respect to the bfloat16 copy instead gives those bfloat16 values
themselves; the optimizer widens them on read (`gem_jax.train.optimizer`), which XLA
fuses into its consumers, so the update is unchanged bit for bit and the gradient is
written and read in 2 bytes an element instead of 4.

Which parameters qualify is read off the loss's jaxpr (`bf16_only_inputs`): a float32
input qualifies when it has exactly one use and that use is a
`convert_element_type(new_dtype=bfloat16)`, or passes it into a sub-jaxpr (jit, call,
`shard_map`, remat, the branches of `cond`, the per-iteration inputs of `scan`) whose
corresponding input qualifies in the same way. Exactly one use, because a parameter cast
twice gets the float32 sum of two widened gradients today, and a bfloat16 copy the
bfloat16 sum: other roundings. Everything else keeps its float32 gradient: a parameter
used in float32 anywhere (a norm's scale applied in float32, a bias added in float32, a
kernel quantized to FP8 from its float32 master, an embedding table's gather), one passed in float32
to a `custom_jvp`/`custom_vjp` function (its gradient is the custom rule's, which the
jaxpr does not show), a `scan` constant or carry (their gradients are accumulated over
the iterations in the parameter's dtype), and any other primitive.

Under `ShardedModel` with a bfloat16 compute dtype, every dense parameter is cast on its
shard before its all-gather (`gem_jax.parallel.spmd.gather_param`; FP8 kernels too, which
are quantized from that bfloat16 copy), so every dense parameter qualifies and the tables
do not: at `configs/gem_h200.py`, 111 of 118 leaves, 2.39 B parameters. Under a float32
compute dtype none does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core

GRADIENT_DTYPES = ("float32", "bfloat16")

# Primitives whose sub-jaxpr's inputs are the equation's inputs one for one: (param name, ...).
_PASS_THROUGH = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                 "shard_map": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr"}  # fmt: skip


def _open(jaxpr):
    return jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr


def _uses(jaxpr) -> dict:
    """var -> list of (eqn, operand position); outvars count as a use with eqn None."""
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for k, v in enumerate(eqn.invars):
            if isinstance(v, core.Var):
                uses.setdefault(v, []).append((eqn, k))
    for v in jaxpr.outvars:
        if isinstance(v, core.Var):
            uses.setdefault(v, []).append((None, None))
    return uses


def _sub_input(eqn, k: int) -> list | None:
    """The sub-jaxpr inputs that operand `k` of `eqn` becomes, each as (open jaxpr, input index); None if it is not a pass-through."""
    name = eqn.primitive.name
    if name in _PASS_THROUGH and _PASS_THROUGH[name] in eqn.params:
        return [(_open(eqn.params[_PASS_THROUGH[name]]), k)]
    if name == "cond":
        if k == 0:
            return None  # the branch index
        return [(_open(branch), k - 1) for branch in eqn.params["branches"]]
    if name == "scan":
        if "num_consts" in eqn.params:
            first_xs = eqn.params["num_consts"] + eqn.params["num_carry"]
        else:  # JAX 0.11: `ft_in`, a flat tree of one entry per input, grouped (consts, carries, xs)
            try:
                consts, carries, xs = eqn.params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
                first_xs = len(list(consts)) + len(list(carries))
                assert len(list(xs)) == len(eqn.invars) - first_xs
            except Exception:  # an unknown layout: keep float32 gradients
                return None
        return [(_open(eqn.params["jaxpr"]), k)] if k >= first_xs else None  # consts and carries: accumulated
    return None


def _qualifies(jaxpr, index: int, uses_cache: dict) -> bool:
    var = jaxpr.invars[index]
    if var.aval.dtype != jnp.float32:
        return False
    key = id(jaxpr)
    if key not in uses_cache:
        uses_cache[key] = (jaxpr, _uses(jaxpr))  # keeps jaxpr alive so its id stays unique
    uses = uses_cache[key][1].get(var, [])
    if len(uses) != 1:
        return False
    eqn, k = uses[0]
    if eqn is None:
        return False
    if eqn.primitive.name == "convert_element_type":
        return eqn.params["new_dtype"] == jnp.bfloat16
    subs = _sub_input(eqn, k)
    return bool(subs) and all(_qualifies(sub, i, uses_cache) for sub, i in subs)


def bf16_only_inputs(jaxpr) -> list[bool]:
    """For each input of `jaxpr` (open or closed): whether it is float32 and used once, only as a cast to bfloat16 (module docstring)."""
    jaxpr = _open(jaxpr)
    cache: dict = {}
    return [_qualifies(jaxpr, i, cache) for i in range(len(jaxpr.invars))]


def bf16_gradient_mask(fn: Callable, tree, *args) -> list[bool]:
    """By leaf of `tree` (`jax.tree.leaves` order): whether `fn(tree, *args)` uses it only through one cast to bfloat16.

    Traces `fn` once (`jax.make_jaxpr`; `tree` and `args` may be arrays, tracers or
    `jax.ShapeDtypeStruct`s) and computes nothing.
    """
    closed = jax.make_jaxpr(fn)(tree, *args)
    return bf16_only_inputs(closed)[: len(jax.tree.leaves(tree))]


def to_bf16(tree, mask: list[bool]):
    """`tree` with each leaf the mask selects cast to bfloat16."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([x.astype(jnp.bfloat16) if m else x for x, m in zip(leaves, mask, strict=True)])


def widen(tree):
    """Every bfloat16 leaf of `tree` as float32 (exact); other leaves unchanged."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) if g.dtype == jnp.bfloat16 else g, tree)


class MaskCache:
    """`bf16_gradient_mask` decisions of one model's loss, by the structure, shapes and dtypes of what is differentiated.

    The step's trace asks once per parameter structure; a re-trace for another batch
    shape finds the decision here and does not trace the loss again.
    """

    def __init__(self):
        self._masks: dict = {}

    def mask(self, key, fn: Callable, tree, *args) -> list[bool]:
        leaves, treedef = jax.tree.flatten(tree)
        full = (key, treedef, tuple((x.shape, jnp.dtype(x.dtype)) for x in leaves))
        if full not in self._masks:
            self._masks[full] = bf16_gradient_mask(fn, tree, *args)
        return self._masks[full]
