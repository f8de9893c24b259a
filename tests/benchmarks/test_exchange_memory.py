"""benchmarks/exchange_memory.py on the configs/gem_sharded.py topology (32 fake CPU devices, in a subprocess):
the item table's exchange buffers stay within 2x the rows it looks up."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.multidevice
def test_gem_sharded_item_exchange_is_within_twice_the_rows_looked_up(repo_root, tmp_path):
    out = tmp_path / "exchange.json"
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    proc = subprocess.run(
        [sys.executable, str(repo_root / "benchmarks" / "exchange_memory.py"), "--config", str(repo_root / "configs" / "gem_sharded.py"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=repo_root,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["devices"] == 32 and report["generation"] == "NODE_SPLIT" and report["capacity_factor"] == 1.25
    assert report["exchange_dtype"] == "bfloat16" and report["dim"] == 256
    # 166,656 ids per device (the token capacity), 13,531 per owner for 16 owners: 1.30x the real rows
    assert 1.0 < report["largest_exchange_ratio"] <= 2.0, report["largest_exchange_ratio"]
    row_buffers = [c for c in report["collectives"] if c["op"] == "all-to-all" and c["type"].startswith("bf16")]
    assert row_buffers and all(c["type"] == "bf16[2,8,13531,256]" for c in row_buffers), row_buffers
    assert not [c for c in report["collectives"] if c["op"] == "reduce-scatter"]  # no gpus_per_node x rows buffer
