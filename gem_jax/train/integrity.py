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
# Files of this size or more are array data (`verify(data=True)`); below it, indexes and metadata.
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


def verify(step_dir: str | Path, *, data: bool | None = None) -> list[str]:
    """The problems of a step against its manifest, one line each naming the file; `[]` when intact.

    A step without a manifest (saved, then the process ended before the manifest
    was written) has nothing to check against and yields `[]`.

    Args:
      data: None checks every file. False checks the step's structure: the manifest
        itself, missing and added files, sizes, and the contents of the files below
        `DATA_FILE_BYTES` (indexes and metadata, which a reader must trust first).
        True checks only the contents of the files of `DATA_FILE_BYTES` or more
        (the arrays' data, nearly all of the bytes), so that they can be hashed
        while a reader whose structure passed reads them.
    """
    step_dir = Path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return []
    try:
        expected = json.loads(manifest.read_text())
    except (OSError, ValueError) as error:
        return [] if data else [f"{manifest}: unreadable manifest ({error})"]
    problems = []
    present = {str(p.relative_to(step_dir)): p for p in _files(step_dir)}
    same_size = []
    for name, (size, digest) in sorted(expected.items()):
        path = step_dir / name
        if data is None or data == (size >= DATA_FILE_BYTES):
            if name in present and path.stat().st_size == size:
                same_size.append((path, digest))
        if data:
            continue
        if name not in present:
            problems.append(f"{path}: missing")
        elif (actual := path.stat().st_size) != size:
            problems.append(f"{path}: {actual} bytes, {size} when saved")
    for (path, digest), actual in zip(same_size, _sha256_all([p for p, _ in same_size]), strict=True):
        if actual != digest:
            problems.append(f"{path}: contents changed since the save (sha256 mismatch)")
    if not data:
        problems += [f"{step_dir / name}: not part of the saved checkpoint" for name in sorted(set(present) - set(expected))]
    return problems
