"""Two CPU processes through `jax.distributed` on loopback (gloo): train, checkpoint, restore, replay."""

import json
import socket

import numpy as np
import pytest

pytestmark = pytest.mark.multidevice


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_checkpoint_and_restore(start_worker, tmp_path):
    port = free_port()
    procs, outs = [], []
    for pid in range(2):
        out = tmp_path / f"process{pid}.json"
        procs.append(
            start_worker(
                "process", out, tmp_path / "ckpt", devices=2,
                GEM_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", GEM_NUM_PROCESSES="2", GEM_PROCESS_ID=str(pid),
            )
        )
        outs.append(out)
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    reports = [json.loads(o.read_text()) for o in outs]
    for pid, r in enumerate(reports):
        assert r["source"] == "explicit" and r["process_index"] == pid and r["process_count"] == 2
        assert r["devices"] == 4 and r["local_devices"] == 2
        assert len(r["losses"]) == 3 and np.isfinite(r["losses"]).all()
        assert r["replay"] == r["losses"][2:]  # step 3 after restoring step 2: bit-exact
    assert reports[0]["losses"] == reports[1]["losses"]  # one global computation
