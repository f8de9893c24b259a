"""The padded <-> jagged layout changes: gradients equal autodiff's, computed by gathers instead of scatter-adds."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import jagged_layout


def _offsets(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _gather_only(values, offsets, n):  # the layout change without the custom VJP: autodiff's scatter-add
    pos = jnp.arange(n)
    valid = pos[None, :] < (offsets[1:] - offsets[:-1])[:, None]
    rows = jnp.where(valid, offsets[:-1, None] + pos[None, :], 0)
    return jnp.where(valid[..., None], values[rows], 0)


@pytest.mark.parametrize("lengths", [[0, 3, 5, 1], [4], [0, 0], [2, 7, 7, 1, 0, 3]])
def test_gradients_match_autodiff_and_ignore_slack(lengths):
    rng = np.random.default_rng()
    n = max(max(lengths), 1)
    offsets = _offsets(lengths)
    capacity = int(offsets[-1]) + 5
    values = jnp.asarray(rng.normal(size=(capacity, 3)), jnp.float32).at[int(offsets[-1]) :].set(jnp.nan)
    weights = jnp.asarray(rng.normal(size=(len(lengths), n, 3)), jnp.float32)

    ours = jax.grad(lambda v: (jagged_layout.to_padded(v, offsets, n) * weights).sum())(values)
    theirs = jax.grad(lambda v: (_gather_only(v, offsets, n) * weights).sum())(values)
    np.testing.assert_array_equal(ours, theirs)
    assert np.all(ours[int(offsets[-1]) :] == 0)

    rows = jnp.asarray(rng.normal(size=(capacity, 3)), jnp.float32)
    back = jax.grad(lambda p: (jagged_layout.from_padded(p, offsets, capacity) * rows).sum())(weights)
    np.testing.assert_array_equal(back, jagged_layout.to_padded(rows, offsets, n))


def test_the_gradient_gathers_rows_instead_of_scattering_them():
    offsets = _offsets([3, 1])
    for layout_change, shape in (
        (lambda v: jagged_layout.to_padded(v, offsets, 4), (6, 2)),
        (lambda p: jagged_layout.from_padded(p, offsets, 6), (2, 4, 2)),
    ):
        grad = jax.grad(lambda x: layout_change(x).astype(jnp.float32).sum())
        text = str(jax.make_jaxpr(grad)(jnp.ones(shape, jnp.bfloat16)))
        assert not re.search(r"bf16\[[^\]]*\] = scatter", text), text  # only int32 index bookkeeping scatters
        assert re.search(r"bf16\[[^\]]*\] = gather", text)
