"""The manifest of a converted log (`manifest.json`) and the identity of its inputs.

A converted directory is complete once its `manifest.json` exists (it is
written last, and the directory is moved into place whole). The manifest holds
the schema and settings the log was converted with, each input's size,
modification time and sha256, the split, the vocabularies, features, tasks,
counts, skipped rows, the first duplicate event, the shard files, the record
layout and the sequence-length histogram (`gem_jax.data.ingest.convert` lists
every key). A manifest of this version written before duplicate events were
counted lacks `counts["duplicate_events"]` and `first_duplicate_event`; its
readers take them as not counted (`.get`), not as zero.

`check_unchanged` decides whether a conversion would redo the same work: the
same settings and inputs of the same size and modification time are unchanged
without reading them; an input whose size or time changed is hashed, and is
unchanged when its sha256 is the recorded one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from gem_jax.data.rows import DataFormatError

MANIFEST = "manifest.json"
FORMAT = "gem-data converted event log"
VERSION = 2  # 2: the per-record train counts and the item train labels (no record read to plan batches)
DUPLICATES_NOT_COUNTED = "duplicate events not counted (converted by an earlier gem-data; convert again into a new --out to count them)"


def describe_duplicates(first: dict[str, str]) -> str:
    """What duplicate events are, and where the first is: "rows equal in every column read to an earlier row (first:
    FILE, LOCATION, a copy of COPY_OF)", from a manifest's `first_duplicate_event`."""
    return f"rows equal in every column read to an earlier row (first: {first['file']}, {first['location']}, a copy of {first['copy_of']})"


def sha256_of(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """`{"path", "size", "mtime_ns"}` of a file (its path resolved)."""
    stat = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a converted directory.

    Raises:
      DataFormatError: no manifest there (the directory is not a finished
        conversion), or one that is not ours or of another version.
    """
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataFormatError(f"{directory}: no {MANIFEST}; not a converted log (run gem-data convert)") from None
    except json.JSONDecodeError as error:
        raise DataFormatError(f"{path}: not valid JSON ({error})") from None
    if data.get("format") == FORMAT and isinstance(data.get("version"), int) and data["version"] < VERSION:
        raise DataFormatError(
            f"{path}: converted by an older gem-data (format version {data['version']}; this one reads version {VERSION}); "
            "run gem-data convert again with the same arguments: it replaces the old conversion"
        )
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise DataFormatError(f"{path}: format {data.get('format')!r} version {data.get('version')!r}; expected {FORMAT!r} version {VERSION}")
    return data


def older_version(directory: str | os.PathLike) -> int | None:
    """The format version of the conversion in `directory` when it is one of this format older than `VERSION`, else None
    (no manifest, not ours, unreadable, or current: `read_manifest` says which)."""
    try:
        data = json.loads((Path(directory) / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    version = data.get("version") if isinstance(data, dict) and data.get("format") == FORMAT else None
    return version if isinstance(version, int) and version < VERSION else None


def write_manifest(directory: Path, data: dict[str, Any]) -> None:
    """Writes `directory/manifest.json`: `data` (JSON-serialisable) under this format's name and version."""
    (directory / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, **data}, indent=1) + "\n")


def check_unchanged(manifest: dict[str, Any], settings: dict[str, Any], inputs: list[str]) -> tuple[bool, str]:
    """Whether converting `inputs` under `settings` would reproduce `manifest`.

    Args:
      manifest: an existing conversion's manifest.
      settings: the new conversion's `settings` (schema, split, vocabulary and
        shard options), compared as JSON.
      inputs: the new conversion's input files (event files, then tables).

    Returns:
      `(unchanged, reason)`: `reason` says how it was decided ("by size and
      modification time", "by sha256") or what differs (settings, files added
      or removed, files whose content changed).
    """
    if manifest.get("settings") != json.loads(json.dumps(settings)):
        changed = sorted(k for k in set(settings) | set(manifest.get("settings", {})) if manifest.get("settings", {}).get(k) != json.loads(json.dumps(settings.get(k))))
        return False, f"the settings differ ({', '.join(changed)})"
    recorded = {entry["path"]: entry for entry in manifest["inputs"]}
    now = {str(Path(p).resolve()) for p in inputs}
    if now != set(recorded):
        added, removed = sorted(now - set(recorded)), sorted(set(recorded) - now)
        return False, f"the input files differ (added {added}, removed {removed})"
    moved = [p for p in now if file_identity(p) != {k: recorded[p][k] for k in ("path", "size", "mtime_ns")}]
    if not moved:
        return True, "by size and modification time"
    changed = [p for p in moved if sha256_of(p) != recorded[p]["sha256"]]
    if changed:
        return False, f"the content of {len(changed)} input file(s) changed (sha256): {', '.join(sorted(changed))}"
    return True, f"by sha256 ({len(moved)} file(s) touched since, same content)"
