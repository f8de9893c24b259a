"""The persistent tile loop of this project's warp-specialised Hopper GEMMs (one CTA per SM).

Two compute warpgroups own 64 rows each of a 128 x `tile_n` CTA tile, a third issues
the TMA copies (`plgpu.emit_pipeline_warp_specialized`); each CTA walks the output
tiles `plgpu.nd_loop` hands it, in the `planar_snake` order (tiles of
`grid_tile_width` columns, for L2 reuse), optionally in clusters of two CTAs on
adjacent row tiles ("m": they share, by multicast, the B tile) or adjacent column
tiles ("n": they share the A tile). Used by `pallas_kernels.mxfp8.kernel_matmul`
(block-scaled FP8) and `pallas_kernels.gelu_grad_matmul.kernel` (bf16, DGELU epilogue).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._src import dispatch, mgpu_common

NUM_COMPUTE_WGS = 2
WG_M = 64  # rows per compute warpgroup: one wgmma row group
CTA_M = NUM_COMPUTE_WGS * WG_M
CLUSTERS = (None, "m", "n")


def num_sms() -> int:
    """Persistent-grid size: the SM count on a GPU; a few simulated SMs in CPU interpret mode."""
    return mgpu_common.sm_count() if dispatch.default_device().platform == "gpu" else 4


def cluster_shape(cluster: str | None) -> tuple[int, int]:
    """`(CTAs along M, CTAs along N)` of a cluster: (1, 1), (2, 1) for "m", (1, 2) for "n"."""
    return (2 if cluster == "m" else 1), (2 if cluster == "n" else 1)


def num_ctas(num_tiles: int, cluster: str | None) -> int:
    """CTAs of the persistent grid for `num_tiles` cluster tiles: at most one per SM, whole clusters."""
    size = cluster_shape(cluster)[0] * cluster_shape(cluster)[1]
    return min(num_sms() // size, num_tiles) * size


def tile_index(lin, m_iters: int, n_iters: int, grid_tile_width: int, cluster: str | None, cta):
    """`(mi, ni)`: the CTA tile (row, column index in CTA tiles) of linear cluster-tile index `lin`.

    `m_iters`, `n_iters` count cluster tiles; `cta` is `lax.axis_index("cluster")`, this CTA's
    place in its cluster.
    """
    cl_m, cl_n = cluster_shape(cluster)
    mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, grid_tile_width)
    if cl_m == 2:
        mi = mi * 2 + cta
    if cl_n == 2:
        ni = ni * 2 + cta
    return mi, ni



class Tile(NamedTuple):
    """One output tile of the persistent loop, for one warpgroup: its CTA-tile row index and `pl.ds` slices."""

    mi: Any  # row index in CTA tiles (traced): a per-row-tile output's index
    rows: Any  # pl.ds of the tile's CTA_M rows
    columns: Any  # pl.ds of its tile_n columns
    wg_rows: Any  # pl.ds of warpgroup `wg`'s WG_M rows inside the tile


def tile(lin, m_iters: int, n_iters: int, tile_n: int, grid_tile_width: int, cluster: str | None, cta, wg) -> Tile:
    """The output tile `lin` (`tile_index`'s) and warpgroup `wg`'s rows in it (`wg` is `lax.axis_index("wg")`)."""
    mi, ni = tile_index(lin, m_iters, n_iters, grid_tile_width, cluster, cta)
    return Tile(mi, pl.ds(mi * CTA_M, CTA_M), pl.ds(ni * tile_n, tile_n), pl.ds(wg * WG_M, WG_M))
