"""Checksum manifests of checkpoint steps: sha256 of every file, written after a save, checked when a step is restored.

Orbax writes a step atomically (a temporary folder renamed when complete), but
nothing in it notices bytes that change later: a flipped byte in a data file
restores silently. `write_manifest(step_dir)` records the sha256 and size of every
file of a finished step in `<step_dir>/checksums.json`; `verify(step_dir)` names
each file that is missing, added, resized or changed since.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from pathlib import Path

MANIFEST = "checksums.json"
_CHUNK = 1 << 20
# Files hashed at once: hashlib releases the GIL, so a step's data files (Orbax's OCDBT
# files of up to 2 GiB each) are hashed on this many cores, not one.
HASH_THREADS = min(16, os.cpu_count() or 1)
# Files of this size or more are array data (`verify(part="data")`); below it, indexes and metadata.
DATA_FILE_BYTES = 1 << 24


class CorruptCheckpointError(RuntimeError):
    """A checkpoint step that fails its checksum manifest or cannot be read."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_all(paths: list[Path]) -> list[str]:
    """The sha256 of each of `paths`, hashed `HASH_THREADS` files at a time."""
    with concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="sha256") as pool:
        return list(pool.map(_sha256, paths))


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name not in (MANIFEST, f".{MANIFEST}.tmp"))


def has_manifest(step_dir: str | Path) -> bool:
    """Whether `<step_dir>/checksums.json` exists (a finished step whose manifest was written)."""
    return (Path(step_dir) / MANIFEST).is_file()


def write_manifest(step_dir: str | Path) -> None:
    """Writes `<step_dir>/checksums.json`: `{relative path: [size in bytes, sha256 hex]}` (atomically)."""
    step_dir = Path(step_dir)
    files = _files(step_dir)
    entries = {str(p.relative_to(step_dir)): [p.stat().st_size, digest] for p, digest in zip(files, _sha256_all(files), strict=True)}
    tmp = step_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(entries, indent=0, sort_keys=True))
    os.replace(tmp, step_dir / MANIFEST)


PARTS = ("all", "structure", "data")


def verify(step_dir: str | Path, *, part: str = "all") -> list[str]:
    """The problems of a step against its manifest, one line each naming the file; `[]` when intact.

    A step without a manifest (saved, then the process ended before the manifest
    was written) has nothing to check against and yields `[]`.

    Args:
      part: "all" checks every file. "structure": the manifest itself, missing and
        added files, every file's size, and the contents of the files below
        `DATA_FILE_BYTES` (indexes and metadata, which a reader must trust first).
        "data": only the contents of the files of `DATA_FILE_BYTES` or more (the
        arrays' data, nearly all of the bytes), hashed while a reader whose
        structure passed reads them. "structure" and "data" together report what
        "all" does.

    Raises:
      ValueError: `part` is not one of `PARTS`.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    step_dir = Path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return []
    try:
        expected = json.loads(manifest.read_text())
    except (OSError, ValueError) as error:
        return [] if part == "data" else [f"{manifest}: unreadable manifest ({error})"]
    problems = []
    present = {str(p.relative_to(step_dir)): p for p in _files(step_dir)}
    hashed = []  # (path, digest) of the files whose contents this part checks and whose size is right
    for name, (size, digest) in sorted(expected.items()):
        path = step_dir / name
        actual = path.stat().st_size if name in present else None
        if part != "data":
            if actual is None:
                problems.append(f"{path}: missing")
            elif actual != size:
                problems.append(f"{path}: {actual} bytes, {size} when saved")
        is_data = size >= DATA_FILE_BYTES
        if actual == size and (part == "all" or is_data == (part == "data")):
            hashed.append((path, digest))
    for (path, digest), actual in zip(hashed, _sha256_all([p for p, _ in hashed]), strict=True):
        if actual != digest:
            problems.append(f"{path}: contents changed since the save (sha256 mismatch)")
    if part != "data":
        problems += [f"{step_dir / name}: not part of the saved checkpoint" for name in sorted(set(present) - set(expected))]
    return problems
