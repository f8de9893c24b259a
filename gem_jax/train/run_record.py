"""What produced a run: its resolved config, data set identity, code version and devices, kept in the workdir.

The first start of a run writes `<workdir>/run.json`. A restart compares its own
config and data set against it and refuses (`RunMismatchError`, naming every
differing field) when anything that changes results differs: reusing a workdir after a
config change would otherwise resume or re-report the old run under the new name.
Fields that only change how a run is observed or how far it goes (logging intervals,
checkpoint cadence, `loop.num_steps`, prefetching), or how the same values are computed
(remat budgets, the RMSNorm implementation, the kept bfloat16 weights), may change between starts
(`MAY_CHANGE`).
`start_new_run` moves an earlier run's files aside (nothing is deleted) for
`gem-train --force-new`.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from gem_jax.device_memory import device_memory_share
from gem_jax.train import compile_cache, config_tree, legacy_runs
from gem_jax.train.config import TrainConfig
from gem_jax.train.workdir_lock import LOCK_PREFIX

RUN_FILE = "run.json"
ARCHIVE_DIR = "previous_runs"
QUARANTINE_DIR = "corrupt_checkpoints"  # where a start moves the corrupt checkpoints it finds

# Config leaves that change how a step computes its values, not what they are, so they may change
# between starts: `model.remat`, what the backward recomputes instead of keeping (the same values
# up to the recomputation's rounding: a run stopped for memory may resume under another budget),
# `model.norm_implementation`, flax's RMSNorm or the one-pass kernels (the same function and
# parameters up to the order of float32 sums: a run may resume on another machine or setting),
# `model.mlp_implementation`, autodiff or the one-pass kernel for the MLPs' GELU backward (the same
# gradients up to rounding),
# and `optim.keep_compute_params`, whether the step's bfloat16 weights are kept in the state or cast
# by the forward (the same values up to the float32 rounding of the update's arithmetic).
# Each start records the ones it ran with in its `version`, so a run resumed under another setting
# says so in `resumed_with` (from that start on).
COMPUTED_WITH = ("model.remat", "model.norm_implementation", "model.mlp_implementation", "optim.keep_compute_params")

# Config leaves that may change between starts of one run: they do not change the
# trained parameters of any step both starts reach.
MAY_CHANGE = (
    "loop.num_steps",
    "loop.log_every",
    "loop.eval_every",
    "checkpoint",  # cadence, copies kept and how a copy is written: never a trained value
    "data.prefetch_batches",
    "data.path",  # where the files are; their content is compared by fingerprint
    *COMPUTED_WITH,
)

# Record leaves added after runs were recorded: a record without the leaf reads as the value
# the run used. Tables' Adagrad kept one accumulator per element before
# `optim.embedding_accumulator` made "row" the default, and started it at 0.1 before
# `optim.embedding_initial_accumulator` could change that; history rows carried no item
# features before `data.history_item_features` (and the spec's field of that name); the RMSNorms
# were flax's before `model.norm_implementation` (whose "xla" is flax's computation bit for bit), and the
# MLPs' GELU backward autodiff's before `model.mlp_implementation`;
# every forward cast the float32 weights before `optim.keep_compute_params`, and the dense weights
# were float32 before `optim.weights_dtype`.
RECORDED_BEFORE_FIELD = {
    "config.optim.keep_compute_params": False,
    "config.optim.weights_dtype": "float32",
    "config.optim.embedding_accumulator": "element",
    "config.optim.embedding_initial_accumulator": 0.1,
    "config.data.history_item_features": False,
    "spec.history_item_features": False,
    "config.model.norm_implementation": "XLA",  # enums are recorded by name
    "config.model.mlp_implementation": "XLA",
}

# Config leaves that no longer exist, dropped from a record on reading (`read_record`): each
# changed neither the values a run computed nor its state, so a run recorded with it restarts
# and loads as the one without it. `optim.gradient_dtype`: which dtype the gradients of
# parameters used only through one bf16 cast were kept in (XLA's GPU compile is the same either way).
REMOVED_FIELDS = ("config.optim.gradient_dtype",)


class RunMismatchError(ValueError):
    """A restart whose config or data set differs from the run recorded in its workdir."""


def code_version() -> dict[str, str]:
    """The gem-jax package version, the git commit of its source tree (when it is a checkout) and jax's version."""
    try:
        version = metadata.version("gem-jax")
    except metadata.PackageNotFoundError:
        version = "unknown"
    source = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        commit += "+modified" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"gem_jax": version, "commit": commit, "jax": jax.__version__}


def device_record() -> dict[str, str]:
    """The run's devices, `{"devices": "1 x NVIDIA H200 (gpu)"}` (all processes' devices), and on a GPU the
    allocator's `memory_share` of each device ("XLA_CLIENT_MEM_FRACTION=0.9", `device_memory_share`)."""
    devices = jax.devices()
    record = {"devices": f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})"}
    if jax.default_backend() == "gpu":
        record["memory_share"] = device_memory_share()
    return record


def describe_devices(version: dict[str, Any], process: str = "") -> str:
    """The devices of a `version` record (`code_version` and `device_record`) as `gem-train`'s start-up line names
    them: `1 x NVIDIA H200 (gpu), jax 0.11.2`, then `process` (", process 0 of 2 (SLURM)"), then on a GPU
    `; XLA_CLIENT_MEM_FRACTION=0.9 of each GPU's memory`."""
    share = f"; {version['memory_share']} of each GPU's memory" if "memory_share" in version else ""
    return f"{version['devices']}, jax {version.get('jax', 'unknown')}{process}{share}"


def make_record(config: TrainConfig, data_identity: dict[str, Any], spec: Any) -> dict[str, Any]:
    """The run record of a start: resolved config, data identity, feature spec, code version, devices and the
    `COMPUTED_WITH` settings (`version`: a restart with other ones is appended to `resumed_with`, not refused),
    time."""
    tree = config_tree.to_tree(config)
    return {
        "config": tree,
        "data": data_identity,
        "spec": config_tree.to_tree(spec),
        "version": {**code_version(), **device_record(), "computed_with": computed_with(tree)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def computed_with(config: dict[str, Any]) -> dict[str, Any]:
    """The `COMPUTED_WITH` leaves of a `to_tree` config, by dotted path ("model.norm_implementation": "PALLAS")."""
    return {path: value for path, value in config_tree.flatten(config).items() if _within(path, COMPUTED_WITH)}


def _within(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether dotted `path` is one of `prefixes` or a leaf under one ("model.remat.budget_gb" under "model.remat")."""
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def read_record(workdir: str | Path) -> dict[str, Any] | None:
    """The workdir's run record, or None when it has none.

    A config leaf of `RECORDED_BEFORE_FIELD` the record lacks (it was written before the
    leaf existed) is filled in with the value that run used; a leaf of `REMOVED_FIELDS` is
    dropped.

    Raises:
      RunMismatchError: `run.json` exists but is not a readable record (path named).
    """
    path = Path(workdir) / RUN_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RunMismatchError(f"{path}: unreadable run record ({error}); move the workdir aside or use --force-new") from error
    if not isinstance(record, dict) or "config" not in record:
        raise RunMismatchError(f"{path}: not a gem-jax run record; move the workdir aside or use --force-new")
    for dotted, value in RECORDED_BEFORE_FIELD.items():
        tree, name = _parent(record, dotted)
        if tree is not None and not legacy_runs.is_legacy_spec(tree):  # a spec of None or the legacy layout stays as recorded
            tree.setdefault(name, value)
    for dotted in REMOVED_FIELDS:
        tree, name = _parent(record, dotted)
        if tree is not None:
            tree.pop(name, None)
    return record


def _parent(record: dict, dotted: str) -> tuple[dict | None, str]:
    """`(the dict holding leaf "a.b.c" of record, "c")`; None when a level is missing or not a dict."""
    *parents, name = dotted.split(".")
    tree = record
    for key in parents:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return (tree if isinstance(tree, dict) else None), name


def mismatches(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """`(field, recorded, now)` for each config leaf, data-identity entry or feature-spec field that differs."""
    rows = [
        (f"config.{path}", a, b)
        for path, a, b in config_tree.diff(old["config"], new["config"])
        if not _within(path, MAY_CHANGE)
    ]
    rows += [(f"data.{path}", a, b) for path, a, b in config_tree.diff(old.get("data", {}), new["data"]) if path != "path"]
    if new.get("spec") is not None:
        rows += [(f"spec.{path}", a, b) for path, a, b in config_tree.diff(old.get("spec") or {}, new["spec"])]
    return rows


def check_run(workdir: str | Path, record: dict[str, Any], *, has_checkpoints: bool, write: bool = True) -> dict[str, Any]:
    """Verifies that `record` continues the run in `workdir`, or records it as a new run.

    `write` False checks without writing (the processes other than process 0 of a
    multi-process run, whose workdir process 0 keeps).

    Returns:
      The record in force (the recorded one, for a restart).

    Raises:
      RunMismatchError: the workdir holds a run with another config or data set
        (every differing field named, with both values), or checkpoints without a
        run record.
    """
    workdir = Path(workdir)
    old = read_record(workdir)
    if old is None:
        if has_checkpoints:
            raise RunMismatchError(
                f"{workdir} holds checkpoints but no {RUN_FILE}: it was not written by this version of gem-train, "
                "so its config cannot be checked; use a new workdir or --force-new (the old files are moved aside)"
            )
        if write:
            write_record(workdir, record)
        return record
    if legacy_runs.is_legacy_spec(old.get("spec")):
        raise RunMismatchError(
            f"{workdir} holds a run of a gem-jax before the feature schema ({workdir / RUN_FILE} records the fixed "
            f"MovieLens layout: spec fields {sorted(old['spec'])}, tasks 'primary' and 'secondary'): its checkpoints "
            "name the user tables embed/user/0..3 and the genre layer embed/genres, so this version cannot resume it. "
            "Use a new workdir, or --force-new to start a new run here "
            f"(the old run is moved to {workdir / ARCHIVE_DIR}); gem_jax.load_params still reads its parameters."
        )
    rows = mismatches(old, record)
    if rows:
        lines = "\n".join(f"  {field}: recorded {a!r}, now {b!r}" for field, a, b in rows)
        raise RunMismatchError(
            f"{workdir} holds a run with a different config or data set ({workdir / RUN_FILE}):\n{lines}\n"
            "Use a new workdir, restore the recorded values, or pass --force-new to start a new run here "
            f"(the old run is moved to {workdir / ARCHIVE_DIR})."
        )
    if write and changed_version(old, record["version"]):
        old.setdefault("resumed_with", []).append(record["version"])
        write_record(workdir, old)
    return old


def changed_version(old: dict[str, Any], version: dict[str, Any]) -> bool:
    """Whether `version` differs from the one the run last started with: its newest `resumed_with` entry, else its
    first `version`. Each change is noted once (a record written before `devices` or `computed_with` existed gains
    one entry, not one a restart)."""
    latest = (old.get("resumed_with") or [old.get("version") or {}])[-1]
    return latest != version


def check_num_steps(num_steps: int, latest_step: int | None, checkpoint_dir: Path) -> None:
    """A restart may raise `loop.num_steps` but not lower it below the newest checkpoint.

    Raises:
      RunMismatchError: `num_steps < latest_step` (both named, with the checkpoint): the
        checkpoint already holds a later step, so the run cannot end at `num_steps`.
    """
    if latest_step is not None and num_steps < latest_step:
        raise RunMismatchError(
            f"loop.num_steps={num_steps} is below the newest checkpoint, step {latest_step} ({checkpoint_dir / str(latest_step)}): "
            f"this run is already past step {num_steps}. Use loop.num_steps >= {latest_step}, a new workdir, or --force-new."
        )


def check_not_restarting_lost_run(workdir: Path, latest_step: int | None, quarantine_dir: Path) -> None:
    """Refuses to start a run again from step 1 where its checkpoints were all found corrupt.

    Raises:
      RunMismatchError: no checkpoint is left (`latest_step` None) and `quarantine_dir` holds the
        run's corrupt ones: starting again would train from step 1 under the same run record and
        overwrite its metrics, so it takes --force-new (which moves the run's files aside).
    """
    if latest_step is None and quarantine_dir.is_dir() and any(quarantine_dir.iterdir()):
        raise RunMismatchError(
            f"{workdir} holds a run whose checkpoints were all found corrupt (moved to {quarantine_dir}): it cannot resume, "
            f"and starting it would train again from step 1. Put an intact checkpoint back in {workdir / 'checkpoints'}, or pass "
            f"--force-new to start a new run here (the run's files, its corrupt checkpoints among them, are moved to {workdir / ARCHIVE_DIR})."
        )


def write_record(workdir: Path, record: dict[str, Any]) -> None:
    """Writes `run.json` atomically (a temporary file renamed over it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, workdir / RUN_FILE)


def start_new_run(workdir: str | Path) -> Path | None:
    """Moves every file of an earlier run in `workdir` into `previous_runs/<time>/`; returns that folder (None if empty).

    The compilation cache (`jax_cache`) stays: its entries are keyed by program, not by run. The
    workdir's lock files (`gem_jax.train.workdir_lock`) stay: the run calling this holds them.
    """
    workdir = Path(workdir)
    if not workdir.exists():
        return None
    entries = [
        p for p in workdir.iterdir() if p.name not in (ARCHIVE_DIR, compile_cache.DEFAULT_SUBDIR) and not p.name.startswith(LOCK_PREFIX)
    ]
    if not entries:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = workdir / ARCHIVE_DIR / stamp
    target.mkdir(parents=True)
    for entry in entries:
        shutil.move(str(entry), str(target / entry.name))
    return target
