"""Divergence guard: every step's loss and gradient norm are checked before a checkpoint can hold its state.

`FiniteTracker.update` folds each step's metrics into two device scalars, "all
finite so far" and "first non-finite step", with one tiny jitted op that is
dispatched asynchronously like the step itself: no host sync per step. `check`
reads them (one sync) and is called before every save and on log steps, so a
checkpoint never holds the state after a non-finite step and the error names
the exact step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class NonFiniteLossError(FloatingPointError):
    """The training loss or gradient norm became NaN or Inf.

    Attributes:
      step: the first step (1-based) whose loss or gradient norm was not finite.
    """

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@jax.jit
def _fold(all_finite, first_bad, loss, grad_norm, step):
    finite = jnp.isfinite(loss).all() & jnp.isfinite(grad_norm).all()
    first_bad = jnp.where(all_finite & ~finite, step, first_bad)
    return all_finite & finite, first_bad


class FiniteTracker:
    """Accumulates on the device whether every step so far had a finite loss and gradient norm."""

    def __init__(self):
        self._all_finite = self._first_bad = None

    def update(self, step: int, metrics: dict) -> None:
        """Folds in step `step` (1-based) from the train step's `loss` and `grad_norm` metrics."""
        if self._all_finite is None:  # placed like the metrics, so that `_fold` compiles once, at the first step
            sharding = metrics["loss"].sharding
            self._all_finite = jax.device_put(np.array(True), sharding)
            self._first_bad = jax.device_put(np.array(-1, np.int32), sharding)
        self._all_finite, self._first_bad = _fold(self._all_finite, self._first_bad, metrics["loss"], metrics["grad_norm"], jnp.int32(step))

    def check(self, last_good: str) -> None:
        """Raises if any step so far was non-finite.

        Args:
          last_good: the newest checkpoint on disk, for the message.

        Raises:
          NonFiniteLossError: naming the first non-finite step and `last_good`.
        """
        if self._all_finite is None or bool(self._all_finite):
            return
        step = int(self._first_bad)
        raise NonFiniteLossError(
            f"the loss or gradient norm became NaN/Inf at step {step}; no checkpoint after step {step - 1} was written. "
            f"Last good checkpoint: {last_good}.",
            step,
        )
