"""The XLA flags and environment of a GPU training run, kept in one place.

`python scripts/xla_flags.py` prints the `XLA_FLAGS` value; `--env` prints `export`
lines for the launch scripts (which run it with the project's interpreter,
scripts/common.sh; it needs only the standard library). Sources: jax's GPU performance tips
(docs/gpu_performance_tips.md), NVIDIA JAX-Toolbox docs/GPU_performance.md and MaxText's
A3 launch scripts. Every flag was checked to parse with the pinned jaxlib (0.11.2)
(`tests/gem_jax/parallel/test_parallel_launch.py`).
"""

from __future__ import annotations

import argparse

# The latency-hiding scheduler overlaps the FSDP all-gathers / reduce-scatters and the
# embedding all-to-alls with compute. The combine thresholds let XLA merge the many
# small per-parameter collectives of HSDP into few large ones (at least one DHEN
# layer's weights; JAX-Toolbox's rule of thumb). Without Triton GEMMs XLA autotunes
# only cuBLAS's algorithms for each dot, which is what it picked anyway at GEM width: the
# gem_h200 step compiled in 45.5 s instead of 56.0 s and ran 0.181 s against 0.183 s
# (benchmarks/results/xla_flags_h200_triton_gemm_20261203.json, benchmarks/step.md).
XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_triton_gemm=false",
)

ENVIRONMENT = {
    # Leave room for NCCL and the Mosaic GPU kernels' scratch (gem-train takes the same share when
    # neither this variable nor its deprecated name is set: gem_jax.device_memory.claim_device_memory).
    "XLA_CLIENT_MEM_FRACTION": "0.9",
    # NVLink SHARP multicast stays off: shared hosts.
    "NCCL_NVLS_ENABLE": "0",
}


def xla_flags() -> str:
    """The space-separated `XLA_FLAGS` value."""
    return " ".join(XLA_FLAGS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", action="store_true", help="print export lines for XLA_FLAGS and the environment")
    args = parser.parse_args()
    if args.env:
        print(f'export XLA_FLAGS="{xla_flags()} ${{XLA_FLAGS:-}}"')
        print("unset XLA_PYTHON_CLIENT_MEM_FRACTION  # the deprecated name: jaxlib refuses it beside XLA_CLIENT_MEM_FRACTION")
        for key, value in ENVIRONMENT.items():
            print(f"export {key}={value}")
    else:
        print(xla_flags())


if __name__ == "__main__":
    main()
