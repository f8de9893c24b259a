"""Row tiles of the memory-bound Triton row kernels (qk_norm_rope, rms_norm): a program's rows and their mask."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


MAX_WARPS = 32  # warps of one Triton program (1024 threads)


def check_tile(op_name: str, tile) -> tuple[int, int]:
    """`(rows, warps)` of `tile`, else a ValueError naming `op_name`: both positive powers of two (Triton's block
    shapes and warps), at most `MAX_WARPS` warps."""
    if len(tile) != 2 or not all(isinstance(n, int) and n > 0 and n & (n - 1) == 0 for n in tile):
        raise ValueError(f"{op_name}: tile must be (rows, warps), both powers of two, got {tile}")
    if tile[1] > MAX_WARPS:
        raise ValueError(f"{op_name}: tile {tuple(tile)} asks for {tile[1]} warps; a Triton program runs at most {MAX_WARPS}")
    return tuple(tile)


def tile_rows(t: int, n: int, index=None):
    """Rows `[index * n, index * n + n)` (default index: the program's id) as a slice, and the mask `[n, 1]` of
    those before `t` (a tile past the end is all masked)."""
    i = pl.program_id(0) if index is None else index
    valid = i * n + lax.broadcasted_iota(jnp.int32, (n,), 0) < t
    return pl.ds(i * n, n), valid[:, None]
