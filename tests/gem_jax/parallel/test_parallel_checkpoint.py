"""A checkpoint written on 8 devices restores onto 4 devices of another topology (target shardings passed)."""

import pytest

pytestmark = pytest.mark.multidevice


def test_checkpoint_from_8_devices_restores_onto_4(run_worker, tmp_path):
    report = run_worker("reshard", tmp_path, tmp_path / "ckpt")
    assert report["equal"], report  # every leaf of params and optimizer state, bit for bit
    assert report["target_shardings"], report
    assert report["restored_devices"] == [0, 1, 2, 3]
    assert report["item_spec"] == "P(('node', 'expert'), None)"  # gen 3 rows over the 4-device zone
    assert report["iterator_resumed"]
