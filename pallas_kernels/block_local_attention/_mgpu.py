"""Mosaic GPU building blocks shared by the block-local forward and backward kernels.

Each CTA runs one warpgroup on one head of one 64-row block. A block starts at
any packed row, so its operands are copied by TMA into plain (untiled) shared
memory, which takes any row start, and rewritten in registers (RoPE applied,
rows past the block zeroed) into the 128-byte swizzled layout wgmma reads,
over the same bytes. Outputs leave through the plain view as TMA stores of
64, 32, ..., 1 rows, so no row outside the block is ever written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import mgpu_common
from pallas_kernels.block_local_attention import schedule
from pallas_kernels.block_local_attention.config import BLOCK
from pallas_kernels.jagged_flash_attention import schedule as jfa_schedule

LAYOUT = plgpu.Layout.WGMMA


def operand_smem(head_dim: int, dtype, *extra) -> plgpu.RefUnion:
    """`[64, D]` shared memory with a plain view (TMA in and out), a swizzled view (wgmma)
    and any `extra` views of the same bytes (for values that replace the operand once read)."""
    plain = plgpu.SMEM((BLOCK, head_dim), dtype)
    return plgpu.RefUnion(plain, mgpu_common.swizzled_smem((BLOCK, head_dim), dtype), *extra)


def read_block(table_ref, blk) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(start, rows, keys)` of block record `blk` (see `schedule`)."""
    return table_ref[blk, schedule.F_START], table_ref[blk, schedule.F_ROWS], table_ref[blk, schedule.F_KEYS]


def copy_block_in(src_ref, tail_ref, start, head, end, dst, barrier) -> None:
    """TMA packed rows `[start, start + 64)` of one head into the plain `dst`.

    A block that runs past `end` (the first slack row) is read from the
    zero-padded tail copy (`jagged_flash_attention.schedule.tail_rows`), so no
    slack row and no row past the buffer is loaded.
    """
    crosses = start + BLOCK > end

    @pl.when(crosses)
    def _():
        plgpu.copy_gmem_to_smem(tail_ref.at[pl.ds(start - jfa_schedule.tail_base(end), BLOCK), head], dst, barrier)

    @pl.when(jnp.logical_not(crosses))
    def _():
        plgpu.copy_gmem_to_smem(src_ref.at[pl.ds(start, BLOCK), head], dst, barrier)


def rope_tables(pos_smem, freq_smem, half: int) -> tuple[jax.Array, jax.Array]:
    """`(cos, sin)` float32 `[64, D/2]` of `positions[row] * freq[col]` (accurate, not approximate, sin/cos)."""
    pos = plgpu.load(pos_smem, layout=LAYOUT.reduce(1))
    freq = plgpu.load(freq_smem, layout=LAYOUT.reduce(0))
    shape = (BLOCK, half)
    angles = lax.broadcast_in_dim(pos, shape, [0]) * lax.broadcast_in_dim(freq, shape, [1])
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, tables, *, inverse: bool = False) -> jax.Array:
    """Rotate-half RoPE of a float32 `[64, D]` tile, or its transpose (the backward) when `inverse`."""
    cos, sin = tables
    half = x.shape[1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    if inverse:
        return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)


def row_iota(cols: int) -> jax.Array:
    """int32 `[64, cols]` row index of each element, in the kernels' register layout."""
    return plgpu.broadcasted_iota(jnp.int32, (BLOCK, cols), 0, layout=LAYOUT)


def col_iota(cols: int) -> jax.Array:
    """int32 `[64, cols]` column index of each element, in the kernels' register layout."""
    return plgpu.broadcasted_iota(jnp.int32, (BLOCK, cols), 1, layout=LAYOUT)


def swizzle_operand(union, rows, tables=None) -> None:
    """Rewrites a loaded plain `[64, D]` operand in place as its swizzled view.

    Rows at or past `rows` (other sequences' rows) become 0; with `tables`,
    RoPE is applied first (in float32, rounded once to the operand dtype, as
    the unfused `rope` does). The caller commits shared memory before wgmma.
    """
    plain, swizzled = union[0], union[1]
    x = plgpu.load(plain, layout=LAYOUT, optimized=False).astype(jnp.float32)
    if tables is not None:
        x = rotate(x, tables)
    x = jnp.where(row_iota(x.shape[1]) < rows, x, 0.0)
    plgpu.commit_smem()  # every thread has read the plain view before the swizzled view overwrites it
    swizzled[...] = x.astype(plain.dtype)


def mask_keys(s: jax.Array, rows, *, axis: int) -> jax.Array:
    """`s` with the entries of keys (along `axis`) at or past `rows` set to -inf."""
    pos = col_iota(s.shape[1]) if axis == 1 else row_iota(s.shape[1])
    return jnp.where(pos < rows, s, -jnp.inf)


def matmul(a, b, shape: tuple[int, int]) -> jax.Array:
    """`a @ b` of two shared-memory operands into a fresh float32 accumulator."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def store_block(value: jax.Array, plain, dst_ref, start, rows, head) -> None:
    """Stores rows `[0, rows)` of a `[64, D]` value to `dst_ref[start + i, head]` through `plain`.

    TMA boxes have static sizes, so the rows leave as stores of 64, 32, ..., 1
    rows (one per set bit of `rows`). The caller waits for the stores
    (`plgpu.wait_smem_to_gmem`) before the kernel ends.
    """
    plain[...] = value
    plgpu.commit_smem()
    done = 0
    size = BLOCK
    while size:

        @pl.when(lax.bitwise_and(rows, jnp.int32(size)) != 0)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(plain.at[pl.ds(done, size)], dst_ref.at[pl.ds(start + done, size), head])

        done = done + lax.bitwise_and(rows, jnp.int32(size))
        size //= 2


def zeros(cols: int) -> jax.Array:
    """float32 `[64, cols]` zeros in the kernels' register layout (an accumulator's start)."""
    return plgpu.layout_cast(jnp.zeros((BLOCK, cols), jnp.float32), LAYOUT)
