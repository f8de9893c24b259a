"""`pl.pallas_call` of a Triton-lowered kernel (the memory-bound row kernels: mxfp8 quantize, qk_norm_rope)."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt


def triton_call(body, operands, *, out_shape, grid, name: str, interpret: bool, num_warps: int = 4):
    """`body` over `grid` on `operands` with the Triton lowering (one pipeline stage, `num_warps` warps a program).

    The tests' Mosaic GPU simulator does not run Triton-lowered kernels: they use the generic interpreter
    (`interpret=True`). pallas_call reads the simulator's context when it is built, so it is built and called
    with that context cleared.
    """
    with plgpu.force_gpu_interpret_mode(None):
        return pl.pallas_call(
            body,
            out_shape=out_shape,
            grid=grid,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name=name,
        )(*operands)
