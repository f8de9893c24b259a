"""benchmarks/fp8_gather_bytes.py on the configs/gem_sharded.py topology (32 fake CPU devices, in a subprocess):
quantizing FP8 kernels on the shard halves the bytes their all-gathers move."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.multidevice
def test_gem_sharded_fp8_kernels_gather_half_the_bytes_of_bf16(repo_root, tmp_path):
    out = tmp_path / "fp8.json"
    proc = subprocess.run(
        [sys.executable, str(repo_root / "benchmarks" / "fp8_gather_bytes.py"), "--config", str(repo_root / "configs" / "gem_sharded.py"), "--out", str(out)],
        env=dict(os.environ, PYTHONPATH=str(repo_root)), capture_output=True, text=True, timeout=600, cwd=repo_root,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["devices"] == 32 and report["compute_dtype"] == "bfloat16" and len(report["fp8_layers_on_shard"]) == 19
    # 19 bf16 kernel gathers over the zone's 16 GPUs become 8-bit data and scales (15 of them after a bf16 gather over `gpu`)
    assert report["gathered_first"]["by_type"] == {"bf16 over node/expert/gpu": {"count": 19, "bytes": report["gathered_first"]["bytes"]}}
    assert report["on_shard"]["by_type"]["u8 over node/expert"]["count"] == 30
    assert report["on_shard"]["by_type"]["u8 over node/expert/gpu"]["count"] == 8
    assert 0.5 < report["ratio"] < 0.52, report["ratio"]  # 1 byte per element instead of 2, plus scales and the inner gathers
