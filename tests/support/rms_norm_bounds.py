"""Error bounds of `pallas_kernels.rms_norm`'s kernels against its jnp reference, shared by
tests/pallas_kernels/test_rms_norm.py (the interpreter on the CPU) and benchmarks/rms_norm_bench.py
(the GPU).

Each output and gradient may differ by one ulp of its dtype plus twice Higham's gamma of the sums the
two paths order differently (the d-term mean square and `mean(gw * xhat)`; the N-term scale gradient)
times the magnitude of those sums' terms. The reference (flax's bits) rounds the gradients of its two
float32 widenings of a bf16 x to bf16 before summing them, and, with a passed-through input's cotangent
`dx_in`, the norm's `dx` before adding it; the kernel sums in float32 and rounds once: an ulp more for
each, at the magnitude of the terms. The scale's gradient is rounded to the output dtype in both (the op
casts the scale to it, as flax).
"""

from __future__ import annotations

import numpy as np
from tolerances import error_and_fraction, format_of, sum_worst, ulp_at


def _magnitudes(x, scale, dy, eps):
    """Float64 magnitudes `[rows, d]`: of y's terms, of dx's terms and of the scale gradient's terms."""
    x, w, dy = np.asarray(x, np.float64), np.asarray(scale, np.float64)[None, :], np.asarray(dy, np.float64)
    inv = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat, gw = x * inv, dy * w
    dx_mag = inv * (np.abs(gw) + np.abs(xhat) * np.mean(np.abs(gw * xhat), axis=-1, keepdims=True))
    return np.abs(xhat * w), dx_mag, np.abs(dy * xhat)


def bound_fractions(got, want, inputs, cotangents, eps: float = 1e-6, chunk: int = 16384, rows_total: int | None = None) -> dict[str, tuple[float, float]]:
    """`{name: (max |got - want|, the largest |got - want| / bound)}` of y, dx and dscale; a fraction above 1 (or NaN)
    breaks the bound.

    `got`, `want`: `(y, (dx, dscale))` with y and dx `[N, d]`; `inputs`: `(x [N, d], scale [d])`; `cotangents`:
    `(dy, dx_in)` with `dx_in` None when the input was not passed through. Rows are taken `chunk` at a time.
    `rows_total`: when every array but dscale holds a subsample of N of the rows dscale sums over, their number:
    dscale's bound then takes the subsample's sum of |terms| times `rows_total / N` (an estimate of the whole
    sum, not a bound of it) and the gamma of `rows_total` terms.
    """
    y, (dx, dscale) = np.asarray(got[0]), (np.asarray(a) for a in got[1])
    ry, (rdx, rdscale) = np.asarray(want[0]), (np.asarray(a) for a in want[1])
    x, scale = (np.asarray(a) for a in inputs)
    dy, dx_in = cotangents
    n, d = x.shape
    fmt_out = format_of(y.dtype)
    fmt_in = min(fmt_out, format_of(x.dtype), key=lambda f: f.mantissa_bits)  # the coarser: x is rounded to a narrower output dtype first
    rows = 2 * sum_worst(d)
    fractions = {"y": (0.0, 0.0), "dx": (0.0, 0.0)}
    ds_mag = np.zeros(d)
    for r in (slice(start, start + chunk) for start in range(0, n, chunk)):
        y_mag, dx_mag, ds_terms = _magnitudes(x[r], scale, np.asarray(dy[r]), eps)
        ds_mag += ds_terms.sum(0)
        # + an ulp at the terms' magnitude: a reduced-precision reference rounds the gradients of its two float32
        # widenings of x (the statistic's, the normalisation's) to x's dtype before summing them, as flax does.
        dx_bound = ulp_at(fmt_in, dx[r], rdx[r]) + ulp_at(fmt_in, dx_mag, 0.0) + rows * dx_mag
        if dx_in is not None:  # the reference's sums of the three bf16 parts pass through at most |dx| terms + |dx_in|
            dx_bound = dx_bound + ulp_at(fmt_in, dx_mag + np.abs(np.asarray(dx_in[r], np.float64)), 0.0)
        for name, err in (
            ("y", error_and_fraction(y[r], ry[r], ulp_at(fmt_out, y[r], ry[r]) + rows * y_mag)),
            ("dx", error_and_fraction(dx[r], rdx[r], dx_bound)),
        ):
            fractions[name] = tuple(float(v) for v in np.maximum(fractions[name], err))  # NaN stays
    total = rows_total or n
    ds_mag *= total / max(n, 1)
    # The op casts the scale to the output dtype (flax's promote_dtype), so its gradient is rounded to it on the way back.
    fractions["dscale"] = error_and_fraction(dscale, rdscale, (2 * sum_worst(max(total, 1)) + rows) * ds_mag + ulp_at(fmt_out, dscale, rdscale))
    return fractions
