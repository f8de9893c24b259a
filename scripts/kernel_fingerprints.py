"""Digests of the GPU programs a fixed set of kernel calls lowers to, on any machine.

Each case below calls one public op with `implementation="pallas"` (forward, or forward and
gradients) and lowers it for CUDA (`lowering_platforms=("cuda",)`): no GPU is needed, and the
persistent kernels' grids are sized for an H100/H200's 132 SMs whatever runs the script. Two
digests per case:

- one per Mosaic GPU kernel: its module (grid, cluster, shared memory, every op of its body)
  printed without debug information (source locations) or dump name, and hashed;
- `program`: the whole lowered program printed likewise, each kernel's serialised module and
  hash blanked (they are the kernel digests): which array feeds which kernel operand, the kernel
  calls' flags and aliases, and the XLA code around them (work lists, padding, reductions).

Two source trees that print the same digests hand the GPU the same program, op for op, so a
change that only restructures the Python (moves code, renames, shares helpers) can be checked
on a CPU. A different digest means the GPU code changed: run the op's GPU correctness check.
Not covered: what XLA's GPU compiler makes of the program (a jax or XLA upgrade), kernels that
are not Mosaic GPU (the Triton quantize kernel's call is in `program`, its body is compiled
later), and ops outside the cases.

    PYTHONPATH=. python3 scripts/kernel_fingerprints.py --out before.json
    (change the code)
    PYTHONPATH=. python3 scripts/kernel_fingerprints.py --compare before.json

Exit status: 0; with `--compare`, 1 when a case differs or is missing from the file, and 2 when
the file was written under another jax version (its digests are not comparable).
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
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

from pallas_kernels import block_local_attention, compiling_for, gdpa, jagged_flash_attention
from pallas_kernels._src import mgpu_common
from pallas_kernels.gelu_grad_matmul import gelu_grad_matmul
from pallas_kernels.mxfp8 import mxfp8_matmul

T, H = 640, 2  # packed rows and heads of every case (`block_local_rope_d128_h4`: 4 heads)
OFFSETS = (0, 1, 200, 200, 457, 600)  # a length-1, a zero-length and non-multiple-of-block sequences
MAX_LEN = 257
# The name Mosaic GPU gives a kernel's dump files counts the kernels lowered in this process.
DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')
# A kernel call's serialised module and its hash, inside the program's text.
KERNEL_BYTES = re.compile(r'(kernel_hash|module) = "(?:[^"\\]|\\.)*"')


def _rows(d: int, t: int = T, heads: int = H) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((t, heads, d), jnp.bfloat16)


def _offsets() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((len(OFFSETS),), jnp.int32)


def _with_grads(op: Callable) -> Callable:
    """`(out, d out / d operands)` of `op(q, k, v, offsets...)` against a fixed cotangent."""

    def run(q, k, v, *rest):
        out, pullback = jax.vjp(lambda q, k, v: op(q, k, v, *rest), q, k, v)
        return out, pullback(jnp.ones_like(out))

    return run


def _jfa(d: int, *, dtype=jnp.bfloat16, grads: bool = True, **kwargs) -> tuple[Callable, tuple]:
    op = lambda q, k, v, o: jagged_flash_attention(q, k, v, o, max_seq_len=MAX_LEN, implementation="pallas", **kwargs)
    rows = jax.ShapeDtypeStruct((T, H, d), dtype)
    return _with_grads(op) if grads else op, (rows, rows, rows, _offsets())


def _gdpa(d: int, **kwargs) -> tuple[Callable, tuple]:
    def op(q, k, v, q_offsets, kv_offsets):
        return gdpa(q, k, v, q_offsets, kv_offsets, max_seq_len_q=MAX_LEN, max_seq_len_kv=MAX_LEN,
                    implementation="pallas", **kwargs)

    return _with_grads(op), (_rows(d), _rows(d), _rows(d), _offsets(), _offsets())


def _block_local(d: int, heads: int = H) -> tuple[Callable, tuple]:
    op = lambda q, k, v, o: block_local_attention(q, k, v, o, max_seq_len=MAX_LEN, rope_base=10000.0,
                                                  implementation="pallas")
    rows = _rows(d, heads=heads)
    return _with_grads(op), (rows, rows, rows, _offsets())


def _mxfp8_matmul(m: int, n: int, k: int, a_block: tuple[int, int], b_block: tuple[int, int]) -> tuple[Callable, tuple]:
    """`a [m, k] @ b [n, k].T` from pre-quantized operands with scale tiles `a_block` and `b_block` (no VJP)."""
    op = lambda a, a_scales, b, b_scales: mxfp8_matmul(a, a_scales, b, b_scales, implementation="pallas")
    fp8, e8m0 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    args = (
        jax.ShapeDtypeStruct((m, k), fp8),
        jax.ShapeDtypeStruct((m // a_block[0], k // a_block[1]), e8m0),
        jax.ShapeDtypeStruct((n, k), fp8),
        jax.ShapeDtypeStruct((n // b_block[0], k // b_block[1]), e8m0),
    )
    return op, args


def _gelu_grad_matmul(m: int, n: int, k: int) -> tuple[Callable, tuple]:
    """The GELU-backward GEMM of `dy [m, k]`, `w [n, k]` and `h [m, n]`, bf16 (a backward itself: no VJP)."""
    op = lambda dy, w, h: gelu_grad_matmul(dy, w, h, implementation="pallas")
    bf16 = jnp.bfloat16
    return op, (jax.ShapeDtypeStruct((m, k), bf16), jax.ShapeDtypeStruct((n, k), bf16), jax.ShapeDtypeStruct((m, n), bf16))


CASES: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "jfa_d128": lambda: _jfa(128),
    "jfa_d64": lambda: _jfa(64),
    "jfa_causal_d128": lambda: _jfa(128, causal=True),
    "jfa_window_d128": lambda: _jfa(128, window=(100, 30)),
    "jfa_causal_window_d64": lambda: _jfa(64, causal=True, window=(64, 0)),
    "jfa_forward_only_d128": lambda: _jfa(128, grads=False),
    "jfa_causal_f16_d64": lambda: _jfa(64, dtype=jnp.float16, causal=True),
    "gdpa_silu_d128": lambda: _gdpa(128, activation="silu"),
    "gdpa_silu_causal_d128": lambda: _gdpa(128, activation="silu", causal=True),
    "gdpa_gelu_d64": lambda: _gdpa(64),
    "block_local_rope_d128": lambda: _block_local(128),
    # The timed shape's 4 heads: each of the backward's two warpgroups computes two heads of a block
    # with one set of RoPE tables, which it keeps in its registers between them.
    "block_local_rope_d128_h4": lambda: _block_local(128, heads=4),
    "mxfp8_matmul_k128": lambda: _mxfp8_matmul(256, 384, 512, (1, 128), (128, 128)),
    "mxfp8_matmul_32x32": lambda: _mxfp8_matmul(256, 384, 512, (32, 32), (32, 32)),
    "gelu_grad_matmul": lambda: _gelu_grad_matmul(384, 512, 320),
}


class _H200:
    """What the ops read of the device they decide for (`pallas_kernels.compiling_for`): a Hopper GPU of 132 SMs."""

    platform, device_kind, compute_capability, core_count = "gpu", "NVIDIA H200", "9.0", mgpu_common.H100_H200_SM_COUNT


@contextlib.contextmanager
def _capturing_kernels() -> Iterator[list[str]]:
    """Collects the text of each Mosaic GPU module lowered inside the block, without debug info or dump name.

    Mosaic GPU serialises a kernel's module (`_run_serde_pass`) as it lowers it; the
    module is read there, before serialisation. Inside the block the ops take the Pallas
    kernels and size persistent grids for 132 SMs, whatever machine runs this.
    """
    texts: list[str] = []
    serialise = mosaic_gpu_core._run_serde_pass

    def reading(module, *, serialize, **kwargs):
        if serialize:
            texts.append(DUMP_NAME.sub("", module.operation.get_asm(enable_debug_info=False)))
        return serialise(module, serialize=serialize, **kwargs)

    mosaic_gpu_core._run_serde_pass = reading
    try:
        with compiling_for(_H200()):
            yield texts
    finally:
        mosaic_gpu_core._run_serde_pass = serialise


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(case: str) -> dict:
    """`{"program": digest, "kernels": [digest per Mosaic GPU kernel, in lowering order]}` of one case.

    Digests are sha256, hex, 16 characters.

    Raises:
      KeyError: an unknown case.
      RuntimeError: the case lowered to no Mosaic GPU kernel.
    """
    fn, args = CASES[case]()
    with _capturing_kernels() as texts:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    if not texts:
        raise RuntimeError(f"{case}: lowered to no Mosaic GPU kernel")
    program = KERNEL_BYTES.sub(r'\1 = ""', lowered.compiler_ir().operation.get_asm(enable_debug_info=False))
    return {"program": _digest(program), "kernels": [_digest(text) for text in texts]}


def _line(digests: dict) -> str:
    return f"program {digests['program']}  kernels {' '.join(digests['kernels'])}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="default: all")
    parser.add_argument("--out", help="write the digests to this JSON file")
    parser.add_argument("--compare", help="a JSON file of digests from another tree: report every case that differs")
    args = parser.parse_args(argv)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        if before["jax"] != jax.__version__:
            print(f"{args.compare} was written under jax {before['jax']}, this is jax {jax.__version__}: "
                  "digests of different jax versions are not comparable", file=sys.stderr)
            return 2
    digests = {case: fingerprint(case) for case in args.cases}
    for case, case_digests in digests.items():
        print(f"{case:24s} {_line(case_digests)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "digests": digests}, f, indent=1)
    if not args.compare:
        return 0
    differ = [case for case in digests if case in before["digests"] and digests[case] != before["digests"][case]]
    missing = [case for case in digests if case not in before["digests"]]
    for case in differ:
        print(f"DIFFERS {case}: {_line(before['digests'][case])} -> {_line(digests[case])}")
    for case in missing:
        print(f"MISSING {case}: not in {args.compare}")
    print(f"{len(digests) - len(differ) - len(missing)} of {len(digests)} cases lower to the same program and kernels")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
