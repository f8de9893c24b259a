"""The GELU-backward GEMM (`pallas_kernels.gelu_grad_matmul`): the Mosaic GPU kernel in the Pallas interpreter
against the jnp reference, on fresh random inputs each run (the seed is in every message); NaN confinement;
the op's errors; and the kernel's lowering for sm_90a (Mosaic GPU, CUDA) on this CPU. The opt-in two-CTAs-per-SM
variant (`TuningConfig(ctas_per_sm=2)`) is checked alike, its ring under the interpreter's race detector, and its
module for a grid of 2 x 132 one-warpgroup CTAs within half an SM's shared memory.

Bounds (tests/support/gelu_grad_matmul_bounds.py, shared with benchmarks/gelu_grad_matmul_bench.py): dh within
the float32 summation-order error of g (Higham's gamma_K |dy| |w|^T, the bf16 products being exact) times the
GELU derivative, plus one bf16 ulp where a rounding boundary falls in between, and the count of differing
elements within what that error explains; dbias within 2 gamma_(M+8) of the float64 column sums of the
kernel's own rounded dh.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gelu_grad_matmul_bounds import dbias_check, dh_check
from jax.experimental.pallas import mosaic_gpu as plgpu
from tolerances import check

from pallas_kernels import ImplementationUnavailableError
from pallas_kernels.gelu_grad_matmul import TuningConfig, gelu_grad_matmul, gelu_tanh_grad, kernel, reference


def _seed() -> int:
    return int(np.random.default_rng().integers(1 << 31))


def _inputs(m, n, k, seed):
    """bf16 `dy [M, K]` (unit normal), `w [N, K]` (std 1/sqrt(K), as a trained layer), `h [M, N]` (std 2: the GELU's
    curved range, its derivative's zero near -0.75, and a few saturated values at +-12)."""
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal((m, k))
    w = rng.standard_normal((n, k)) / np.sqrt(k)
    h = 2.0 * rng.standard_normal((m, n))
    h[rng.random((m, n)) < 0.01] = 12.0 * rng.choice([-1.0, 1.0])
    return (jnp.asarray(x, jnp.bfloat16) for x in (dy, w, h))


def _pallas(dy, w, h, config=None, params=None):
    with plgpu.force_gpu_interpret_mode(params or plgpu.InterpretGPUParams()):
        return jax.block_until_ready(jax.jit(lambda *a: gelu_grad_matmul(*a, implementation="pallas", config=config))(dy, w, h))


# The opt-in two-CTAs-per-SM variants (kernel._two_cta_gelu_grad_matmul): one warpgroup per CTA, a TMA ring across tiles.
TWO_CTAS = kernel.two_cta_config()
TWO_CTAS_N64 = TuningConfig(tile_n=64, max_concurrent_steps=3, ctas_per_sm=2, approx_math=True)


def _assert_matches_reference(got, dy, w, h, what, approx_math=False):
    dh, dbias = got
    dh_ref, dbias_ref = reference.gelu_grad_matmul(dy, w, h)
    assert dh.shape == dh_ref.shape and dh.dtype == jnp.bfloat16 and dbias.shape == dbias_ref.shape and dbias.dtype == jnp.float32
    r = dh_check(dh, dh_ref, dy, w, h, approx_math=approx_math)
    check(f"{what}: dh vs reference", r["max_fraction"], 1.0)
    check(f"{what}: elements of dh that differ from the reference", r["differing"], r["allowed_differing"])
    d = dbias_check(dbias, dh, dbias_ref, dh_ref)
    check(f"{what}: dbias vs the float64 column sums of the kernel's dh", d["self_fraction"], 1.0)
    check(f"{what}: dbias vs reference", d["ref_fraction"], 1.0)


def test_gelu_tanh_grad_is_the_derivative_of_jax_gelu():
    x = jnp.concatenate([jnp.linspace(-10.0, 10.0, 4001), jnp.array([0.0, -0.75, 30.0, -30.0])])
    want = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(x)
    got = gelu_tanh_grad(x)
    assert got.dtype == jnp.float32
    # Both are float32 evaluations of one function in different orders; in the negative tail (x < -3) the value is
    # a difference of terms near 1e-4 (1 + t and 1 - t^2 cancel), where they differ by up to ~3e-6 absolute.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # bf16 inputs are widened first
    np.testing.assert_array_equal(np.asarray(gelu_tanh_grad(x.astype(jnp.bfloat16))), np.asarray(gelu_tanh_grad(x.astype(jnp.bfloat16).astype(jnp.float32))))


@pytest.mark.parametrize(
    "shape, config",
    [
        ((128, 128, 64), None),  # one tile, one K step
        ((384, 384, 192), TuningConfig(max_concurrent_steps=2)),  # 9 tiles on the interpreter's 4 SMs, 3 K steps
        ((384, 256, 320), TuningConfig(tile_n=256, max_concurrent_steps=3, separate_h_buffer=False, delay_release=1)),
        ((512, 256, 128), TuningConfig(cluster="m", grid_tile_width=1)),
        ((256, 512, 192), TuningConfig(cluster="n", max_concurrent_steps=2, approx_math=True)),
        # 20 tiles on the interpreter's 4 x 2 CTAs (2 or 3 each), 5 K steps through 2 slots: the ring runs across tiles
        ((1280, 256, 320), TWO_CTAS),
        # 3 K steps, 3 slots: each refill is the next tile's; own h buffer; tanh.approx
        ((640, 256, 192), TWO_CTAS_N64),
        # 1 K step, 2 slots: the prologue already loads the CTA's second tile
        ((1280, 128, 64), TWO_CTAS),
    ],
    ids=["128x128x64", "384x384x192", "tile_n256_shared_h", "cluster_m", "cluster_n_approx", "two_ctas",
         "two_ctas_n64_approx", "two_ctas_one_k_step"],
)
def test_kernel_matches_reference(shape, config):
    seed = _seed()
    dy, w, h = _inputs(*shape, seed)
    _assert_matches_reference(_pallas(dy, w, h, config), dy, w, h, f"{shape} {config} seed {seed}", approx_math=bool(config and config.approx_math))


@pytest.mark.parametrize("config", [None, TWO_CTAS], ids=["default", "two_ctas"])
def test_nan_stays_in_its_rows_and_columns(config):
    """A NaN in rows of dy makes exactly those rows of dh NaN (and every dbias column); a NaN in h at (i, j) makes
    dh[i, j] and dbias[j] NaN; every other value is bit for bit the clean run's."""
    seed = _seed()
    m, n, k = 384, 256, 128
    dy, w, h = _inputs(m, n, k, seed)
    clean_dh, clean_db = _pallas(dy, w, h, config)
    rows = np.array([0, 130, 383])
    dirty_dh, dirty_db = _pallas(dy.at[rows, np.array([5, 0, 127])].set(jnp.nan), w, h, config)
    bad = np.zeros((m, n), bool)
    bad[rows] = True
    dirty_dh, clean = np.asarray(dirty_dh, np.float32), np.asarray(clean_dh, np.float32)
    assert np.isnan(dirty_dh[bad]).all(), f"seed {seed}: a NaN row of dy left non-NaN values in its dh row"
    np.testing.assert_array_equal(dirty_dh[~bad], clean[~bad], err_msg=f"seed {seed}")
    assert np.isnan(np.asarray(dirty_db)).all(), f"seed {seed}: dbias hid a NaN row"

    cells = (np.array([1, 64, 200, 383]), np.array([3, 3, 129, 255]))  # two in one column, rows in three tiles
    h_dh, h_db = _pallas(dy, w, h.at[cells].set(jnp.nan), config)
    bad = np.zeros((m, n), bool)
    bad[cells] = True
    h_dh = np.asarray(h_dh, np.float32)
    assert np.isnan(h_dh[bad]).all(), f"seed {seed}: a NaN in h was hidden in dh"
    np.testing.assert_array_equal(h_dh[~bad], clean[~bad], err_msg=f"seed {seed}")
    bad_cols = np.zeros(n, bool)
    bad_cols[cells[1]] = True
    h_db, clean_db = np.asarray(h_db), np.asarray(clean_db)
    assert np.isnan(h_db[bad_cols]).all(), f"seed {seed}: dbias hid a NaN of h"
    np.testing.assert_array_equal(h_db[~bad_cols], clean_db[~bad_cols], err_msg=f"seed {seed}")


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_no_rows(implementation):
    dy, w, h = jnp.zeros((0, 128), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16), jnp.zeros((0, 256), jnp.bfloat16)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        dh, dbias = gelu_grad_matmul(dy, w, h, implementation=implementation)
    assert dh.shape == (0, 256) and dh.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dbias), np.zeros(256, np.float32))


def test_xla_path_is_the_reference_and_the_default_here():
    dy, w, h = _inputs(128, 128, 64, _seed())
    want = reference.gelu_grad_matmul(dy, w, h)
    for impl in (None, "xla"):  # no Hopper GPU here: None runs the reference
        got = gelu_grad_matmul(dy, w, h, implementation=impl)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # float32 inputs run the reference too, dh in dy's dtype
    dh, _ = gelu_grad_matmul(dy.astype(jnp.float32), w, h)
    assert dh.dtype == jnp.float32


def test_errors():
    dy, w, h = jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)
    cases = [
        ((dy[0], w, h), {}, r"dy must be a 2-D floating array, got shape \(64,\)"),
        ((dy.astype(jnp.int32), w, h), {}, "dy must be a 2-D floating array"),
        ((dy, w[:, :32], h), {}, r"w must be \[N, K\] with dy's K = 64.*\(256, 32\)"),
        ((dy, w, h[:, :128]), {}, r"h must be \[M, N\] = \(128, 256\).*\(128, 128\)"),
        ((dy[:100], w, h[:100]), {}, r"M must be a multiple of 128, got dy shape \(100, 64\)"),
        ((dy, w, h), {"implementation": "bogus"}, "unknown implementation 'bogus'"),
        ((dy, w, h), {"config": {"tile_n": 128}}, "config must be a kernel.TuningConfig"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            gelu_grad_matmul(*args, **kwargs)
    with pytest.raises(ImplementationUnavailableError):
        gelu_grad_matmul(dy, w, h, implementation="pallas")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        for args, kwargs, match in [
            ((dy.astype(jnp.float32), w, h), {}, "the kernel takes bfloat16 dy, w and h, got float32"),
            ((dy, w[:192], h[:, :192]), {}, r"N must be a multiple of 128.*\(192, 64\)"),
            ((dy[:, :32], w[:, :32], h), {}, r"K .* multiple of 64, got dy shape \(128, 32\)"),
            ((dy, w, h), {"config": TuningConfig(cluster="m")}, r"M must be a multiple of 256.*\(128, 64\)"),
        ]:
            with pytest.raises(ValueError, match=match):
                gelu_grad_matmul(*args, implementation="pallas", **kwargs)
    for kwargs, match in [
        ({"tile_n": 96}, "tile_n must be a multiple of 64"),
        ({"tile_n": 512}, "tile_n must be a multiple of 64"),
        ({"max_concurrent_steps": 1}, "max_concurrent_steps"),
        ({"cluster": "k"}, "cluster must be"),
        ({"delay_release": 2}, "delay_release"),
        ({"grid_tile_width": 0}, "grid_tile_width"),
        ({"tile_n": 256, "max_concurrent_steps": 4}, "shared memory"),
        ({"ctas_per_sm": 3}, "ctas_per_sm must be 1 or 2"),
        ({"ctas_per_sm": True}, "ctas_per_sm must be 1 or 2"),
        ({"ctas_per_sm": 2, "max_concurrent_steps": 2, "separate_h_buffer": False, "cluster": "m"}, "without clusters"),
        ({"ctas_per_sm": 2, "max_concurrent_steps": 2, "separate_h_buffer": False, "delay_release": 1}, "delay_release must be 0"),
        ({"ctas_per_sm": 2}, "that let two CTAs share a Hopper SM"),  # 4 slots and an h buffer: 196 KiB
        ({"ctas_per_sm": 2, "max_concurrent_steps": 3, "separate_h_buffer": False}, "that let two CTAs share"),
    ]:
        with pytest.raises(ValueError, match=match):
            TuningConfig(**kwargs)


@pytest.mark.parametrize(
    "config",
    [kernel.default_config(), TuningConfig(tile_n=256, max_concurrent_steps=3, separate_h_buffer=False, delay_release=1),
     TuningConfig(cluster="n", approx_math=True), TuningConfig(cluster="m"), TWO_CTAS, TWO_CTAS_N64],
    ids=["default", "tile_n256", "cluster_n", "cluster_m", "two_ctas", "two_ctas_n64"],
)
def test_lowers_for_sm90a(load_script, config):
    """The kernel lowers to a Mosaic GPU module for CUDA (layout inference, wgmma operand transforms, TMA
    shapes), on this CPU, as `scripts/kernel_fingerprints.py` lowers the other kernels; and a grid of 132 SMs."""
    fingerprints = load_script("kernel_fingerprints")
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(1024, 256), (1024, 256), (1024, 1024)]]
    with fingerprints._capturing_kernels() as texts:
        lowered = jax.jit(lambda *a: gelu_grad_matmul(*a, implementation="pallas", config=config)).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(texts) == 1, f"{len(texts)} Mosaic GPU kernels"
    program = lowered.as_text()
    assert "mosaic_gpu" in program


@pytest.mark.parametrize("config", [TWO_CTAS, TWO_CTAS_N64], ids=["two_ctas", "two_ctas_n64"])
def test_two_cta_variant_lowers_for_two_ctas_per_sm(load_script, config):
    """The two-CTA variant's CUDA module: a persistent grid of 2 x 132 CTAs of one warpgroup (128 threads), and
    dynamic shared memory (Mosaic GPU's scratch and barriers included) within `kernel.TWO_CTA_SMEM_BYTES`, so
    that two CTAs fit an SM's 228 KiB. Registers (at most 255 a thread for two 128-thread CTAs) are ptxas's,
    not checked here (255 and 230 with jax 0.11.2's ptxas for sm_90a)."""
    fingerprints = load_script("kernel_fingerprints")
    m = 128 * 40  # 40 row tiles x 8 column tiles (N = 1024 at tile_n 128): more tiles than 264 CTAs
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(m, 256), (1024, 256), (m, 1024)]]
    with fingerprints._capturing_kernels() as texts:
        jax.jit(lambda *a: gelu_grad_matmul(*a, implementation="pallas", config=config)).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(texts) == 1, f"{len(texts)} Mosaic GPU kernels"
    launch = re.search(r"gpu\.launch .*? in \(%\w+ = %c(\d+), .*? threads\(.*? in \(%\w+ = %c(\d+), .*?dynamic_shared_memory_size %c(\d+)_i32", texts[0])
    assert launch, "no gpu.launch in the kernel's module"
    grid, threads, smem = map(int, launch.groups())
    assert (grid, threads) == (2 * 132, 128)
    assert config.smem_bytes < smem <= config.smem_bytes + kernel.SMEM_OVERHEAD_BYTES
    assert smem <= kernel.TWO_CTA_SMEM_BYTES, f"{smem} bytes of shared memory: two CTAs do not fit an SM"


@pytest.mark.parametrize("shape, config", [((1280, 256, 320), TWO_CTAS), ((640, 256, 192), TWO_CTAS_N64)],
                         ids=["two_ctas", "two_ctas_n64"])
def test_two_cta_ring_has_no_races(capfd, shape, config):
    """Under the interpreter's happens-before race detector, the two-CTA variant's ring across tiles: each slot's TMA
    load, the wgmma that reads it, and the refill with the step S later (after `wgmma_wait(1)`); the h tile's load
    into the dh staging buffer after the last tile's stores have read it (2 slots, shared h) or into its own
    buffer (3 slots); barrier phases exact. The interpreter runs wgmmas synchronously, so a refill issued before the
    wgmma of its slot has finished on the GPU is not caught here (one issued before the wgmma is)."""
    seed = _seed()
    dy, w, h = _inputs(*shape, seed)
    got = _pallas(dy, w, h, config, params=plgpu.InterpretGPUParams(detect_races=True))
    assert "RACE DETECTED" not in capfd.readouterr().out
    _assert_matches_reference(got, dy, w, h, f"{shape} {config} seed {seed}", approx_math=config.approx_math)
