"""Pieces shared by the row-kernel benchmarks (`qk_norm_rope_bench.py`, `rms_norm_bench.py`): the machine and the
record's header, whether a NaN stayed where it was put, the timing of several paths of one op, and the run of the
checks then the timings."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import _timing
from gem_jax.train.run_record import code_version
from pallas_kernels._src import row_tiles


def tiles_type(op_name: str):
    """An argparse type for `--tiles`: "32x4,16x8" as `[(32, 4), (16, 8)]`, each checked (`row_tiles.check_tile`),
    "" as none; a part that is not ROWSxWARPS, or not a tile the kernels take, is refused by name."""

    def parse(text: str) -> list[tuple[int, int]]:
        tiles = []
        for part in filter(None, text.split(",")):
            try:
                tiles.append(row_tiles.check_tile(op_name, tuple(int(n) for n in part.split("x"))))
            except ValueError as error:
                raise argparse.ArgumentTypeError(f"{part!r}: {error}") from None
        return tiles

    return parse


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def machine(interpret: bool, tail_case: str) -> tuple[bool, bool]:
    """`(gpu, full)`: whether jax runs on a GPU, and whether every check and the timings run (a GPU, or
    `--interpret`); without either it says that only `tail_case` is checked, in the interpreter."""
    gpu = jax.default_backend() == "gpu"
    if not (gpu or interpret):
        print(f"no GPU here ({jax.default_backend()}): checking the {tail_case} case in the Pallas interpreter; no timings", flush=True)
    return gpu, gpu or interpret


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
    and `xla_over_pallas` (the "xla" path's times over the "pallas" one's), printed as they come. Bytes moved None:
    a path whose traffic is not counted (GB/s None)."""
    row = {}
    for label, (fn, args, moved) in paths.items():
        dev = _timing.device_ms(fn, args, iters)
        wall = _timing.wall_seconds(fn, *args, iters=iters, reps=5) * 1e3
        row[label] = {"device_ms": dev, "wall_ms": wall, "wall_gb_per_s": None if moved is None else moved / wall / 1e6}
        row[label]["device_gb_per_s"] = moved / dev / 1e6 if dev and moved is not None else None
        rate = "" if moved is None else f"  ({row[label]['wall_gb_per_s']:.0f} GB/s wall)"
        print(f"  {mode:12s} {label:13s} device {dev or float('nan'):.3f} ms  wall {wall:.3f} ms{rate}", flush=True)
    row["xla_over_pallas"] = {m: row["xla"][m] / row["pallas"][m] for m in ("device_ms", "wall_ms") if row["xla"][m] and row["pallas"][m]}
    print(f"  {mode:12s} xla / pallas: {row['xla_over_pallas']}", flush=True)
    return row


def run(record: dict, full: bool, checks: Callable[[], list[dict]], bytes_moved: Callable[[], dict], counts: str,
        timings: Callable[[], dict], out: str | None) -> int:
    """Runs `checks()` (in the Pallas interpreter when `record["interpret"]`), then, when every check is `ok` and
    `full`, the timings (`bytes_moved()`, `counts` saying what it counts, `timings()`); writes the record to `out`.
    Returns the exit status: 0, or 1 when a check failed (no timings then)."""
    with plgpu.force_gpu_interpret_mode() if record["interpret"] else contextlib.nullcontext():
        record["checks"] = checks()
        record["checks_ok"] = all(c["ok"] for c in record["checks"])
        if record["checks_ok"] and full:
            record["bytes_moved"] = bytes_moved()
            record["bytes_moved_counts"] = " ".join(counts.split())
            record["timing_method"] = TIMING_METHOD
            record["timing"] = timings()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1))
        print(f"wrote {out}", flush=True)
    return 0 if record["checks_ok"] else 1
