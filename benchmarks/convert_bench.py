"""`gem-data convert` throughput and peak memory, and reading speed of the converted shards.

Generates a synthetic event log of `--events` events (string user and item ids,
long-tailed events per user: users drawn with probability ~ 1 / (rank + 10)^1.1;
items Zipf-like; a click label, a rating, an action and a category per item) and
writes it once as CSV and once as Parquet (kept in `--data`, reused by later
runs of the same size). Each conversion runs in a child process
(`python -m gem_jax.data_cli convert`), timed by wall clock and CPU time, its
peak RSS read from its own `os.wait4` resource usage. The read benchmark
iterates a `ConvertedLog` (one loader process, all shards) in file order and at
random indices, records/s and events/s. With `--repeats R` each conversion runs
R times (CSV and Parquet alternating) and the fastest is reported beside all
wall times: on a shared 2-core machine single runs vary by 10-20%.

Targets (on 2 cores): a 20M-event CSV (~1 GB) converted in <= 60 s, Parquet
faster, peak RSS <= 2 GB whatever the input size (`--memory-mb 2048`).

Run: PYTHONPATH=. .venv/bin/python benchmarks/convert_bench.py [--events 2000000] [--data /tmp/gem_convert_bench] [--repeats 1]
Writes benchmarks/results/convert_<events>_<memory_mb>mb.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CHUNK = 1_000_000


def _ids(prefix: str, numbers: np.ndarray) -> pa.Array:
    """String ids like `u-0012345f` (hex of a scrambled number, so ids are not in count order)."""
    scrambled = (numbers.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(1 << 32)
    return pc.binary_join_element_wise(prefix, pa.array(np.char.mod("%08x", scrambled)), "")


def generate(directory: Path, events: int, seed: int = 0) -> dict[str, Path]:
    """Writes `events.csv` and `events.parquet` of the synthetic log (chunk by chunk)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"csv": directory / f"events_{events}.csv", "parquet": directory / f"events_{events}.parquet"}
    if all(p.exists() for p in paths.values()):
        return paths
    num_users, num_items = max(10, events // 20), max(10, events // 50)
    rng = np.random.default_rng(seed)
    user_p = 1.0 / (np.arange(num_users) + 10.0) ** 1.1
    user_p /= user_p.sum()
    item_p = 1.0 / (np.arange(num_items) + 5.0)
    item_p /= item_p.sum()
    actions = np.array(["view", "click", "cart", "buy"])
    csv_writer = parquet_writer = None
    for start in range(0, events, CHUNK):
        n = min(CHUNK, events - start)
        users = rng.choice(num_users, n, p=user_p)
        items = rng.choice(num_items, n, p=item_p)
        table = pa.table({
            "user_id": _ids("u-", users),
            "item_id": _ids("i-", items),
            "ts": rng.integers(1_600_000_000, 1_700_000_000, n),
            "action": pa.array(actions[rng.integers(0, 4, n)]),
            "click": rng.integers(0, 2, n),
            "rating": rng.integers(1, 6, n),
            "category": pa.array(np.char.mod("c%d", items % 97)),
        })
        csv_writer = csv_writer or pa_csv.CSVWriter(str(paths["csv"]), table.schema)
        parquet_writer = parquet_writer or pq.ParquetWriter(str(paths["parquet"]), table.schema)
        csv_writer.write_table(table)
        parquet_writer.write_table(table, row_group_size=256_000)
    csv_writer.close()
    parquet_writer.close()
    return paths


def convert_in_child(path: Path, out: Path, memory_mb: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable, "-m", "gem_jax.data_cli", "convert", str(path), "--out", str(out),
        "--user", "user_id", "--item", "item_id", "--time", "ts", "--action", "action",
        "--label", "click", "--label", "like=rating>=4", "--item-feature", "category",
        "--split", "time:0.9", "--memory-mb", str(memory_mb), "--quiet",
    ]
    start = time.perf_counter()
    child = subprocess.Popen(command, env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own CPU time and peak RSS
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed with exit status {os.waitstatus_to_exitcode(status)}")
    manifest = json.loads((out / "manifest.json").read_text())
    events = manifest["counts"]["events"]
    return {
        "input_bytes": path.stat().st_size,
        "events": events,
        "users": manifest["counts"]["users"],
        "buckets": manifest["counts"]["buckets"],
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "events_per_s": round(events / wall),
        "peak_rss_mb": round(usage.ru_maxrss / 1024),  # KiB on Linux
        "output_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
    }


def read_speed(directory: Path, seconds: float = 10.0) -> dict:
    sys.path.insert(0, str(REPO))
    from gem_jax.data.ingest.shards import ConvertedLog

    log = ConvertedLog(directory)
    result = {}
    for order in ("sequential", "random"):
        indices = np.arange(len(log)) if order == "sequential" else np.random.default_rng(0).permutation(len(log))
        records = events = 0
        start = time.perf_counter()
        for index in indices:
            events += log[int(index)]["item"].size
            records += 1
            if time.perf_counter() - start > seconds:
                break
        wall = time.perf_counter() - start
        result[order] = {"records": records, "records_per_s": round(records / wall), "events_per_s": round(events / wall)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2_000_000)
    parser.add_argument("--data", default="/tmp/gem_convert_bench")
    parser.add_argument("--memory-mb", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1, help="conversions of each file; the fastest is reported")
    parser.add_argument("--no-read", action="store_true", help="skip the read benchmark")
    args = parser.parse_args()
    data = Path(args.data)
    started = time.perf_counter()
    paths = generate(data, args.events)
    generated = time.perf_counter() - started
    results, walls = {}, {kind: [] for kind in paths}
    for _ in range(args.repeats):
        for kind, path in paths.items():
            run = convert_in_child(path, data / f"out_{kind}", args.memory_mb)
            walls[kind].append(run["wall_s"])
            if kind not in results or run["wall_s"] < results[kind]["wall_s"]:
                results[kind] = run
            print(kind, run, flush=True)
    for kind in paths:
        results[kind]["wall_s_all_runs"] = walls[kind]
    if not args.no_read:
        results["read_one_process"] = read_speed(data / "out_parquet")
        print("read", results["read_one_process"])
    record = {
        "benchmark": "convert_bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_1min": os.getloadavg()[0]},
        "pyarrow": pa.__version__,
        "events": args.events,
        "memory_mb": args.memory_mb,
        "repeats": args.repeats,
        "generate_s": round(generated, 1),
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"convert_{args.events}_{args.memory_mb}mb.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
