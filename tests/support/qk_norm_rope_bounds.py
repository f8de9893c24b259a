"""Error bounds of `pallas_kernels.qk_norm_rope`'s kernels against its jnp reference, shared by
tests/pallas_kernels/test_qk_norm_rope.py (the interpreter on the CPU) and
benchmarks/qk_norm_rope_bench.py (the GPU).

Each output and gradient may differ by one ulp of its dtype plus twice Higham's gamma of the sums the
two paths order differently (the D-term mean squares and `mean(gw * xhat)`; the T*H-term scale
gradients) times the magnitude of those sums' terms; v and v's gradient are copies (bound 0).
"""

from __future__ import annotations

import numpy as np
from tolerances import FLOAT32, error_and_fraction, format_of, sum_worst, ulp_at


def _magnitudes(qkv, scales, cos, sin, dq, dk, eps):
    """Float64 sums of |terms| the two paths round differently: of each output, of each qkv gradient (q, k), and
    of each scale gradient's terms `[2, T, H, D]`."""
    x = np.asarray(qkv[:, :2], np.float64)  # [T, 2, H, D]
    w = np.stack([np.asarray(s, np.float64) for s in scales])[None, :, None, :]
    c, s = (np.asarray(a, np.float64).reshape(len(x), 1, 1, -1) for a in (cos, sin))
    inv = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    y1, y2 = np.split(np.abs(x * inv * w), 2, axis=-1)
    out = np.concatenate([y1 * np.abs(c) + y2 * np.abs(s), y2 * np.abs(c) + y1 * np.abs(s)], axis=-1)
    dy1, dy2 = np.split(np.abs(np.stack([np.asarray(dq, np.float64), np.asarray(dk, np.float64)], axis=1)), 2, axis=-1)
    g = np.concatenate([dy1 * np.abs(c) + dy2 * np.abs(s), dy2 * np.abs(c) + dy1 * np.abs(s)], axis=-1)  # |RoPE^T dy| terms
    xhat = np.abs(x * inv)
    dx = inv * (g * np.abs(w) + xhat * np.mean(g * np.abs(w) * xhat, axis=-1, keepdims=True))
    return out, dx, np.moveaxis(g * xhat, 1, 0)


def bound_fractions(
    got, want, inputs, cotangents, eps: float = 1e-6, chunk: int = 16384, tokens_total: int | None = None
) -> dict[str, tuple[float, float]]:
    """`{name: (max |got - want|, the largest |got - want| / bound)}` of q, k, v, the qkv gradient's slots (dq, dk,
    dv) and the scale gradients (dq_scale, dk_scale); a fraction above 1 (or NaN) breaks the bound.

    `got`, `want`: `((q, k, v), (dqkv, dq_scale, dk_scale))` with q, k, v `[T, H, D]` and dqkv `[T, 3, H, D]`;
    `inputs`: `(qkv [T, 3, H, D], q_scale, k_scale, cos, sin)` (tables `[T, D/2]` or `[T, 1, D/2]`);
    `cotangents`: `(dq, dk, dv)`. Tokens are taken `chunk` at a time (float64 temporaries of `chunk * 2 * H * D`).
    `tokens_total`: when every array but the scale gradients holds a subsample of T of the tokens the scale
    gradients sum over, their number: the scale gradients' bound then takes the subsample's sum of |terms|
    times `tokens_total / T` (an estimate of the whole sum, not a bound of it) and the gamma of `tokens_total * H` terms.
    """
    (q, k, v), (dqkv, dqs, dks) = (np.asarray(a) for a in got[0]), (np.asarray(a) for a in got[1])
    (rq, rk, rv), (rdqkv, rdqs, rdks) = (np.asarray(a) for a in want[0]), (np.asarray(a) for a in want[1])
    qkv, q_scale, k_scale, cos, sin = (np.asarray(a) for a in inputs)
    dq, dk = (np.asarray(a) for a in cotangents[:2])
    t, _, h, d = qkv.shape
    fmt_out, fmt_in = format_of(q.dtype), format_of(qkv.dtype)
    rows = 2 * sum_worst(d)
    pairs = {"q": (q, rq), "k": (k, rk), "dq": (dqkv[:, 0], rdqkv[:, 0]), "dk": (dqkv[:, 1], rdqkv[:, 1])}
    fractions = dict.fromkeys(pairs, (0.0, 0.0))
    ds_mag = np.zeros((2, d))
    for r in (slice(start, start + chunk) for start in range(0, t, chunk)):
        out_mag, dx_mag, ds_terms = _magnitudes(qkv[r], (q_scale, k_scale), cos[r], sin[r], dq[r], dk[r], eps)
        ds_mag += ds_terms.reshape(2, -1, d).sum(1)
        for name, (a, b) in pairs.items():
            i, fmt, mag = "qk".index(name[-1]), (fmt_out if len(name) == 1 else fmt_in), (out_mag if len(name) == 1 else dx_mag)
            err = error_and_fraction(a[r], b[r], ulp_at(fmt, a[r], b[r]) + rows * mag[:, i])
            fractions[name] = tuple(float(x) for x in np.maximum(fractions[name], err))  # NaN stays
    fractions["v"], fractions["dv"] = error_and_fraction(v, rv, 0.0), error_and_fraction(dqkv[:, 2], rdqkv[:, 2], 0.0)
    n = tokens_total or t
    ds_mag *= n / max(t, 1)
    for i, (name, a, b) in enumerate((("dq_scale", dqs, rdqs), ("dk_scale", dks, rdks))):
        fractions[name] = error_and_fraction(a, b, (2 * sum_worst(max(n * h, 1)) + rows) * ds_mag[i] + ulp_at(FLOAT32, a, b))
    return fractions
