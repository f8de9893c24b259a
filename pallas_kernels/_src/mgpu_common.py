"""Mosaic GPU building blocks shared by the attention kernels (JFA, GDPA, block-local).

A wgmma into a fresh accumulator (`matmul`), or two issued back to back
(`matmul_pair`); shared memory in the 128-byte swizzled layout that wgmma and
TMA use, and the output path of a 64-row warpgroup tile: a staging buffer with a
swizzled and a plain view, and a store that writes exactly a tile's rows `[lo,
hi)`, so rows of neighbouring jagged sequences are never touched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src.dispatch import default_device
from pallas_kernels._src.dispatch import interpreting  # noqa: F401  (the kernels read it from here)

H100_H200_SM_COUNT = 132  # SMs of an H100 / H200 SXM: the persistent grid when the device does not say
WG_ROWS = 64  # rows of one compute warpgroup's tile (the wgmma M)
ROW_ALIGN = 8  # TMA copies of swizzled SMEM tiles start at multiples of this many rows


def matmul(a, b, shape: tuple[int, int]) -> jax.Array:
    """`a @ b` of shared-memory operands on the tensor cores into a fresh f32 `shape` accumulator (waits for it)."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def matmul_pair(a1, b1, a2, b2, shape: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """`(a1 @ b1, a2 @ b2)` of shared-memory operands into fresh f32 `shape` accumulators: both wgmmas
    issued back to back, then one wait for both, instead of a wait after each."""

    def body(r1, r2):
        plgpu.wgmma(r1, a1, b1)
        plgpu.wgmma(r2, a2, b2)
        return r1[...], r2[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def sm_count() -> int:
    """SMs of the device ops decide for (`dispatch.default_device`): the persistent kernels' grid size."""
    return int(getattr(default_device(), "core_count", 0) or H100_H200_SM_COUNT)


def swizzled_smem(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """SMEM laid out for wgmma / 128-byte-swizzled TMA (last dim a multiple of 64 bf16)."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def staging_smem(num_warpgroups: int, head_dim: int, dtype) -> plgpu.RefUnion:
    """Output staging, `[num_warpgroups, 64, D]`: one swizzled view and one plain view of the same bytes."""
    shape = (num_warpgroups, WG_ROWS, head_dim)
    return plgpu.RefUnion(swizzled_smem(shape, dtype), plgpu.SMEM(shape, dtype))


def store_rows(value: jax.Array, staging, wg, dst_ref, row, head, lo, hi) -> None:
    """Stores rows `[lo, hi)` (0 <= lo <= hi <= 64) of a `[64, D]` value to `dst_ref[row + i, head]`.

    `staging` is a `staging_smem`; warpgroup `wg` uses its slice. `row` (the GMEM
    row of value row 0) is a multiple of 8. A full tile leaves in one TMA store
    from the swizzled view; a partial one through the plain view as TMA stores
    of 32, 16, ..., 1 rows (TMA boxes have static sizes), so no row outside
    `[lo, hi)` is written. The caller waits for the stores
    (`plgpu.wait_smem_to_gmem`) before it reuses the staging buffer.
    """
    swizzled_view, plain_view = staging
    swizzled_ref, plain_ref = swizzled_view.at[wg], plain_view.at[wg]
    n = hi - lo

    @pl.when(n == WG_ROWS)
    def _():
        swizzled_ref[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(swizzled_ref, dst_ref.at[pl.ds(pl.multiple_of(row, ROW_ALIGN), WG_ROWS), head])

    @pl.when((n > 0) & (n < WG_ROWS))
    def _():
        plain_ref[...] = value
        plgpu.commit_smem()
        done = lo
        size = WG_ROWS // 2
        while size:

            @pl.when(lax.bitwise_and(n, jnp.int32(size)) != 0)
            def _(size=size, done=done):
                plgpu.copy_smem_to_gmem(plain_ref.at[pl.ds(done, size)], dst_ref.at[pl.ds(row + done, size), head])

            done = done + lax.bitwise_and(n, jnp.int32(size))
            size //= 2
