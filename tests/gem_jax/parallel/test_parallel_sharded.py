"""8 fake CPU devices, meshes (2,2,2) and (1,2,4): sharded lookups (gen 1/2/3), the expert layer and the
whole model's forward, loss and gradients equal the single-device results.

The checks run in one subprocess (`parallel_worker.py equivalence`), since this test
process already initialised jax with one device.
"""

import pytest

MESHES = ["2x2x2", "1x2x4"]

pytestmark = pytest.mark.multidevice


@pytest.fixture(scope="module")
def report(run_worker, tmp_path_factory):
    return run_worker("equivalence", tmp_path_factory.mktemp("equivalence"))


@pytest.mark.parametrize("mesh", MESHES)
def test_lookup_of_every_generation_matches_the_gather(report, mesh):
    seen = set()
    for check in report[mesh]["lookup"]:
        assert check["effective"] == check["generation"], check
        assert check["rows_err"] < 1e-6 and check["grad_err"] < 1e-6, check
        assert check["finite"] and check["out_of_range"] == 3, check
        if check["capacity_factor"] is None:
            assert check["overflow"] == 0, check
        else:
            assert check["overflow"] > 0, check  # forced overflow, served by further rounds
        seen.add(check["generation"])
    assert seen == {"GLOBAL", "GROUP", "NODE_SPLIT"}


@pytest.mark.parametrize("mesh", MESHES)
def test_expert_layer_matches_one_device(report, mesh):
    experts = report[mesh]["experts"]
    assert experts["local_experts"] == 2  # 4 experts over 2 expert slots
    assert experts["up_kernel_spec"].startswith("P('expert'")
    for key in ("loss_err", "out_err", "grad_err"):
        assert experts[key] < 1e-5, experts


@pytest.mark.parametrize("mesh", MESHES)
def test_model_forward_loss_and_gradients_match_one_device(report, mesh):
    model = report[mesh]["model"]
    assert model["loss_err"] < 1e-5 and model["logits_err"] < 1e-5, model
    assert model["grad_err"] < 1e-3, model
    assert model["out_of_range"] == 0 and model["expert_local"] == 2 and model["grad_shardings_match"]


def test_the_two_meshes_cover_every_generation_and_an_overflow(report):
    tables = report["2x2x2"]["model"]["tables"]
    assert tables["embed/item"] == "NODE_SPLIT" and tables["embed/user/user"] == "GROUP" and tables["embed/action"] == "REPLICATED"
    assert report["1x2x4"]["model"]["tables"]["embed/item"] == "GLOBAL"
    assert report["1x2x4"]["model"]["overflow"]["embed/item/overflow"] > 0
