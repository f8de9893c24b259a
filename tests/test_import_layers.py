"""The layer stack of pyproject.toml's import-linter contracts holds: no module imports a layer above it."""

import shutil
import subprocess
import sys
from pathlib import Path


def test_import_contracts_are_kept(repo_root):
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([lint, "--no-cache"], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and "0 broken" in proc.stdout
