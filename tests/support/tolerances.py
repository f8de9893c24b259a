"""Error bounds of low-precision arithmetic, derived from the number formats.

Every test that compares two computations in FP8, bf16 or float32 (a kernel against its jnp
reference, a sharded step against the unsharded one, a quantized layer against the float one)
takes its bound from here, so that each number and its reason live in one place. The errors
measured against these bounds under several XLA CPU settings (which change float summation
order) are in `benchmarks/tolerances.md`, made by `benchmarks/tolerance_sweep.py`.

Rounding to nearest in a binary format with `m` stored mantissa bits: a normal value `x` in
`[2**e, 2**(e+1))` lies on a grid of spacing `ulp = 2**(e - m)`, so

- its relative error is at most `u = 2**-(m + 1)` (the unit roundoff, half an ulp at the
  bottom of the binade; bf16 2**-8, E4M3 2**-4, E5M2 2**-3, float32 2**-24);
- for data that is smooth on the scale of an ulp the error is uniform in `[-ulp/2, ulp/2]`,
  with rms `ulp / sqrt(12) <= 2**-m / sqrt(12) * |x|` (`Format.rms`: an upper bound over
  where `x` falls in its binade; over a whole binade the mean is about 0.72 of it).

MXFP8 (pallas_kernels/mxfp8/formats.py) scales each 32x32 (or 1x128) tile by a power of two
that maps its largest magnitude into `(224, 448]` and never clips, so every element keeps
E4M3's relative precision down to `2**-15` of its tile's maximum (below that: subnormals,
absolute error at most `2**-10` of the scale, a negligible share of Gaussian-like data).

Set `GEM_TOLERANCE_LOG=FILE` to append each `check` (test, name, error, bound) to FILE as a
JSON line: the sweep reads them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format by its stored mantissa bits."""

    name: str
    mantissa_bits: int

    @property
    def eps(self) -> float:
        """`2**-m`: the spacing of the grid relative to the bottom of a binade (one ulp, at most)."""
        return 2.0**-self.mantissa_bits

    @property
    def u(self) -> float:
        """Unit roundoff `2**-(m+1)`: the largest relative error of one rounding to nearest."""
        return self.eps / 2

    @property
    def rms(self) -> float:
        """`2**-m / sqrt(12)`: an upper bound on the rms relative error of rounding smooth data to nearest."""
        return self.eps / math.sqrt(12)


FLOAT64 = Format("float64", 52)
FLOAT32 = Format("float32", 23)
FLOAT16 = Format("float16", 10)
BFLOAT16 = Format("bfloat16", 7)
E4M3 = Format("float8_e4m3fn", 3)
E5M2 = Format("float8_e5m2", 2)
FORMATS = {f.name: f for f in (FLOAT32, FLOAT16, BFLOAT16, E4M3, E5M2)}


def format_of(dtype) -> Format:
    """The `Format` of a numpy or jax dtype (float32, float16, bfloat16, float8_e4m3fn, float8_e5m2)."""
    return FORMATS[np.dtype(dtype).name]


# A bound on an expected (rms) error holds for one draw up to the draw's spread: over n >= 1000
# elements the relative spread of an rms is ~1/sqrt(n) <= 3%, so 1.25x covers it many times over;
# with `rms` itself 1/0.72 above the binade mean, the typical headroom is 1.25 / 0.72 ~ 1.7x.
DRAW = 1.25


def product_rms(*operands: Format) -> float:
    """Relative Frobenius error of `a @ b` (or `a * b`) when each operand is rounded independently to its format.

    Independent relative errors `d_a, d_b` on random operands add in quadrature:
    `||(a + da)(b + db) - ab|| / ||ab|| ~ sqrt(rms_a**2 + rms_b**2)` (second-order terms dropped).
    """
    return math.sqrt(sum(f.rms**2 for f in operands))


def sum_worst(k: int, fmt: Format = FLOAT32) -> float:
    """Higham's `gamma_k = k u / (1 - k u)`: the worst-case relative error (against the sum of magnitudes)
    of a `k`-term sum or dot product in `fmt`, in any order; so also the largest difference of two orders."""
    ku = k * fmt.u
    if ku >= 1:
        raise ValueError(f"gamma_k is unbounded for k={k} in {fmt.name}")
    return ku / (1 - ku)


def sum_rms(k: int, fmt: Format = FLOAT32) -> float:
    """`sqrt(k) u`: the typical relative error of a `k`-term sum whose roundings are independent."""
    return math.sqrt(k) * fmt.u


def flip_probability(relative_change: float, fmt: Format = E4M3) -> float:
    """Probability that a value moved by `relative_change` of itself rounds to another grid point.

    Rounding boundaries lie an ulp apart, and an ulp is at least `fmt.eps / 2` of the value, so a
    uniformly placed value is within `relative_change |x|` of a boundary with probability at most
    `2 relative_change |x| / ulp <= 4 relative_change / fmt.eps`; a flip moves it by one ulp.
    """
    return min(1.0, 4 * relative_change / fmt.eps)


def rel_err(got, want) -> float:
    """`||got - want|| / ||want||` (Frobenius, in float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def ulp_at(fmt: Format, a, b) -> np.ndarray:
    """One ulp of `fmt` at the larger magnitude of `a` and `b`, elementwise (float64)."""
    m = np.maximum(np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)))
    return fmt.eps * 2.0 ** np.floor(np.log2(np.maximum(m, np.finfo(np.float32).tiny)))


def error_and_fraction(a, b, bound) -> tuple[float, float]:
    """`(max |a - b|, max |a - b| / bound)` in float64, elementwise `bound` (NaN where a NaN differs)."""
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float(np.max(diff, initial=0.0)), float(np.max(diff / np.maximum(bound, np.finfo(np.float64).tiny), initial=0.0))


def check(name: str, err: float, bound: float) -> None:
    """Asserts `err <= bound`, naming both; logs them to `$GEM_TOLERANCE_LOG` when set."""
    log = os.environ.get("GEM_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "name": name, "err": float(err), "bound": float(bound)}) + "\n")
    assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


def dot_bound(a, b, fmt: Format = FLOAT32) -> np.ndarray:
    """Elementwise bound on the difference of two evaluations of `a @ b` in `fmt`, in any summation orders.

    Each is within `gamma_K |a| @ |b|` of the exact product (Higham 3.5; K the contracted size), so
    two are within twice that. Exact when `a`, `b` hold FP8 or bf16 values: their products are exact
    in float32, only the sums round.
    """
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    return 2 * sum_worst(a.shape[-1], fmt) * (a @ b)


def check_within(name: str, got, want, bound) -> None:
    """`check` of `max |got - want| / bound` (elementwise `bound`, e.g. `dot_bound`) against 1."""
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    check(name, float(np.max(diff / np.maximum(bound, np.finfo(np.float64).tiny), initial=0.0)), 1.0)


def attention_budget(fmt: Format) -> float:
    """Largest `max |kernel - reference| / max |reference|` of an attention kernel (output or a gradient)
    against its jnp reference, both taking inputs in `fmt`.

    Low precision (bf16, fp16): the kernel rounds the probabilities P, dP's and dS's MMA operands to `fmt`
    where the reference keeps them in float32, and both round their outputs: up to 4 roundings on a
    gradient's path, each at most `u` of the largest term it touches; 2x for the cancellation in
    `dS = P (dP - D)`, whose terms sum to zero, so a gradient can be smaller than its terms: `8 u`.
    float32: both sum up to 128 keys (a tile) and 64 features in their own orders and evaluate exp their own
    ways: `2 gamma_128` of the largest term.
    """
    return 2 * sum_worst(128) if fmt == FLOAT32 else 8 * fmt.u
