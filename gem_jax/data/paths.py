"""Where the data sets live by default."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gem_jax.data.config import Source

SHARED_DATA_ENV = "GEM_SHARED_DATA"

SOURCE_FOLDERS = {
    Source.ML_LATEST_SMALL: "ml-latest-small",
    Source.ML_100K: "ml-100k",
    Source.AMAZON_BEAUTY: "amazon-beauty-s3rec",
}


def repo_root() -> Path:
    """The checkout holding this package (its `data/` folder ships ml-latest-small)."""
    return Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    """`$GEM_SHARED_DATA` if set, else `<repo>/../shared/data`."""
    env = os.environ.get(SHARED_DATA_ENV)
    return Path(env) if env else repo_root().parent / "shared" / "data"


def default_path(source: Source) -> Path:
    """Default folder of a file-backed source.

    ml-latest-small: `<repo>/data/ml-latest-small` (shipped). The others:
    `shared_data_dir()/<folder>`.

    Raises:
      ValueError: a source without files (synthetic).
    """
    if source not in SOURCE_FOLDERS:
        raise ValueError(f"{source} has no files")
    if source is Source.ML_LATEST_SMALL:
        return repo_root() / "data" / SOURCE_FOLDERS[source]
    return shared_data_dir() / SOURCE_FOLDERS[source]


def resolve_path(source: Source, path: str | Path | None) -> Path:
    """The folder to read `source` from: `path` if given, else `default_path(source)`.

    Raises:
      FileNotFoundError: the folder does not exist; the message says where it was
        looked for and how to point at it (`DataConfig.path` or `$GEM_SHARED_DATA`).
    """
    folder = Path(path) if path is not None else default_path(source)
    if not folder.is_dir():
        how = (
            f"set DataConfig.path (e.g. --set data.path=/data/{SOURCE_FOLDERS[source]})"
            if path is not None or source is Source.ML_LATEST_SMALL
            else f"set ${SHARED_DATA_ENV} to the folder holding {SOURCE_FOLDERS[source]}/ "
            f"(now {os.environ.get(SHARED_DATA_ENV, 'unset, so ' + str(shared_data_dir()))}) or DataConfig.path"
        )
        raise FileNotFoundError(f"{source.name} data set not found: {folder} is not a folder; {how}")
    return folder


def fingerprint(folder: Path) -> str:
    """sha256 over the names and bytes of every file under `folder` (sorted): the data set's identity."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
