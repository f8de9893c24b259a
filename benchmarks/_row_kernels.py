"""Pieces shared by the row-kernel benchmarks (`qk_norm_rope_bench.py`, `rms_norm_bench.py`): the record's header,
whether a NaN stayed where it was put, and the timing of several paths of one op."""

from __future__ import annotations

import datetime
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks import _timing
from gem_jax.train.run_record import code_version


def record_header(benchmark: str, interpret: bool) -> dict:
    """The JSON record's first fields: the GPU (None without one), jax, the code's version and commit
    ($GEM_GIT_COMMIT when set: a copy of the tree run elsewhere, whose `.git` may be another commit's), date, command."""
    gpu = jax.default_backend() == "gpu"
    version = code_version()
    return {
        "benchmark": benchmark,
        "gpu": jax.devices()[0].device_kind if gpu else None,
        "backend": jax.default_backend(),
        "interpret": interpret,
        "jax_version": jax.__version__,
        "version": version,
        "git_commit": os.environ.get("GEM_GIT_COMMIT") or version["commit"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def confined(clean, dirty, bad) -> bool:
    """`dirty` is NaN where `bad` and bit for bit `clean` elsewhere."""
    nan_where_bad = jnp.all(jnp.isnan(jnp.where(bad, dirty, jnp.nan)))
    return bool(nan_where_bad & jnp.array_equal(jnp.where(bad, 0, dirty), jnp.where(bad, 0, clean)))


def tile_label(tile, default) -> str:
    """The timing's name of the Pallas path with `tile`: "pallas" for the kernel's `default`, else "pallas_<rows>x<warps>"."""
    return "pallas" if tuple(tile) == tuple(default) else f"pallas_{tile[0]}x{tile[1]}"


TIMING_METHOD = "ms per call: device = CUPTI kernel time, median of --iters calls; wall = median of 5 x mean of --iters calls"


def time_paths(mode: str, paths: dict, iters: int) -> dict:
    """`{label: {device_ms, wall_ms, wall_gb_per_s, device_gb_per_s}}` of each path `label: (fn, args, bytes moved)`,
    and `xla_over_pallas` (the "xla" path's times over the "pallas" one's), printed as they come."""
    row = {}
    for label, (fn, args, moved) in paths.items():
        dev = _timing.device_ms(fn, args, iters)
        wall = _timing.wall_seconds(fn, *args, iters=iters, reps=5) * 1e3
        row[label] = {"device_ms": dev, "wall_ms": wall, "wall_gb_per_s": moved / wall / 1e6}
        row[label]["device_gb_per_s"] = moved / dev / 1e6 if dev else None
        print(f"  {mode:12s} {label:13s} device {dev or float('nan'):.3f} ms  wall {wall:.3f} ms  ({row[label]['wall_gb_per_s']:.0f} GB/s wall)", flush=True)
    row["xla_over_pallas"] = {m: row["xla"][m] / row["pallas"][m] for m in ("device_ms", "wall_ms") if row["xla"][m] and row["pallas"][m]}
    print(f"  {mode:12s} xla / pallas: {row['xla_over_pallas']}", flush=True)
    return row
