"""Tile shapes and shared-memory budget of the GDPA kernels (static, chosen per call).

Every GDPA kernel is one instance of the tile engine (`engine.py`): a "row"
operand side whose 64-row warpgroup tiles stay in registers as accumulators,
and a "column" side streamed (or kept resident) through a ring of SMEM slots.

    forward   rows = Q        cols = K, V     acc = O
    dQ        rows = Q, dO    cols = K, V     acc = dQ
    dK/dV     rows = K, V     cols = Q, dO    acc = dK, dV

Two compute warpgroups split the work either by rows (a 128-row tile, each
warpgroup owns 64 rows; for long row sequences) or by columns (a shared 64-row
tile, warpgroup w takes column steps w, w+2, ...; for short row sequences such
as pooled queries or cross-attention keys), which writes two partial outputs
that the wrapper adds.
"""

from __future__ import annotations

import dataclasses
import enum

from pallas_kernels._src import mgpu_common

WG_ROWS = mgpu_common.WG_ROWS  # rows per compute warpgroup: the wgmma M
ALIGN = mgpu_common.ROW_ALIGN  # rows: TMA copies of swizzled SMEM tiles start at multiples of this
NUM_COMPUTE_WGS = 2
SUPPORTED_HEAD_DIMS = (64, 128)  # the tiles of every pass fit in shared memory for these
# Opt-in dynamic shared memory per block on H100/H200 (227 KiB), less a margin
# for barriers and Mosaic's own scratch (`reduction_scratch_bytes`).
SMEM_BUDGET = 227 * 1024 - 3 * 1024
REDUCTION_SCRATCH_BYTES = 0
# Row tiles a CTA gets in the causal forward from which two-tile items beat one-tile items:
# one tile was fastest at 9.7 and 15 tiles a CTA, two at 146 (H100, 2026-12-06, HSTU's cases).
GROUPED_PAIRS_FROM = 48


class Split(enum.StrEnum):
    ROWS = "rows"  # warpgroup w owns rows [64 w, 64 w + 64) of a 128-row tile
    COLS = "cols"  # both own the same 64 rows; warpgroup w takes column steps of parity w


def rows_per_tile(split: Split) -> int:
    """Rows of one tile: 128 when the warpgroups split rows, 64 when they split columns."""
    return WG_ROWS * NUM_COMPUTE_WGS if split is Split.ROWS else WG_ROWS


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static tiling of one engine instance.

    Attributes:
      split: how the two compute warpgroups share a tile (see `Split`).
      block_cols: columns per step (64 or 128), the N of the score wgmma.
      col_slots: SMEM slots of the column ring.
      row_slots: SMEM slots for row tiles (2 lets the next tile load during compute).
      max_col_tiles: static bound on column steps per sequence (its columns start
        up to 7 rows into their first 8-aligned tile); when it fits in `col_slots`
        the columns of a work item stay resident across its row tiles.
      row_tiles_per_item: row tiles grouped into one work item (resident columns
        are loaded once per item).
      num_ctas: persistent CTAs (the GPU's SM count).
      group_sequences: sort the work items by their sequence's work, each sequence's items
        together (`schedule.build`), instead of by their own work: with short items the CTAs
        side by side then stream the same sequence's columns at about the same time, one copy
        in L2. On for the causal forward (`choose`'s `causal_forward_rows`).
    """

    split: Split
    block_cols: int
    col_slots: int
    row_slots: int
    max_col_tiles: int
    row_tiles_per_item: int
    num_ctas: int
    group_sequences: bool = False

    @property
    def rows_per_tile(self) -> int:
        return rows_per_tile(self.split)

    @property
    def resident(self) -> bool:
        """Columns loaded once per work item instead of once per row tile."""
        return self.max_col_tiles <= self.col_slots

    @property
    def resident_groups(self) -> int:
        """Work items whose resident columns fit at once (>1 overlaps the next item's loads)."""
        return self.col_slots // self.max_col_tiles if self.resident else 0


def smem_bytes(cfg: TileConfig, *, head_dim: int, itemsize: int, n_row_inputs: int, n_col_inputs: int) -> int:
    """Shared memory of one CTA: row slots, column ring and the output staging tile."""
    tile = WG_ROWS * head_dim * itemsize
    row_copies = NUM_COMPUTE_WGS if cfg.split is Split.ROWS else 1
    rows = cfg.row_slots * row_copies * n_row_inputs * tile
    cols = cfg.col_slots * n_col_inputs * cfg.block_cols * head_dim * itemsize
    staging = NUM_COMPUTE_WGS * tile
    return rows + cols + staging + REDUCTION_SCRATCH_BYTES


def choose(
    *,
    max_rows: int,
    max_cols: int,
    head_dim: int,
    itemsize: int,
    n_row_inputs: int,
    n_col_inputs: int,
    num_ctas: int,
    block_cols: int | None = None,
    causal_forward_rows: int = 0,
) -> TileConfig:
    """Heuristic tile config for sequences of at most `max_rows` rows and `max_cols` columns.

    Rows split when a sequence fills a 128-row tile, else columns split. The
    column block is 64 when the columns fit in 64 (cross attention over short
    KV) or when two 128-column slots do not fit beside the row slots; the ring
    then takes as many slots as the budget allows (at most 4), which keeps
    short columns resident and overlaps the next item's loads.

    A work item is 8 row tiles (forward within 2-4% of 2 and 4 on the H200 for
    cross and pooled attention: benchmarks/gdpa.md, "Tiling sweep"), except in
    the causal forward: `causal_forward_rows` (its output rows times heads, 0
    for any other pass) makes the items one row tile, or two where a CTA gets
    `GROUPED_PAIRS_FROM` or more row tiles, dealt sequence by sequence
    (`group_sequences`). On the H100 that took HSTU's three cases from
    0.156 / 1.939 / 0.650 ms to 0.134 / 1.617 / 0.418 ms (benchmarks/gdpa.md,
    "Causal SiLU against HSTU's Triton kernel").

    Raises:
      ValueError: the head dimension does not fit in shared memory.
    """
    split = Split.ROWS if max_rows > WG_ROWS else Split.COLS
    group_sequences = causal_forward_rows > 0
    if group_sequences:
        tiles_per_cta = causal_forward_rows / rows_per_tile(split) / num_ctas
        row_tiles_per_item = 2 if tiles_per_cta >= GROUPED_PAIRS_FROM else 1
    else:
        row_tiles_per_item = 8
    candidates = (block_cols,) if block_cols else ((64,) if max_cols <= 64 else (128, 64))
    for bc in candidates:
        for slots in (4, 3, 2):
            cfg = TileConfig(
                split=split,
                block_cols=bc,
                col_slots=slots,
                row_slots=2,
                max_col_tiles=-(-(max_cols + ALIGN - 1) // bc),
                row_tiles_per_item=row_tiles_per_item,
                num_ctas=num_ctas,
                group_sequences=group_sequences,
            )
            if (
                smem_bytes(
                    cfg,
                    head_dim=head_dim,
                    itemsize=itemsize,
                    n_row_inputs=n_row_inputs,
                    n_col_inputs=n_col_inputs,
                )
                <= SMEM_BUDGET
            ):
                if slots > 2 and not cfg.resident:
                    # A streaming ring gains little past double buffering.
                    cfg = dataclasses.replace(cfg, col_slots=2)
                return cfg
    raise ValueError(f"head_dim={head_dim} needs more shared memory than the GDPA kernels have")
