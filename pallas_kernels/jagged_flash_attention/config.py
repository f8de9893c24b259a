"""Static tile geometry shared by the JFA work list and the Mosaic GPU kernels."""

from __future__ import annotations

from pallas_kernels._src import mgpu_common

TILE_ROWS = 128  # rows of one work item: one query (or key) tile of one sequence
WG_ROWS = mgpu_common.WG_ROWS  # rows of a work item owned by one compute warpgroup (wgmma M)
NUM_COMPUTE_WGS = TILE_ROWS // WG_ROWS
NUM_STAGES = 2  # depth of the K/V (or Q/dO) ring each kernel streams through
FWD_BLOCK_KV = 128  # key rows per forward step
BWD_BLOCK = 64  # key rows per dQ step, query rows per dK/dV step

# Mosaic GPU's TMA into wgmma-tiled SMEM needs row starts that are multiples of
# the SMEM row tiling, so every window a kernel loads starts on a multiple of
# ROW_ALIGN: each sequence is viewed from `start - start % ROW_ALIGN`.
ROW_ALIGN = mgpu_common.ROW_ALIGN

# Windows that cross the end of the real data are read from a zero-padded copy
# of rows [align(end) - TAIL_BEFORE, align(end) + TAIL_BEFORE) (`schedule.tail_rows`).
TAIL_BEFORE = TILE_ROWS
TAIL_ROWS = 2 * TAIL_BEFORE

COMPUTE_REGISTERS = 232  # per thread, compute warpgroups (setmaxnreg)
MEMORY_REGISTERS = 40  # per thread, the TMA-issuing warpgroup

SUPPORTED_HEAD_DIMS = (64, 128)

# `jax.ad_checkpoint.checkpoint_name` of the forward's output and log-sum-exp residuals (`vjp.py`).
SAVED_NAME = "jagged_flash_attention_saved"
