"""Error bounds of `pallas_kernels.gelu_grad_matmul`'s kernel against its jnp reference, shared by
tests/pallas_kernels/test_gelu_grad_matmul.py (the interpreter on the CPU) and
benchmarks/gelu_grad_matmul_bench.py (the GPU).

dh. Both paths compute `p = g * gelu_tanh_grad(h)` in float32 and round p to bf16. Their g are
float32 sums of the same exact bf16 products in different orders: within twice Higham's
gamma_K |dy| |w|^T of each other (`tolerances.dot_bound`), doubled (`ACCUMULATION`) because on a
GPU both run on tensor cores, whose float32 accumulation may truncate rather than round (an
error of up to 2 u per addition instead of u). Their GELU derivative is the same float32 formula,
but its tanh may come from another implementation (XLA's, libdevice's, or `tanh.approx.f32`
with the kernel's `approx_math`): an absolute error `tanh_err` on t moves the derivative by at
most `tanh_err * |0.5 - x t du|` (its partial derivative in t), and the formula's ~10 float32
roundings (contracted differently by two compilers) by 16 u_f32 of its terms' magnitudes. With
the product's own rounding (u_f32 on each side), the pre-rounding values differ by at most

    delta = ACCUMULATION * dot_bound * |grad| + |g| * grad_err + 2 u_f32 |g grad|.

Rounding to nearest moves each by at most half a bf16 ulp, but two values delta apart may round
to neighbouring grid points however small delta is: the bound is `delta + ulp_bf16(|p|)`. That
alone would let every element differ by an ulp (a kernel that truncated instead of rounding
would pass it), so the count of elements that differ at all is bounded too: a value rounds
differently only when a rounding boundary lies within delta of it, with probability at most
`2 delta / ulp` for a value placed uniformly within its ulp; the count must stay within the sum of
those probabilities plus four standard deviations (a Poisson tail) plus one.

dbias. The kernel sums the float32 values of ITS OWN rounded dh: per 64 rows on the tensor cores
(bf16 products by one, float32 accumulation: Hopper's accumulation may truncate rather than
round, so 2 u per addition), then the M / 64 partials in XLA. Against the float64 column sums of
its dh that is within `2 gamma_(M + 8) sum |dh|` (the 8 copies of each column sum averaged
included). Against the reference's dbias (the sums of another dh) it is also within
`sum |dh_k - dh_r|` plus both paths' sum errors.
"""

from __future__ import annotations

import math

import numpy as np
from tolerances import BFLOAT16, FLOAT32, sum_worst, ulp_at

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_ERR_ACCURATE = 2.0**-21  # a few float32 ulps of |t| <= 1 (XLA's rational tanh, libdevice's tanhf)
TANH_ERR_APPROX = 2.0**-10.9  # tanh.approx.f32: max relative error 2^-10.987 (PTX ISA), |t| <= 1
ACCUMULATION = 2  # tensor-core float32 accumulation: up to 2 u per addition (truncation), not u


def _grad_and_error(h: np.ndarray, tanh_err: float) -> tuple[np.ndarray, np.ndarray]:
    """`(|gelu_tanh_grad(h)|, bound on its difference between two float32 evaluations)`, float64."""
    x = np.asarray(h, np.float64)
    du = SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    t = np.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3))
    first, second = 0.5 * (1.0 + t), 0.5 * x * (1.0 - t * t) * du
    grad = first + second
    err = tanh_err * np.abs(0.5 - x * t * du) + 16 * FLOAT32.u * (np.abs(first) + np.abs(second) + np.abs(x * t * du))
    return np.abs(grad), err


def dh_check(dh, dh_ref, dy, w, h, *, approx_math: bool = False) -> dict:
    """`{max_err, max_fraction, differing, allowed_differing}` of the kernel's dh against the reference's.

    `max_fraction` is the largest `|dh - dh_ref| / bound` (above 1 breaks the bound; NaN where one
    is NaN and the other not); `differing` counts elements that differ, against `allowed_differing`.
    `dy`, `w`, `h`: the rows of dh given (a subsample of rows is fine: pass those rows of dy and h).
    """
    dh64, ref64 = np.asarray(dh, np.float64), np.asarray(dh_ref, np.float64)
    dy64, w64 = np.asarray(dy, np.float64), np.asarray(w, np.float64)
    g_abs = np.abs(dy64) @ np.abs(w64).T
    g = dy64 @ w64.T
    grad, grad_err = _grad_and_error(h, TANH_ERR_APPROX if approx_math else TANH_ERR_ACCURATE)
    delta = ACCUMULATION * 2 * sum_worst(dy64.shape[-1]) * g_abs * grad + np.abs(g) * grad_err + 2 * FLOAT32.u * np.abs(g) * grad
    p = np.abs(g) * grad
    ulp = ulp_at(BFLOAT16, p + delta, ref64)
    bound = delta + ulp
    diff = np.abs(dh64 - ref64)
    same_nan = np.isnan(dh64) & np.isnan(ref64)
    diff = np.where(same_nan, 0.0, diff)
    fraction = float(np.max(np.where(np.isnan(diff), np.inf, diff / bound), initial=0.0))
    expected = float(np.minimum(1.0, 2 * delta / ulp_at(BFLOAT16, p, p)).sum())
    return {
        "max_err": float(np.nanmax(diff, initial=0.0)),
        "max_fraction": fraction,
        "differing": int(np.count_nonzero(diff)),
        "allowed_differing": expected + 4 * math.sqrt(expected) + 1,
    }


def dbias_check(dbias, dh, dbias_ref=None, dh_ref=None, chunk: int = 16384) -> dict:
    """`{self_fraction, ref_fraction}`: the kernel's dbias against the float64 column sums of its own dh,
    and (with `dbias_ref`, `dh_ref`) against the reference's, each as the largest |error| / bound (above 1
    breaks it; NaN columns must be NaN in both and count as 0). `dh` `[M, N]` whole (all rows).
    """
    m, n = dh.shape
    sums, mags, ref_mags, diffs = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    for start in range(0, m, chunk):
        rows = np.asarray(dh[start : start + chunk], np.float64)
        sums += rows.sum(0)
        mags += np.abs(rows).sum(0)
        if dh_ref is not None:
            ref_rows = np.asarray(dh_ref[start : start + chunk], np.float64)
            ref_mags += np.abs(ref_rows).sum(0)
            diffs += np.abs(rows - ref_rows).sum(0)
    db = np.asarray(dbias, np.float64)
    gamma = 2 * sum_worst(m + 8)

    def fraction(err, bound, nan_ok):
        err = np.where(nan_ok, 0.0, err)
        return float(np.max(np.where(np.isnan(err), np.inf, err / np.maximum(bound, np.finfo(np.float64).tiny)), initial=0.0))

    out = {"self_fraction": fraction(np.abs(db - sums), gamma * mags, np.isnan(db) & np.isnan(sums))}
    if dbias_ref is not None:
        ref = np.asarray(dbias_ref, np.float64)
        bound = diffs + gamma * mags + sum_worst(m) * ref_mags
        out["ref_fraction"] = fraction(np.abs(db - ref), bound, np.isnan(db) & np.isnan(ref))
    return out
