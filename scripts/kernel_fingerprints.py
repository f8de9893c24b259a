"""Digests of the Mosaic GPU kernels a fixed set of kernel calls lowers to, on any machine.

Each case below calls one public op with `implementation="pallas"` (forward and gradients)
and lowers it for CUDA through `jax.export` with `platforms=["cuda"]`: no GPU is needed.
Every Mosaic GPU kernel in the lowered program is printed without debug information (no
source locations) and hashed. Two source trees that print the same digests hand the GPU
the same kernels, op for op, so a change that only restructures the Python (moves code,
renames, shares helpers) can be checked on a CPU. A different digest means the GPU code
changed: run the kernels' GPU correctness checks.

    PYTHONPATH=. python3 scripts/kernel_fingerprints.py --out before.json
    (change the code)
    PYTHONPATH=. python3 scripts/kernel_fingerprints.py --compare before.json

Exit status: 0, or 1 with `--compare` when a digest differs (each case is named).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import export
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

from pallas_kernels import block_local_attention, gdpa, jagged_flash_attention
from pallas_kernels.mxfp8 import mxfp8_matmul
from pallas_kernels._src import dispatch

T, H = 640, 2  # packed rows and heads of every case
OFFSETS = (0, 1, 200, 200, 457, 600)  # a length-1, a zero-length and non-multiple-of-block sequences
MAX_LEN = 257
# The name Mosaic GPU gives a kernel's dump files counts the kernels lowered in this process.
DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')


def _rows(d: int, t: int = T) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((t, H, d), jnp.bfloat16)


def _offsets() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((len(OFFSETS),), jnp.int32)


def _with_grads(op: Callable) -> Callable:
    """`(out, d out / d operands)` of `op(q, k, v, offsets...)` against a fixed cotangent."""

    def run(q, k, v, *rest):
        out, pullback = jax.vjp(lambda q, k, v: op(q, k, v, *rest), q, k, v)
        return out, pullback(jnp.ones_like(out))

    return run


def _jfa(d: int, **kwargs) -> tuple[Callable, tuple]:
    op = lambda q, k, v, o: jagged_flash_attention(q, k, v, o, max_seq_len=MAX_LEN, implementation="pallas", **kwargs)
    return _with_grads(op), (_rows(d), _rows(d), _rows(d), _offsets())


def _gdpa(d: int, **kwargs) -> tuple[Callable, tuple]:
    def op(q, k, v, q_offsets, kv_offsets):
        return gdpa(q, k, v, q_offsets, kv_offsets, max_seq_len_q=MAX_LEN, max_seq_len_kv=MAX_LEN,
                    implementation="pallas", **kwargs)

    return _with_grads(op), (_rows(d), _rows(d), _rows(d), _offsets(), _offsets())


def _block_local(d: int) -> tuple[Callable, tuple]:
    op = lambda q, k, v, o: block_local_attention(q, k, v, o, max_seq_len=MAX_LEN, rope_base=10000.0,
                                                  implementation="pallas")
    return _with_grads(op), (_rows(d), _rows(d), _rows(d), _offsets())


def _mxfp8_matmul(m: int, n: int, k: int) -> tuple[Callable, tuple]:
    """The 128-wide-K variant: activation tiles 1x128, weight tiles 128x128 (forward only: the op has no VJP)."""
    op = lambda a, a_scales, b, b_scales: mxfp8_matmul(a, a_scales, b, b_scales, implementation="pallas")
    fp8, e8m0 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    args = (
        jax.ShapeDtypeStruct((m, k), fp8),
        jax.ShapeDtypeStruct((m, k // 128), e8m0),
        jax.ShapeDtypeStruct((n, k), fp8),
        jax.ShapeDtypeStruct((n // 128, k // 128), e8m0),
    )
    return op, args


CASES: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "jfa_d128": lambda: _jfa(128),
    "jfa_d64": lambda: _jfa(64),
    "jfa_causal_d128": lambda: _jfa(128, causal=True),
    "jfa_window_d128": lambda: _jfa(128, window=(100, 30)),
    "jfa_causal_window_d64": lambda: _jfa(64, causal=True, window=(64, 0)),
    "gdpa_silu_d128": lambda: _gdpa(128, activation="silu"),
    "gdpa_silu_causal_d128": lambda: _gdpa(128, activation="silu", causal=True),
    "gdpa_gelu_d64": lambda: _gdpa(64),
    "block_local_rope_d128": lambda: _block_local(128),
    "mxfp8_matmul_k128": lambda: _mxfp8_matmul(256, 384, 512),
}


@contextlib.contextmanager
def _capturing_kernels() -> Iterator[list[str]]:
    """Collects the text of each Mosaic GPU module lowered inside the block, without debug info or dump name.

    Mosaic GPU serialises a kernel's module (`_run_serde_pass`) as it lowers it; the
    module is read there, before serialisation, and the ops jax adds are kept as is.
    """
    texts: list[str] = []
    serialise = mosaic_gpu_core._run_serde_pass

    def reading(module, *, serialize, **kwargs):
        if serialize:
            texts.append(DUMP_NAME.sub("", module.operation.get_asm(enable_debug_info=False)))
        return serialise(module, serialize=serialize, **kwargs)

    mosaic_gpu_core._run_serde_pass = reading
    hopper = dispatch.is_hopper_gpu
    dispatch.is_hopper_gpu = lambda device=None: True  # lowering for CUDA, whatever runs this process
    try:
        yield texts
    finally:
        mosaic_gpu_core._run_serde_pass = serialise
        dispatch.is_hopper_gpu = hopper


def fingerprint(case: str) -> list[str]:
    """sha256 digests (hex, 16 characters) of each Mosaic GPU kernel of one case, in lowering order.

    Raises:
      KeyError: an unknown case.
      RuntimeError: the case lowered to no Mosaic GPU kernel.
    """
    fn, args = CASES[case]()
    with _capturing_kernels() as texts:
        export.export(jax.jit(fn), platforms=["cuda"])(*args)
    if not texts:
        raise RuntimeError(f"{case}: lowered to no Mosaic GPU kernel")
    return [hashlib.sha256(text.encode()).hexdigest()[:16] for text in texts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="default: all")
    parser.add_argument("--out", help="write the digests to this JSON file")
    parser.add_argument("--compare", help="a JSON file of digests from another tree: report every case that differs")
    args = parser.parse_args(argv)
    digests = {case: fingerprint(case) for case in args.cases}
    for case, kernels in digests.items():
        print(f"{case:24s} {' '.join(kernels)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "digests": digests}, f, indent=1)
    if not args.compare:
        return 0
    with open(args.compare) as f:
        before = json.load(f)["digests"]
    differ = [case for case in digests if case in before and digests[case] != before[case]]
    missing = [case for case in digests if case not in before]
    for case in differ:
        print(f"DIFFERS {case}: {' '.join(before[case])} -> {' '.join(digests[case])}")
    for case in missing:
        print(f"not in {args.compare}: {case}")
    print(f"{len(digests) - len(differ) - len(missing)} of {len(digests)} cases lower to the same kernels")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
