"""`gem-train --help` answers without importing jax or the train stack."""

import os
import subprocess
import sys

PROGRAM = """
import sys
from gem_jax.cli import train_main
try:
    train_main(["--help"])
except SystemExit:
    pass
print("HEAVY " + " ".join(sorted(m for m in ("jax", "flax", "orbax", "grain", "gem_jax.train") if m in sys.modules)))
"""


def test_help_imports_neither_jax_nor_the_train_stack(repo_root):
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True).stdout
    assert out.rsplit("HEAVY", 1)[1].split() == []
