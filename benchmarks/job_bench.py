"""A whole training job as a user runs it: `gem-train` in a subprocess, timed from process start to exit.

The job's own accounting (`gem_jax.train.goodput`: the summary record of its
`metrics.jsonl`) splits its wall time into start-up (imports, setup, data, init,
lowering, compile), train steps, data waits, eval, checkpoints, restore, logging and
compiles after the first step; this script records that split, goodput, the process's
wall time as seen from outside, and the size of each checkpoint on disk.

`--restart-steps N` then starts the same run again from its last checkpoint (step K,
the job's last step) for N more steps (`--set loop.num_steps=K+N loop.log_every=1`), as a
restart after a preemption does, and records that start's split: restore time, start-up
and its first step (`first_step_s`, from its first train record) and the time from its
process start to the end of that step (`time_to_first_step_s`: its start-up buckets,
restore and first step). Run it twice with the
same `--compile-cache` for a cold and a warm start.

`--restart-only` (with `--restart-steps N` and the `--workdir` of a finished job) skips the
job and runs only its restart, so a job and its restart can be timed in separate calls.

`--xla-flags` exports the GPU flags and environment of `scripts/xla_flags.py` to the job
(as the launch scripts do); without it the job gets this process's environment.

    PYTHONPATH=. python3 benchmarks/job_bench.py --config configs/movielens_tiny.py --set loop.num_steps=20
    PYTHONPATH=. python3 benchmarks/job_bench.py --config configs/gem_h200.py --xla-flags \
        --set loop.num_steps=2000 loop.log_every=100 loop.eval_every=0 checkpoint.every_steps=1000 \
        --restart-steps 100 --compile-cache /tmp/gem_jax_cache
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import xla_flags  # noqa: E402  (scripts/xla_flags.py)

# gem-train's first line: "gem-train: 1 x NVIDIA H200 (gpu), jax 0.11.2"
DEVICE_LINE = re.compile(r"gem-train: (\d+) x (.+) \((\w+)\), jax (\S+?)(?:,|$)", re.MULTILINE)


def run_job(args: list[str], env: dict[str, str], log: Path) -> tuple[int, float, str]:
    """Runs `gem-train ARGS` to its exit; returns (exit status, seconds from start to exit, its stdout and stderr)."""
    command = [sys.executable, "-m", "gem_jax.cli", *args, "--no-progress"]
    began = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        status = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    seconds = time.perf_counter() - began
    return status, seconds, log.read_text(encoding="utf-8")


def records(workdir: Path) -> list[dict]:
    """The records of `workdir/metrics.jsonl`."""
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]


def summaries(workdir: Path) -> list[dict]:
    """The summary records of `workdir/metrics.jsonl`, oldest first (none without the file)."""
    return [r for r in records(workdir) if r["kind"] == "summary"] if (workdir / "metrics.jsonl").is_file() else []


def split_of(summary: dict) -> dict:
    """The summary's time split, goodput and late-compile count."""
    keys = ("wall_s", "goodput", "compiles_after_start")
    return {k: v for k, v in summary.items() if k.startswith("time_") or k in keys}


def checkpoint_sizes(workdir: Path) -> dict[str, int]:
    """Bytes on disk of each checkpoint step directory."""
    out = {}
    for step in sorted((workdir / "checkpoints").iterdir(), key=lambda p: p.name):
        if step.is_dir() and step.name.isdigit():
            out[step.name] = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    return out


def device_fields(output: str) -> dict[str, str]:
    """The device, backend and jax version from gem-train's first line ("unknown" without one)."""
    found = DEVICE_LINE.search(output)
    if not found:
        return {"device": "unknown", "backend": "unknown", "jax_version": "unknown"}
    return {"device": f"{found.group(1)} x {found.group(2)}", "backend": found.group(3), "jax_version": found.group(4)}


def git_commit() -> str:
    """$GEM_GIT_COMMIT when set (a copy of the tree run elsewhere, whose `.git` may be another commit's), else git's HEAD."""
    if os.environ.get("GEM_GIT_COMMIT"):
        return os.environ["GEM_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def job_record(status: int, seconds: float, output: str, workdir: Path) -> dict:
    """One start of the job: exit status, outside wall time, the summary's split (or why there is none)."""
    out: dict = {"exit_status": status, "process_wall_s": seconds}
    found = summaries(workdir)
    if status != 0 or not found:
        out["error"] = output[-4000:]
        return out
    summary = found[-1]
    out["step"] = summary["step"]
    out["split"] = split_of(summary)
    out["after_summary_s"] = seconds - summary["wall_s"]  # logger close, summary print, interpreter exit
    reported = (k for k in summary if k.startswith(("auc_", "ne_", "checkpoint_", "programs_")))  # per task, the saves, the programs
    for key in ("train_examples_per_s", "train_tflops_per_s", "mfu", "loss", "steps_at_larger_capacity", *reported):
        if key in summary:
            out[key] = summary[key]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="PATH=VALUE", help="as gem-train --set")
    parser.add_argument("--workdir", default=None, help="the job's workdir (default: a new temporary directory)")
    parser.add_argument("--compile-cache", default="off", metavar="DIR|off", help="gem-train --compile-cache (default off: a cold start)")
    parser.add_argument("--restart-steps", type=int, default=0, metavar="N", help="then restart from the last checkpoint for N more steps")
    parser.add_argument("--restart-only", action="store_true", help="--workdir holds the finished job: run only its restart")
    parser.add_argument("--xla-flags", action="store_true", help="export scripts/xla_flags.py's XLA_FLAGS and environment to the job")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/job_<config>_<date>.json")
    args = parser.parse_args(argv)
    if args.restart_steps < 0:
        parser.error(f"--restart-steps must be >= 0, got {args.restart_steps}")
    if args.restart_only and not (args.restart_steps and args.workdir):
        parser.error("--restart-only needs --restart-steps N and the --workdir of a finished job")

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{xla_flags.xla_flags()} {os.environ.get('XLA_FLAGS', '')}".strip()
        env.update(xla_flags.ENVIRONMENT)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gem_job_"))
    base = ["--config", args.config, "--workdir", str(workdir), "--compile-cache", args.compile_cache]

    if args.restart_only:
        last = summaries(workdir)[-1:]
        if not (last and last[0].get("finished")):
            parser.error(f"--restart-only: {workdir / 'metrics.jsonl'} holds no summary of a finished job (its last start must have finished)")
        status, seconds, output = 0, 0.0, ""
        job = {"step": last[0]["step"], "timed_in_this_call": False}
    else:
        workdir.mkdir(parents=True, exist_ok=True)
        job_args = [*base, *(["--set", *args.overrides] if args.overrides else [])]
        status, seconds, output = run_job(job_args, env, workdir / "job.log")
        job = job_record(status, seconds, output, workdir)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "job",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        **device_fields(output),
        "config": args.config,
        "overrides": args.overrides,
        "compile_cache": args.compile_cache,
        "xla_flags": env.get("XLA_FLAGS", ""),
        "workdir": str(workdir),
        "job": job,
    }
    record["checkpoint_bytes"] = checkpoint_sizes(workdir) if (workdir / "checkpoints").is_dir() else {}
    if args.restart_steps and "step" in record["job"]:
        last = record["job"]["step"]
        restart = [*base, "--set", *args.overrides, f"loop.num_steps={last + args.restart_steps}", "loop.log_every=1"]
        status, seconds, output = run_job(restart, env, workdir / "restart.log")
        if args.restart_only:
            record.update(device_fields(output))
        again = job_record(status, seconds, output, workdir)
        train = [r for r in records(workdir) if r["kind"] == "train" and r["step"] > last]
        if train and "split" in again:
            split = again["split"]
            again["first_step_s"] = train[0]["time_steps_s"]
            startup = sum(v for k, v in split.items() if k.startswith("time_startup_"))
            again["time_to_first_step_s"] = startup + split["time_restore_s"] + train[0]["time_steps_s"]
        again["from_step"] = last
        record["restart"] = again

    stem = Path(args.config).stem
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"job_{stem}_{now:%Y%m%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    print(f"wrote {out}")
    if any(part.get("exit_status", 0) != 0 for part in (record["job"], record.get("restart", {}))):
        sys.exit(1)


if __name__ == "__main__":
    main()
