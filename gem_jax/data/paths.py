"""Where the data sets live by default."""

from __future__ import annotations

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
