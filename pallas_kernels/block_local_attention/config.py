"""Static geometry of the block-local attention kernels."""

BLOCK = 64  # rows of one attention block: one wgmma M tile; a work item is one block with all its heads
KERNEL_BLOCK_SIZES = (BLOCK,)
SUPPORTED_HEAD_DIMS = (64, 128)

# Ring slots of shared memory per CTA (`_mgpu.walk`), one (block, head) step each:
# step s computes in slot s % 3 while step s + 1 loads into the next slot and step
# s - 1's output stores still read the one before it. Shared memory per CTA,
# bf16/f16, as Mosaic GPU lays it out for jax 0.11.2 (1 KiB-aligned buffers, its
# 2 KiB reduction scratch; an H100 / H200 CTA may use 227 KiB):
#   forward:  3 slots of q, k, v [64, D], P [64, 64]:               D=128 156 KiB, D=64 84 KiB
#   backward: 3 slots of q, k, v, dO [64, D], dS [64, 64], lse, delta: D=128 206 KiB, D=64 110 KiB
# (RoPE positions, frequencies and barriers included). A fourth backward slot at
# D=128 (+64 KiB) would not fit, nor would a block's float32 RoPE cos/sin tables
# (2 x [64, D/2]: +32 KiB at D=128): they stay in registers across the block's H
# steps (64 registers a thread at D=128, 32 at D=64).
NUM_SLOTS = 3

INTERPRET_CTAS = 3  # persistent CTAs when the CPU interpreter runs the kernels (a GPU uses its SM count)
