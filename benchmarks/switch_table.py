"""The switch table's runs: configs/planted_sharded.py once per numerics switch and seed, on a planted log.

Every switch that changes the step's numerics (`SWITCHES`: FP8 layouts, FP8 saved activations,
sliding-window and block-local attention, AdamW moments or weight matrices stored in bfloat16) is trained beside the bf16 full-attention reference on
the same converted planted log, from the same seeds (seed k: `loop.seed=k data.seed=k`, the
same parameter init and the same batch order for every switch), and compared on its final eval
NE and AUC (`benchmarks/compare_runs.py --switch-table`; benchmarks/quality.md, "The switch
table"). Runs are named `<switch>_seed<k>`.

    python3 benchmarks/switch_table.py plan [--export '$OUT']                # the first pass's calls
    python3 benchmarks/switch_table.py train --preset short-range bf16_seed0 bf16_seed1 ... [--export DIR]
    python3 benchmarks/switch_table.py table --preset short-range            # every finished run of the preset

`train` plants and converts the preset's log under runs/planted/<preset>/ when it is not there
(about 30 s), then trains the named runs at once on one GPU through benchmarks/quality_runs.sh
(`GEM_COMPARE=0`; each process gets `GEM_MEM_FRACTION`, unless set `mem_fraction`: 0.3 for up to
three runs, 0.18 for five; all share the compilation
cache runs/quality/switch_table_cache unless `GEM_COMPILE_CACHE_DIR` is set), into
runs/quality/switch_table_<preset>/<run>/. `--export DIR` writes what the table needs (each run's
metrics.jsonl, run.json and log; the log's oracle.json and planted.json) into one archive,
DIR/switch_table_<preset>.tar.gz, at their repository paths, also when a run failed: on a
machine that does not keep runs/ between calls, DIR is the call's output folder, and `tar xzf`
of the archive in the checkout puts the files where `table` reads them. `table` runs compare_runs --switch-table on every run of the preset that
holds a metrics.jsonl (and, with `--record FILE`, on the runs of a runs record in benchmarks/results/ whose
folders are gone; `--rerun NAME` for a recorded run trained again, whose folder replaces the record's entry), writes benchmarks/results/switch_table_<preset>.json and
benchmarks/figures/switch_table_<preset>.png, and prints the `train` commands for the seeds the
table still wants (switches within two spreads of the reference with fewer than 3 seeds).

`plan` groups runs into calls of at most `--per-call` (5) runs: the first pass is the reference
with seeds 0, 1, 2 and every switch with seed 0, per preset (11 runs, 3 calls); a second pass
names its switches and seeds (`plan --presets short-range --switches fp8_32 --seeds 1 2
--reference-seeds`). A call of five bf16 runs of configs/planted_sharded.py took 5.6 minutes on
one H200 (2026-12-04, five recipe variants of the reference: 15 s planting and converting on a
fresh machine, then 324 s until the last run ended, each run 14 s lowering and 112 s compiling
with the five processes compiling at once, 132 s in train steps and 33 s in two evals sharing
the GPU; benchmarks/results/planted_sharded_recipe_sweep_long_range_h200_20261204.json). Five FP8
runs at once took 311 s (19-31 s lowering and 59-79 s compiling each), two attention variants
171 s (benchmarks/results/switch_table_long_range_runs_20261204.json). `plan --export '$OUT'`
prints commands that write their archive into a device call's output folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.compare_runs import SEEDS_WHEN_CLOSE, SWITCH_RUN
from gem_jax.train.run_record import describe_devices

REFERENCE = "bf16"
SWITCHES = {  # switch -> the `--set` overrides of configs/planted_sharded.py that turn it on
    REFERENCE: (),
    "fp8_32": ("model.fp8=True", "model.fp8_block=32"),
    "fp8_128": ("model.fp8=True", "model.fp8_block=128"),
    "fp8_hadamard": ("model.fp8=True", "model.fp8_block=128", "model.fp8_hadamard=True"),
    # the default regions (self-attention, MLPs, pooled KV) and the cross tower (token attention and DHEN mixing)
    "fp8_dhen": ("model.fp8=True", "model.fp8_block=32", "model.fp8_regions=SEQ_ATTENTION,SEQ_MLP,POOLED,CROSS"),
    "fp8_saved": ("model.fp8_saved_activations=True",),
    "sliding_256": ("model.sequence_attention=SLIDING_WINDOW", "model.attention_window=256"),
    "block_local_64": ("model.sequence_attention=BLOCK_LOCAL", "model.attention_block_size=64"),
    # the dense group's AdamW moments stored in bfloat16 (the optimizer's numerics, not the model's)
    "bf16_moments": ("optim.moments_dtype=bfloat16",),
    # the dense weight matrices stored in bfloat16, updates rounded into them stochastically (no float32 copy)
    "bf16_weights": ("optim.weights_dtype=bfloat16",),
}
# Set in every run of the table, whatever the machine's defaults: the RMSNorms as flax computes them. The
# runs made before the norm kernels became the GPU default ran those; one numerics keeps the runs comparable.
TABLE_OVERRIDES = ("model.norm_implementation=xla",)
PRESETS = ("long-range", "short-range")
CONFIG = "configs/planted_sharded.py"
RUNS_PER_CALL = 5
MAX_MEM_FRACTION = 0.3  # a run of configs/planted_sharded.py fits in 24 GB (an H100's 0.3): more buys nothing


def mem_fraction(runs: int) -> str:
    """Each process's share of the GPU's memory when `GEM_MEM_FRACTION` is not set: 0.9 split over the
    runs (a tenth left to the driver and the compile cache's readers), at most `MAX_MEM_FRACTION`, two
    decimals rounded down: 0.3 for up to 3 runs (three fit an 80 GB H100), 0.18 for 5, 0.15 for 6."""
    return f"{min(MAX_MEM_FRACTION, math.floor(90 / runs) / 100):.2f}"

REFERENCE_SEEDS = (0, 1, 2)
SPLIT = "time:0.9"


def run_overrides(name: str) -> list[str]:
    """The `--set` overrides of run `<switch>_seed<k>`: `TABLE_OVERRIDES`, the switch's and `loop.seed=k data.seed=k`.

    Raises:
      ValueError: a name not of that form, or an unknown switch (the known ones are listed).
    """
    match = SWITCH_RUN.fullmatch(name)
    if match is None or match["switch"] not in SWITCHES:
        raise ValueError(f"run {name!r}: not <switch>_seed<k> with a switch of {sorted(SWITCHES)}")
    return [*TABLE_OVERRIDES, *SWITCHES[match["switch"]], f"loop.seed={match['seed']}", f"data.seed={match['seed']}"]


def plan(presets, switches, seeds, reference_seeds, per_call: int) -> list[tuple[str, list[str]]]:
    """The calls: `(preset, run names)`, at most `per_call` runs each, the reference's seeds first."""
    calls = []
    for preset in presets:
        names = [f"{REFERENCE}_seed{k}" for k in reference_seeds] + [f"{s}_seed{k}" for s in switches for k in seeds]
        calls += [(preset, names[i:i + per_call]) for i in range(0, len(names), per_call)]
    return calls


def _slug(preset: str) -> str:
    return preset.replace("-", "_")


def paths(preset: str) -> dict[str, Path]:
    """Where a preset's planted log, converted log, runs, table and figure go (relative to the repository root)."""
    return {
        "log": Path("runs/planted") / preset / "log",
        "converted": Path("runs/planted") / preset / "converted",
        "runs": Path("runs/quality") / f"switch_table_{_slug(preset)}",
        "table": Path("benchmarks/results") / f"switch_table_{_slug(preset)}.json",
        "figure": Path("benchmarks/figures") / f"switch_table_{_slug(preset)}.png",
    }


def _prepare(preset: str) -> None:
    """Plants and converts the preset's default-size log unless already there."""
    where = paths(preset)
    if not (where["log"] / "oracle.json").is_file():
        subprocess.run([sys.executable, "-m", "gem_jax.data_cli", "plant", "--out", str(where["log"]), "--preset", preset,
                        "--split", SPLIT, "--overwrite"], check=True)
    if not (where["converted"] / "manifest.json").is_file():
        subprocess.run([
            sys.executable, "-m", "gem_jax.data_cli", "convert", str(where["log"] / "events.parquet"), "--out", str(where["converted"]),
            "--overwrite", "--user", "user_id", "--item", "item_id", "--time", "ts", "--label", "click",
            "--item-table", str(where["log"] / "items.parquet"), "--item-feature", "category", "--split", SPLIT,
        ], check=True)


def export(preset: str, names: list[str], out: Path) -> Path:
    """Writes what the table needs of `names` and of the preset's log into one archive under `out`.

    `out/switch_table_<preset>.tar.gz` holds the files at their repository paths (a device
    call's output folder returns a few files, not a tree of them); `tar xzf` in a checkout
    puts them where `table` reads them. Returns the archive's path.
    """
    where = paths(preset)
    files = [where["log"] / "oracle.json", where["log"] / "planted.json"]
    for name in names:
        files += [where["runs"] / name / "metrics.jsonl", where["runs"] / name / "run.json", where["runs"] / f"{name}.log"]
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"switch_table_{_slug(preset)}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for file in files:
            if file.is_file():
                tar.add(file, arcname=str(file))
    return archive


def train(preset: str, names: list[str], export_to: Path | None) -> int:
    """Trains `names` at once on one GPU (benchmarks/quality_runs.sh); quality_runs.sh's exit status.

    Raises:
      ValueError: a run name `run_overrides` refuses, or more runs than `GEM_MEM_FRACTION` leaves room for.
    """
    variants = [f"{name}={' '.join(run_overrides(name))}" for name in names]
    env = os.environ | {"GEM_COMPARE": "0"}
    env.setdefault("GEM_MEM_FRACTION", mem_fraction(len(names)))
    if len(names) * float(env["GEM_MEM_FRACTION"]) > 1:
        raise ValueError(f"{len(names)} runs at GEM_MEM_FRACTION={env['GEM_MEM_FRACTION']} each ask for more than the GPU's memory")
    _prepare(preset)
    where = paths(preset)
    env.setdefault("GEM_COMPILE_CACHE_DIR", str(Path("runs/quality/switch_table_cache").resolve()))
    command = ["bash", "benchmarks/quality_runs.sh", where["runs"].name, CONFIG, f"data.path={where['converted']}", *variants]
    try:
        return subprocess.run(command, env=env).returncode
    finally:
        if export_to is not None:
            export(preset, names, export_to)


def table(preset: str, records: Sequence[Path] = (), reruns: Sequence[str] = (), name: str | None = None,
          title: str | None = None) -> int:
    """compare_runs --switch-table on every run of `preset` that logged metrics, and on the runs of
    `records` (runs records of runs whose folders are gone: `compare_runs.record_evals`) but `reruns`
    (runs of a record trained again, whose folders replace the record's entries); prints the
    seeds still wanted. With `name`, the table and figure are `switch_table_<preset>_<name>`
    (another view of the same runs beside the preset's own table), titled `title`.

    Returns:
      compare_runs' exit status (0: the table's JSON and figure are written).

    Raises:
      SystemExit: no run folder of the preset and no record.
    """
    where = paths(preset)
    if name is not None:
        where = {**where, **{k: where[k].with_stem(f"{where[k].stem}_{_slug(name)}") for k in ("table", "figure")}}
    runs = sorted(d for d in where["runs"].iterdir() if (d / "metrics.jsonl").is_file()) if where["runs"].is_dir() else []
    if not runs and not records:
        raise SystemExit(f"switch_table: no run of {preset} with a metrics.jsonl under {where['runs']}, and no --record")
    command = [
        sys.executable, "benchmarks/compare_runs.py", "--switch-table", "--planted", str(where["log"]),
        *(f"--run={d.name}={d}" for d in runs), *(f"--record={r}" for r in records),
        *(f"--rerun={name}" for name in reruns), "--title", title or f"switch table, {preset} planted log", "--out", str(where["table"]), "--figure", str(where["figure"]),
    ]
    done = subprocess.run(command)
    if done.returncode:
        return done.returncode
    result = json.loads(where["table"].read_text())
    # the table's own "device" is where it was computed; a run is a folder's or a record's, or a rerun (the folder's)
    result["trained_on"] = {}
    for record in records:
        result["trained_on"].update(recorded_on(record))
    result["trained_on"].update({d.name: trained_on(d) for d in runs})  # a rerun's folder replaces its record's entry
    where["table"].write_text(json.dumps(result, indent=1) + "\n")
    wanted = more_seeds(result)
    for i in range(0, len(wanted), RUNS_PER_CALL):
        print(f"more seeds: python3 benchmarks/switch_table.py train --preset {preset} {' '.join(wanted[i:i + RUNS_PER_CALL])}")
    return 0


def trained_on(run: Path) -> str:
    """Where and from which tree a run first trained, as `gem-train`'s start-up line says it: the devices, jax and
    the memory share its run.json records (`version`), and the commit, its sha shortened to 12 digits,
    "+modified" kept. A run recorded before run.json held its devices takes them from its log's start-up line
    (`gem-train: 1 x NVIDIA H200 (gpu), jax 0.11.2`, the log beside the run's folder); "unknown" for either missing."""
    record = run / "run.json"
    version = json.loads(record.read_text()).get("version", {}) if record.is_file() else {}
    if "devices" in version:
        device = describe_devices(version)
    else:
        log = run.with_name(f"{run.name}.log")
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        device = next((line.removeprefix("gem-train: ") for line in lines if line.startswith("gem-train: ") and " x " in line and ", jax " in line), "unknown")
    sha, plus, modified = version.get("commit", "unknown").partition("+")  # "<sha>+modified": a tree with uncommitted changes (`code_version`)
    return f"{device}; commit {sha[:12]}{plus}{modified}"


def recorded_on(record: Path) -> dict[str, str]:
    """Run name -> where it trained, for each run of a runs record: as the record says it (its `gpu`), and its path."""
    data = json.loads(record.read_text())
    where = f"{data.get('gpu', 'unknown')} (runs record {record})"
    return {name: where for name in data["runs"]}


def more_seeds(result: dict) -> list[str]:
    """The runs a switch table (compare_runs --switch-table's JSON) still wants: seeds 0 to 2 of each
    switch within two spreads of the reference, those it lacks."""
    seeds = {r["switch"]: r["seeds"] for r in result["switches"]}
    return [f"{s}_seed{k}" for s in result["needs_more_seeds"] for k in range(SEEDS_WHEN_CLOSE) if k not in seeds[s]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="print the train commands of a pass, one call each")
    p.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    p.add_argument("--switches", nargs="*", choices=[s for s in SWITCHES if s != REFERENCE], default=[s for s in SWITCHES if s != REFERENCE])
    p.add_argument("--seeds", nargs="*", type=int, default=[0], help="seeds of every switch")
    p.add_argument("--reference-seeds", nargs="*", type=int, default=list(REFERENCE_SEEDS), help="seeds of the bf16 reference (none: leave it out)")
    p.add_argument("--per-call", type=int, default=RUNS_PER_CALL, help="runs trained at once in one call (one GPU)")
    p.add_argument("--export", metavar="DIR", help="add `--export DIR` to each command ('$OUT': a device call's output folder)")
    t = commands.add_parser("train", help="train the named runs at once on one GPU")
    t.add_argument("--preset", choices=PRESETS, required=True)
    t.add_argument("runs", nargs="+", help="<switch>_seed<k>")
    t.add_argument("--export", type=Path, help="write the table's inputs into one archive in this folder (a device call's output folder)")
    b = commands.add_parser("table", help="tabulate every finished run of a preset")
    b.add_argument("--preset", choices=PRESETS, required=True)
    b.add_argument("--record", action="append", type=Path, default=[], help="a runs record (benchmarks/results/switch_table_*_runs_*.json) whose runs' folders are gone: its runs join the table")
    b.add_argument("--rerun", action="append", default=[], metavar="NAME", help="a run of a --record trained again: its folder replaces the record's entry")
    b.add_argument("--name", help="write switch_table_<preset>_<name>.json/.png: another view of the runs beside the preset's table")
    b.add_argument("--title", help="the figure's and table's title (default: switch table, <preset> planted log)")
    args = parser.parse_args(argv)
    if args.command == "plan":
        if args.per_call < 1:
            parser.error(f"--per-call must be >= 1, got {args.per_call}")
        export = "" if args.export is None else f' --export "{args.export}"'
        for preset, names in plan(args.presets, args.switches, args.seeds, args.reference_seeds, args.per_call):
            print(f"python3 benchmarks/switch_table.py train --preset {preset} {' '.join(names)}{export}")
        return 0
    if args.command == "train":
        try:
            return train(args.preset, args.runs, args.export)
        except ValueError as error:
            parser.error(str(error))
    return table(args.preset, args.record, args.rerun, args.name, args.title)


if __name__ == "__main__":
    sys.exit(main())
