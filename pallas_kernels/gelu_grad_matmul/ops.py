"""Public op: the backward of an MLP's tanh GELU through its down-projection GEMM, with the bias gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._src import dispatch
from pallas_kernels.gelu_grad_matmul import kernel, reference

ROW_MULTIPLE = 128  # M must be a multiple of this (token capacities are), on either path
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16),)

SUPPORT = dispatch.OpSupport(
    "gelu_grad_matmul",
    kernel_dtypes=KERNEL_DTYPES,
)


def _check(dy, w, h, *, rows: bool = True) -> None:
    """A ValueError naming the argument, its shape and what is expected, for invalid inputs (with `rows`, also
    a row count that is not a multiple of 128)."""
    for name, x in (("dy", dy), ("w", w), ("h", h)):
        if jnp.ndim(x) != 2 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"gelu_grad_matmul: {name} must be a 2-D floating array, got shape {jnp.shape(x)} {jnp.result_type(x)}")
    (m, k), (n, k_w) = dy.shape, w.shape
    if k_w != k:
        raise ValueError(f"gelu_grad_matmul: w must be [N, K] with dy's K = {k} (the down-projection kernel, [hidden, out]), got shape {w.shape}")
    if h.shape != (m, n):
        raise ValueError(f"gelu_grad_matmul: h must be [M, N] = {(m, n)} (dy's rows, w's rows), got shape {h.shape}")
    if rows and (problem := _row_problem(dy)):
        raise ValueError(f"gelu_grad_matmul: {problem}")


def _check_config(config) -> kernel.TuningConfig:
    if config is not None and not isinstance(config, kernel.TuningConfig):
        raise ValueError(f"gelu_grad_matmul: config must be a kernel.TuningConfig or None, got {config!r}")
    return kernel.default_config() if config is None else config


def _row_problem(dy) -> str | None:
    m = dy.shape[0]
    return None if m % ROW_MULTIPLE == 0 else f"dy's rows M must be a multiple of {ROW_MULTIPLE}, got dy shape {dy.shape}"


def gelu_grad_matmul(
    dy: jax.Array,
    w: jax.Array,
    h: jax.Array,
    *,
    implementation: str | dispatch.Implementation | None = None,
    config: kernel.TuningConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(dh, dbias)`: the gradient of an MLP's pre-activation `h` and of its up-projection bias.

    For an MLP's `y = gelu(h, approximate=True) @ w` (+ its bias), with `w` the down-projection's
    flax kernel `[N, K]` (`[hidden, out]`), given `dy` (the cotangent of y), equivalent jnp::

        g = jnp.dot(dy, w.T, preferred_element_type=float32)      # [M, N], float32
        dh = (g * gelu_tanh_grad(h)).astype(dy.dtype)              # gelu_tanh_grad in float32
        dbias = dh.astype(float32).sum(axis=0)                     # [N]: the column sums of the ROUNDED dh

    where `gelu_tanh_grad` (`reference.gelu_tanh_grad`) is the derivative of `jax.nn.gelu(x,
    approximate=True)` (Hendrycks & Gimpel 2016). The "xla" path is that composition. The Pallas path
    (`kernel.py`, Mosaic GPU, Hopper sm_90a) is one persistent wgmma GEMM whose epilogue computes dh
    from the float32 accumulator and the h tile, stores it, and sums its columns per 64 rows on the
    tensor cores (float32 partials `[M // 64, N]`, summed here by XLA): the fusion cuBLASLt offers as
    its `CUBLASLT_EPILOGUE_DGELU_BGRAD` epilogue. Where XLA writes g to memory and reads it back with h
    in a second pass, the kernel reads dy, w and h once and writes dh once. Its float32 sums run in
    another order than XLA's: dh may differ from the reference by an ulp of bf16 where the product
    lands near a rounding boundary, and dbias by float32 rounding of the sums. NaN and Inf propagate
    as in the reference: a NaN in a row of dy makes that row of dh NaN, and every dbias column; a NaN
    in h at (i, j) makes dh[i, j] and dbias[j] NaN.

    Args:
      dy: floating `[M, K]`, M a multiple of 128 (0 allowed).
      w: floating `[N, K]`, the down-projection's kernel as flax stores it (`[hidden, out]`).
      h: floating `[M, N]`, the GELU's input (the up-projection's output, bias included).
      implementation: "xla" (the jnp reference), "pallas" or None (pallas on a Hopper GPU when the
        kernel takes the inputs: bfloat16 dy, w and h, N a multiple of `config.n_multiple` (128 by
        default), K of 64, M of `config.m_multiple` (128, 256 with `cluster="m"`); else the reference).
      config: the kernel's tiles (`kernel.TuningConfig`, default `kernel.default_config()`).

    Returns:
      `dh`, `[M, N]` in dy's dtype, and `dbias`, float32 `[N]`. M == 0 gives an empty dh and zero
      dbias without running anything.

    Raises:
      ValueError: an argument that is not a 2-D floating array, mismatched shapes, M not a multiple of
        128, a config that is not a `kernel.TuningConfig`, "pallas" asked for inputs the kernel does not
        take (dtype, N, K), or an unknown implementation name.
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside interpret mode).
    """
    _check(dy, w, h)
    config = _check_config(config)
    requested = dispatch.parse(implementation)
    choice = dispatch.choose(SUPPORT, requested, [dy.dtype, w.dtype, h.dtype])
    m, n = dy.shape[0], w.shape[0]
    if m == 0:
        return jnp.zeros((0, n), dy.dtype), jnp.zeros((n,), jnp.float32)
    if choice.implementation is dispatch.Implementation.PALLAS:
        problem = _kernel_problem(dy, w, h, config)
        if problem is None:
            dh, partials = kernel.gelu_grad_matmul(dy, w, h, config=config)
            return dh, partials.sum(axis=0)
        if requested is dispatch.Implementation.PALLAS:
            raise ValueError(f"gelu_grad_matmul: implementation='pallas': {problem}")
    return reference.gelu_grad_matmul(dy, w, h)


def runs_kernel(dy, w, h, *, implementation: str | dispatch.Implementation | None = None, config: kernel.TuningConfig | None = None) -> bool:
    """Whether `gelu_grad_matmul(dy, w, h, implementation=..., config=...)` runs the kernel (arrays or
    `jax.ShapeDtypeStruct`s): for a caller that keeps its own path where the op would run the reference.

    Under None, inputs the kernel does not take (dtype, widths, a row count that is not a multiple of 128)
    give False.

    Raises:
      ValueError: shapes that do not fit together, a config that is not a `kernel.TuningConfig`, or
        "pallas" asked for inputs the kernel does not take (naming why).
      ImplementationUnavailableError: "pallas" without a Hopper GPU (outside interpret mode).
    """
    _check(dy, w, h, rows=False)
    config = _check_config(config)
    requested = dispatch.parse(implementation)
    if dispatch.choose(SUPPORT, requested, [dy.dtype, w.dtype, h.dtype]).implementation is not dispatch.Implementation.PALLAS:
        return False
    problem = _row_problem(dy) or _kernel_problem(dy, w, h, config)
    if problem is not None and requested is dispatch.Implementation.PALLAS:
        raise ValueError(f"gelu_grad_matmul: implementation='pallas': {problem}")
    return problem is None and dy.shape[0] > 0


def _kernel_problem(dy, w, h, config: kernel.TuningConfig) -> str | None:
    """Why the kernel does not take these inputs, or None."""
    if any(x.dtype != jnp.bfloat16 for x in (dy, w, h)):
        return f"the kernel takes bfloat16 dy, w and h, got {dy.dtype}, {w.dtype}, {h.dtype}"
    (m, k), n = dy.shape, w.shape[0]
    if m % config.m_multiple:
        return f"dy's rows M must be a multiple of {config.m_multiple} for {config}, got dy shape {dy.shape}"
    if n % config.n_multiple:
        return f"w's rows N must be a multiple of {config.n_multiple} for {config}, got w shape {w.shape}"
    if k % config.k_multiple or not k:
        return f"K (dy's and w's columns) must be a positive multiple of {config.k_multiple}, got dy shape {dy.shape}"
    return None
