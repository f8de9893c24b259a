"""Static geometry of the block-local attention kernels."""

BLOCK = 64  # rows of one attention block: one wgmma M tile; a work item is one block with all its heads
KERNEL_BLOCK_SIZES = (BLOCK,)
SUPPORTED_HEAD_DIMS = (64, 128)

# Ring slots of shared memory per CTA (`_mgpu.walk`), one (block, head) step each,
# and persistent CTAs per SM. With S slots, step s computes in slot s % S while
# step s + 1 loads into the next slot and the output stores of steps s - S + 2 ..
# s - 1 may still read theirs: three slots let the stores of step s - 1 drain
# under step s; with two, step s first waits until they have read their slot.
# Two CTAs on one SM are two steps in flight: one CTA's serial phases (shared
# memory -> registers -> RoPE -> swizzled rewrite, softmax, output staging) run
# under the other's loads and wgmmas. Two fit when a CTA takes at most 113 KiB
# (an H100 / H200 SM has 228 KiB of shared memory, 1 KiB of it reserved per CTA;
# one CTA may use 227 KiB; two CTAs of 128 threads may use all 255 registers a
# thread). Shared memory per CTA, bf16/f16, as Mosaic GPU lays it out for jax
# 0.11.2 (1 KiB-aligned buffers, its 2 KiB reduction scratch, RoPE positions,
# frequencies and barriers included):
#   forward,  2 slots of q, k, v [64, D], P [64, 64]:                  D=128 108 KiB, D=64 60 KiB
#   backward, 3 slots of q, k, v, dO [64, D], dS [64, 64], lse, delta: D=128 206 KiB, D=64 110 KiB
# so the forward runs two CTAs per SM at either D, the backward two at D=64
# and one at D=128: two of its slots there (142 KiB) would still not let a
# second CTA in, and a fourth slot (+64 KiB) would not fit one. A block's float32
# RoPE cos/sin tables (2 x [64, D/2]: 32 KiB at D=128) stay in registers across
# the block's H steps (64 registers a thread at D=128, 32 at D=64).
FORWARD_SLOTS = 2
BACKWARD_SLOTS = 3
FORWARD_CTAS_PER_SM = 2
BACKWARD_CTAS_PER_SM = {64: 2, 128: 1}  # by head dim D

INTERPRET_CTAS = 3  # persistent CTAs of each kernel under the CPU interpreter (a GPU: its CTAs per SM x SM count)
