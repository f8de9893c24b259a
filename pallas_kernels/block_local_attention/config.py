"""Static geometry of the block-local attention kernels."""

BLOCK = 64  # rows of one attention block: one wgmma M tile; a work item is one block with all its heads
KERNEL_BLOCK_SIZES = (BLOCK,)
SUPPORTED_HEAD_DIMS = (64, 128)

# Ring slots of shared memory per CTA (`_mgpu.walk`), one (block, head) step each,
# persistent CTAs per SM and consumer warpgroups per CTA. With S slots, step s
# computes in slot s % S while step s + 1 loads into the next slot and the output
# stores of steps s - S + 2 .. s - 1 may still read theirs: three slots let the
# stores of step s - 1 drain under step s; with two, step s first waits until they
# have read their slot. Two steps in flight per SM, as two CTAs or as two
# warpgroups of one CTA taking its steps alternately: one step's serial phases
# (shared memory -> registers -> RoPE -> swizzled rewrite, softmax, output
# staging) run under the other's loads and wgmmas. Two CTAs fit when a CTA takes
# at most 113 KiB (an H100 / H200 SM has 228 KiB of shared memory, 1 KiB of it
# reserved per CTA; one CTA may use 227 KiB). Registers do not bound either: two
# warpgroups of 128 threads, in one CTA or two, may each use 255 registers a
# thread (2 x 128 x 255 <= 64 K). Shared memory per CTA, bf16/f16, as Mosaic GPU
# lays it out for jax 0.11.2 (1 KiB-aligned buffers, its 2 KiB reduction scratch,
# RoPE positions, frequencies and barriers included):
#   forward,  2 slots of q, k, v [64, D], P [64, 64]:                  D=128 108 KiB, D=64 60 KiB
#   backward, 3 slots of q, k, v, dO [64, D], dS [64, 64], lse, delta: D=64 110 KiB (one warpgroup);
#             D=128 214 KiB with two warpgroups (dS, lse, delta one per warpgroup; 206 KiB with one)
# so the forward runs two CTAs per SM at either D, the backward two at D=64
# and, at D=128, one CTA of two warpgroups: two CTAs there would need two slots
# each (142 KiB), still too many for one SM, and a fourth slot (+64 KiB) would
# not fit one. Three slots suit two warpgroups: S - 1 = 2 is a multiple of W = 2,
# so the slot a step's successor loads into was last computed by the warpgroup
# issuing the load (`_mgpu.walk`). A block's float32 RoPE cos/sin tables
# (2 x [64, D/2]: 32 KiB at D=128) stay in registers across the block's heads a
# warpgroup computes (64 registers a thread at D=128, 32 at D=64), each
# warpgroup computing its own on its first step of the block: no shared memory,
# and at most W table computations per block instead of one.
FORWARD_SLOTS = 2
BACKWARD_SLOTS = 3
FORWARD_CTAS_PER_SM = 2
BACKWARD_CTAS_PER_SM = {64: 2, 128: 1}  # by head dim D
BACKWARD_WARPGROUPS = {64: 1, 128: 2}  # consumer warpgroups per backward CTA, by head dim D

INTERPRET_CTAS = 3  # persistent CTAs of each kernel under the CPU interpreter (a GPU: its CTAs per SM x SM count)
