"""What a differentiated function keeps for its backward pass, and the matmul FLOPs of a program.

`jax.vjp` keeps residuals: the values its linearization saves for the backward (those
`jax.ad_checkpoint.print_saved_residuals` lists). In the compiled step XLA fuses
elementwise and layout operations into their consumers and recomputes them inside the
backward's fusions rather than storing them (XLA's producer-consumer fusion duplicates
cheap producers into each consumer), so many residuals JAX names are never
materialized, e.g. the float32 values inside an RMSNorm. Not always: XLA's H200 compile of
`jax.nn.gelu` wrote its tanh as a second output of the forward's fusion, one 4096-wide
tensor per MLP, which is why `gem_jax.nn.layers.gelu` recomputes it (`benchmarks/step.md`).
`residual_bytes` therefore counts, by default, the *materialized* values the residuals need:
each residual, traced back through elementwise and layout operations (`FUSED_PRIMITIVES`), to the values XLA writes to memory anyway: outputs of matmuls,
reductions, gathers, kernels and other non-fusible operations, operands of those, and
the function's inputs. This is a model of XLA's fusion, not its memory assignment;
`fusion=False` counts every residual as JAX names it (an upper bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.extend import core as jex_core

# Elementwise and layout primitives XLA fuses into their consumers (recomputing them there).
FUSED_PRIMITIVES = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "cbrt", "clamp", "concatenate", "convert_element_type", "copy", "copy_p", "cos",
    "div", "eq", "erf", "erf_inv", "exp", "exp2", "expand_dims", "expm1", "ge", "gt", "integer_pow", "iota", "is_finite",
    "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "name", "ne", "neg", "not", "one_minus_square", "or", "pad",
    "pow", "reduce_precision", "reshape", "rsqrt", "select_n", "sign", "sin", "slice", "sqrt", "square", "squeeze", "sub",
    "tan", "tanh", "transpose",
})


def residual_bytes(fn: Callable, params, *args, fusion: bool = True) -> int:
    """Bytes `jax.vjp(fn, params, *args)` keeps for the backward.

    Counted: intermediate values and the arguments `args`; not `params` (held by the
    train state) nor the values `fn` closes over (batch-derived constants). With
    `fusion`, the materialized values the residuals are recomputed from (module
    docstring), each once; without, every residual JAX names.

    Args:
      fn: `fn(params, *args)`, differentiable in `params` and `args`.
      params, args: pytrees of arrays or `jax.ShapeDtypeStruct`s.
    """
    closed, out_shape = jax.make_jaxpr(lambda p, a: jax.vjp(lambda p, a: fn(p, *a), p, a), return_shape=True)(params, args)
    jaxpr = closed.jaxpr
    num_residuals = len(jax.tree.leaves(out_shape[1]))
    residuals = [v for v in jaxpr.outvars[len(jaxpr.outvars) - num_residuals:] if not isinstance(v, jex_core.Literal)]
    free = set(jaxpr.invars[: len(jax.tree.leaves(params))]) | set(jaxpr.constvars)
    # The materialized values each value is computed from by fused operations alone (itself if materialized).
    anchors = {v: frozenset([v]) for v in jaxpr.invars if v not in free}
    materialized = {
        v for eqn in jaxpr.eqns if eqn.primitive.name not in FUSED_PRIMITIVES for v in eqn.invars if not isinstance(v, jex_core.Literal)
    }

    def of(v) -> frozenset:
        return frozenset() if isinstance(v, jex_core.Literal) or v in free else anchors[v]

    for eqn in jaxpr.eqns:
        fused = eqn.primitive.name in FUSED_PRIMITIVES
        inner = frozenset().union(*map(of, eqn.invars)) if fused else frozenset()
        for v in eqn.outvars:
            anchors[v] = inner if fused and v not in materialized else frozenset([v])
    kept = set().union(*map(of, residuals)) if fusion else {v for v in residuals if v not in free}
    return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in kept)


def dot_flops(jaxpr: jex_core.Jaxpr) -> float:
    """2 x output elements x contracted size, summed over the `dot_general`s without batch
    dimensions of `jaxpr` and its sub-jaxprs: the GEMMs (attention's batched products and
    the insides of Pallas kernels are not counted).

    Args:
      jaxpr: a traced program (`jax.make_jaxpr(f)(...).jaxpr`).

    Returns:
      FLOPs (float; 0.0 for a program without such GEMMs).
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), (batch, _) = eqn.params["dimension_numbers"]
            if not batch:
                lhs = eqn.invars[0].aval.shape
                total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracting)
        elif eqn.primitive.name != "pallas_call":
            for sub in _sub_jaxprs(eqn.params.values()):
                total += dot_flops(sub)
    return total


def _sub_jaxprs(values) -> list[jex_core.Jaxpr]:
    found = []
    for value in values:
        if isinstance(value, jex_core.ClosedJaxpr):
            found.append(value.jaxpr)
        elif isinstance(value, jex_core.Jaxpr):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _sub_jaxprs(value)
    return found
