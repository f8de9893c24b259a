"""The XLA flags and environment of a GPU training run, for the launch scripts.

`python scripts/xla_flags.py` prints the `XLA_FLAGS` value; `--env` prints `export`
lines for the launch scripts (which run it with the project's interpreter,
scripts/common.sh; it needs only the standard library and the repository's
`gem_jax/xla_options.py`, where the flags and their sources are: gem-train adds the same
flags itself when the environment does not give them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gem_jax.xla_options import XLA_FLAGS  # noqa: E402  (the flags and why: gem_jax/xla_options.py)

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
