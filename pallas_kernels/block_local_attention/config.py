"""Static geometry of the block-local attention kernels."""

BLOCK = 64  # rows of one attention block: one wgmma M tile and one work item
KERNEL_BLOCK_SIZES = (BLOCK,)
SUPPORTED_HEAD_DIMS = (64, 128)
