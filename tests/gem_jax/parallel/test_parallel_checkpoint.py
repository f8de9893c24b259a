"""A checkpoint written on 8 devices restores onto 4 devices of another topology (target shardings passed);
the tables' row-wise Adagrad accumulators are sharded like their tables' rows on both; a state of bfloat16 weight
matrices (`OptimConfig.weights_dtype`) keeps the float32 state's shardings and restores alike."""

import pytest

pytestmark = pytest.mark.multidevice


@pytest.fixture(scope="module")
def report(run_worker, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reshard")
    return run_worker("reshard", tmp_path, tmp_path / "ckpt")


def test_checkpoint_from_8_devices_restores_onto_4(report):
    assert report["equal"], report  # every leaf of params and optimizer state, bit for bit
    assert report["target_shardings"], report
    assert report["restored_devices"] == [0, 1, 2, 3]
    assert report["item_spec"] == "P(('node', 'expert'), None)"  # gen 3 rows over the 4-device zone
    assert report["iterator_resumed"]


def test_row_accumulators_are_sharded_like_their_tables_rows(report):
    for mesh, tables in report["accumulators"].items():
        assert len(tables) >= 3, (mesh, tables)  # the item table and the user tables
        for name, acc in tables.items():
            where = (mesh, name, acc)
            assert acc["shape"][0] == acc["shape"][1][:-1] and acc["dtype"] == "float32", where
            assert acc["spec"] == acc["table_row_spec"], where
            assert acc["rows_follow_table"], where
    assert report["accumulators"]["4 devices"]["embed/item/embedding"]["spec"] == "P(('node', 'expert'),)"
    assert report["accumulators"]["8 devices"]["embed/item/embedding"]["spec"] != "P()"  # row-sharded there too


def test_bf16_weights_keep_their_shardings_and_restore_onto_another_mesh(report):
    r = report["bf16_weights"]
    assert r["narrow"] > 20 and r["sharded_narrow"] > 5, r  # FSDP-, expert- and HSDP-sharded matrices among them
    assert r["dtypes"] and r["shardings_as_float32"] and r["values_as_float32_cast"], r
    assert r["expert_biases_float32"] == ["cross_tower/dhen/0/mlp_expert/down_bias", "cross_tower/dhen/0/mlp_expert/up_bias"], r
    assert r["restored_equal"] and r["restored_target_shardings"], r
