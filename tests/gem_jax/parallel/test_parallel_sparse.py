"""8 fake CPU devices, mesh (2,2,2): row-wise updates of a replicated table train as the dense path,
next to gen-3 / gen-2 sharded tables, which keep their dense shard gradients.

Runs in one subprocess (`parallel_worker.py sparse`), since this test process already
initialised jax with one device.
"""

import pytest

pytestmark = pytest.mark.multidevice


@pytest.fixture(scope="module")
def report(run_worker, tmp_path_factory):
    return run_worker("sparse", tmp_path_factory.mktemp("sparse"))


def test_only_the_replicated_table_with_few_ids_is_row_wise(report):
    assert report["tables"]["embed/user/user"] == "REPLICATED"
    assert report["tables"]["embed/item"] == "NODE_SPLIT"
    assert report["row_wise"] == ["embed/user/user"]


def test_row_wise_training_matches_the_dense_path(report):
    # float32 updates of the same rows from the same gradients, summed over <= 8 devices in other orders: a few u.
    assert report["state_err"] < 1e-6, report["worst"]
    sparse, dense = report["norms"]
    assert sparse == pytest.approx(dense, rel=1e-6)
