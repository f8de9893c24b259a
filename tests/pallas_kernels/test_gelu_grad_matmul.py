"""The GELU-backward GEMM (`pallas_kernels.gelu_grad_matmul`): the Mosaic GPU kernel in the Pallas interpreter
against the jnp reference, on fresh random inputs each run (the seed is in every message); NaN confinement;
the op's errors; and the kernel's lowering for sm_90a (Mosaic GPU, CUDA) on this CPU.

Bounds (tests/support/gelu_grad_matmul_bounds.py, shared with benchmarks/gelu_grad_matmul_bench.py): dh within
the float32 summation-order error of g (Higham's gamma_K |dy| |w|^T, the bf16 products being exact) times the
GELU derivative, plus one bf16 ulp where a rounding boundary falls in between, and the count of differing
elements within what that error explains; dbias within 2 gamma_(M+8) of the float64 column sums of the
kernel's own rounded dh.
"""


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
    ],
    ids=["128x128x64", "384x384x192", "tile_n256_shared_h", "cluster_m", "cluster_n_approx"],
)
def test_kernel_matches_reference(shape, config):
    seed = _seed()
    dy, w, h = _inputs(*shape, seed)
    _assert_matches_reference(_pallas(dy, w, h, config), dy, w, h, f"{shape} {config} seed {seed}", approx_math=bool(config and config.approx_math))


def test_nan_stays_in_its_rows_and_columns():
    """A NaN in rows of dy makes exactly those rows of dh NaN (and every dbias column); a NaN in h at (i, j) makes
    dh[i, j] and dbias[j] NaN; every other value is bit for bit the clean run's."""
    seed = _seed()
    m, n, k = 384, 256, 128
    dy, w, h = _inputs(m, n, k, seed)
    clean_dh, clean_db = _pallas(dy, w, h)
    rows = np.array([0, 130, 383])
    dirty_dh, dirty_db = _pallas(dy.at[rows, np.array([5, 0, 127])].set(jnp.nan), w, h)
    bad = np.zeros((m, n), bool)
    bad[rows] = True
    dirty_dh, clean = np.asarray(dirty_dh, np.float32), np.asarray(clean_dh, np.float32)
    assert np.isnan(dirty_dh[bad]).all(), f"seed {seed}: a NaN row of dy left non-NaN values in its dh row"
    np.testing.assert_array_equal(dirty_dh[~bad], clean[~bad], err_msg=f"seed {seed}")
    assert np.isnan(np.asarray(dirty_db)).all(), f"seed {seed}: dbias hid a NaN row"

    cells = (np.array([1, 64, 200, 383]), np.array([3, 3, 129, 255]))  # two in one column, rows in three tiles
    h_dh, h_db = _pallas(dy, w, h.at[cells].set(jnp.nan))
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
    ]:
        with pytest.raises(ValueError, match=match):
            TuningConfig(**kwargs)


@pytest.mark.parametrize(
    "config",
    [kernel.default_config(), TuningConfig(tile_n=256, max_concurrent_steps=3, separate_h_buffer=False, delay_release=1),
     TuningConfig(cluster="n", approx_math=True), TuningConfig(cluster="m")],
    ids=["default", "tile_n256", "cluster_n", "cluster_m"],
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
