"""Block-scaled FP8 GEMM: the Mosaic GPU kernel (CPU interpret mode) against the dequantized float32 product.

The products of FP8 values and power-of-two scales are exact in float32, so kernel and reference differ only by
float32 summation order: bounded elementwise by `tolerances.dot_bound` (Higham's gamma_K |A||B|), whatever order
either takes; measured errors: benchmarks/tolerances.md.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from tolerances import BFLOAT16, check_within, dot_bound

from pallas_kernels import ImplementationUnavailableError
from pallas_kernels.mxfp8 import dequantize_mxfp8, kernel_matmul, mxfp8_matmul, quantize_mxfp8

RECIPES = {"mxfp8_32x32": ((32, 32), (32, 32)), "k128": ((1, 128), (128, 128))}


def _operands(m, n, k, recipe, seed):
    a_block, b_block = RECIPES[recipe]
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    # Row magnitudes spread over ~e^4 so that the block scales differ from block to block.
    a = jax.random.normal(k1, (m, k)) * jnp.exp(2.0 * jax.random.normal(k3, (m, 1)))
    b = jax.random.normal(k2, (n, k))
    return (*quantize_mxfp8(a, block=a_block), *quantize_mxfp8(b, block=b_block)), (a_block, b_block)


def _dequantized_product(a8, sa, b8, sb, blocks):
    af = np.asarray(dequantize_mxfp8(a8, sa, block=blocks[0]), np.float64)
    bf = np.asarray(dequantize_mxfp8(b8, sb, block=blocks[1]), np.float64)
    return af @ bf.T


def _af_bf(a8, sa, b8, sb, blocks):
    return (np.asarray(dequantize_mxfp8(x8, s, block=blk), np.float64) for x8, s, blk in ((a8, sa, blocks[0]), (b8, sb, blocks[1])))


def _pallas(*args, config=None, out_dtype=jnp.float32):
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return jax.jit(lambda *t: mxfp8_matmul(*t, out_dtype=out_dtype, implementation="pallas", config=config))(*args)


@pytest.mark.parametrize(
    "recipe, shape, config",
    [
        ("mxfp8_32x32", (100, 130, 70), kernel_matmul.TuningConfig(max_concurrent_steps=2, cluster=None)),
        ("mxfp8_32x32", (130, 96, 200), kernel_matmul.TuningConfig(max_concurrent_steps=3, k_blocks_per_step=2, cluster="m")),
        ("k128", (72, 140, 300), kernel_matmul.TuningConfig(max_concurrent_steps=2, cluster="n")),
        ("k128", (64, 128, 256), kernel_matmul.TuningConfig(max_concurrent_steps=2, k_blocks_per_step=2, cluster=None)),
    ],
)
def test_kernel_matches_dequantized_f32_product(recipe, shape, config):
    m, n, k = shape  # none a multiple of the 128 x 128 CTA tile
    (a8, sa, b8, sb), blocks = _operands(m, n, k, recipe, seed=sum(shape))
    ref = _dequantized_product(a8, sa, b8, sb, blocks)
    out = _pallas(a8, sa, b8, sb, config=config)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    af, bf = _af_bf(a8, sa, b8, sb, blocks)
    # FP8 x FP8 products and their power-of-two scales are exact in float32: only the K-term float32 sums round.
    check_within("kernel vs float64", out, ref, dot_bound(af, bf.T) / 2)


def test_xla_reference_path_and_bf16_output():
    (a8, sa, b8, sb), blocks = _operands(40, 50, 96, "mxfp8_32x32", seed=3)
    ref = _dequantized_product(a8, sa, b8, sb, blocks)
    out = mxfp8_matmul(a8, sa, b8, sb, implementation="xla")
    assert out.dtype == jnp.bfloat16
    af, bf = _af_bf(a8, sa, b8, sb, blocks)
    # The bf16 output's rounding (at most u of the float32 sum s, |s| <= |ref| + sums' error) on top of the float32
    # sums' error (`dot_bound`): a worst case, so with 2000 entries one nearly reaches it (measured 0.97 of it).
    sums = dot_bound(af, bf.T) / 2
    bound = BFLOAT16.u * (np.abs(ref) + sums) + sums
    check_within("xla, bf16 out", out, ref, bound)
    out_k = _pallas(a8, sa, b8, sb, out_dtype=jnp.bfloat16, config=kernel_matmul.TuningConfig(max_concurrent_steps=2, cluster=None))
    assert out_k.dtype == jnp.bfloat16
    check_within("kernel, bf16 out", out_k, ref, bound)


@pytest.mark.parametrize("recipe", ["mxfp8_32x32", "k128"])
def test_k_major_and_n_major_b_give_the_same_product(recipe):
    """`b [K, N]` with `b_contracting_dim=0` (square tiles: the transpose reuses the scales) is `b.T [N, K]`."""
    (a8, sa, b8, sb), blocks = _operands(96, 256, 128, recipe, seed=11)
    ref = _dequantized_product(a8, sa, b8, sb, blocks)
    config = kernel_matmul.TuningConfig(max_concurrent_steps=2, cluster=None)
    out_xla = mxfp8_matmul(a8, sa, b8.T, sb.T, b_contracting_dim=0, out_dtype=jnp.float32, implementation="xla")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        out_kernel = jax.jit(
            lambda *t: mxfp8_matmul(*t, b_contracting_dim=0, out_dtype=jnp.float32, implementation="pallas", config=config)
        )(a8, sa, b8.T, sb.T)
    af, bf = _af_bf(a8, sa, b8, sb, blocks)
    check_within("xla, b K-major", out_xla, ref, dot_bound(af, bf.T) / 2)  # exact products, float32 sums
    check_within("kernel, b K-major", out_kernel, ref, dot_bound(af, bf.T) / 2)
    with pytest.raises(ValueError, match="b_contracting_dim must be 0"):
        mxfp8_matmul(a8, sa, b8, sb, b_contracting_dim=2)
    with pytest.raises(ValueError, match="same K"):
        mxfp8_matmul(a8, sa, b8, sb, b_contracting_dim=0)


def test_nan_scale_poisons_only_its_rows():
    (a8, sa, b8, sb), _ = _operands(64, 64, 64, "mxfp8_32x32", seed=5)
    sa = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(sa, jnp.uint8).at[1, 0].set(255), jnp.float8_e8m0fnu)
    out = np.asarray(_pallas(a8, sa, b8, sb, config=kernel_matmul.TuningConfig(max_concurrent_steps=2, cluster=None)))
    assert np.all(np.isnan(out[32:])) and np.all(np.isfinite(out[:32]))


def test_empty_operands():
    (a8, sa, b8, sb), _ = _operands(0, 64, 64, "mxfp8_32x32", seed=6)
    z8, zs = quantize_mxfp8(jnp.zeros((32, 0)))
    w8, ws = quantize_mxfp8(jnp.zeros((16, 0)))
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        assert mxfp8_matmul(a8, sa, b8, sb, implementation="pallas").shape == (0, 64)
        out = mxfp8_matmul(z8, zs, w8, ws, implementation="pallas")
    assert out.shape == (32, 16) and not np.any(np.asarray(out, np.float32))


def test_bad_inputs_raise():
    (a8, sa, b8, sb), _ = _operands(64, 64, 64, "mxfp8_32x32", seed=7)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mxfp8_matmul(a8.astype(jnp.bfloat16), sa, b8, sb)
    with pytest.raises(ValueError, match="same K"):
        mxfp8_matmul(a8, sa, b8[:, :32], sb)
    with pytest.raises(ValueError, match="e8m0"):
        mxfp8_matmul(a8, sa.astype(jnp.float32), b8, sb)
    with pytest.raises(ValueError, match="row blocks of b_scales"):
        b1, s1 = quantize_mxfp8(jnp.ones((64, 64)), block=(1, 32))
        mxfp8_matmul(a8, sa, b1, s1)
    with pytest.raises(ValueError, match="K blocks"):
        b2, s2 = quantize_mxfp8(jnp.ones((64, 64)), block=(32, 64))
        mxfp8_matmul(a8, sa, b2, s2)
    with pytest.raises(ValueError, match="implementation"):
        mxfp8_matmul(a8, sa, b8, sb, implementation="triton")
    with pytest.raises(ValueError, match="mxfp8_matmul has no cuDNN implementation"):
        mxfp8_matmul(a8, sa, b8, sb, implementation="cudnn")
    with pytest.raises(ImplementationUnavailableError, match="no Hopper GPU: found cpu"):
        mxfp8_matmul(a8, sa, b8, sb, implementation="pallas")
