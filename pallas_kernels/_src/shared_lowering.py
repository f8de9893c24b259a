"""Kernel calls that lower once per program, however many layers make them.

A model calls the same kernel with the same shapes once per layer (and its backward once
more per layer). Lowering a Mosaic GPU kernel runs in Python and takes about a second, and
jax lowers every `pallas_call` where it appears. Called through a `jax.jit` with the
configuration as static arguments, identical calls trace to the same jaxpr, which jax lowers
once per program and calls from each site (the same holds for their JVP and transpose).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax


@functools.cache
def _jitted(fn: Callable, static_argnames: tuple[str, ...]) -> Callable:
    return jax.jit(fn, static_argnames=static_argnames)


def call(fn: Callable, *args, static: dict, **dynamic):
    """`fn(*args, **static, **dynamic)` through one cached `jax.jit` of `fn` with `static` as static arguments.

    Args:
      fn: the op's kernel entry (its custom_vjp wrapper).
      args: array operands.
      static: hashable keyword arguments (shapes, flags, scales).
      dynamic: keyword array arguments.
    """
    return _jitted(fn, tuple(sorted(static)))(*args, **static, **dynamic)
