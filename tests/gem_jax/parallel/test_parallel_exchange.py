"""8 fake CPU devices, meshes (2,2,2) and (1,2,4): the embedding exchange sends only real ids (no slack rows,
no padding ids), does not overflow at capacity factor 1 when the real ids fit, and its bounded rounds give the
worst-case exchange's rows and gradients; the FP8 model's sharded step quantizes its kernels on the shard and
all-gathers 8-bit data, and matches the unsharded FP8 step.

The checks run in subprocesses (`exchange_worker.py exchange` and `fp8`), since this test process already
initialised jax with one device.
"""

from pathlib import Path

import pytest

MESHES = ["2x2x2", "1x2x4"]
WORKER = Path(__file__).with_name("exchange_worker.py")

pytestmark = pytest.mark.multidevice


@pytest.fixture(scope="module")
def report(run_worker, tmp_path_factory):
    return run_worker("exchange", tmp_path_factory.mktemp("exchange"), worker=WORKER)


@pytest.mark.parametrize("mesh", MESHES)
def test_slack_rows_and_padding_ids_are_never_sent(report, mesh):
    checks = report[mesh]["slack"]
    assert {c["generation"] for c in checks} == {"GLOBAL", "GROUP", "NODE_SPLIT"}
    for c in checks:
        assert c["slack_rows"] > 0 and c["sent_rows"] == c["real_non_padding_rows"], c
        assert c["rows_equal"] and c["grad_err"] < 1e-6, c  # padding rows are table[0], slack rows zero
        assert c["overflow"] == 0 and c["out_of_range"] == 0, c  # sending the slack or the padding ids would overflow
        assert c["sent_bytes"] == c["one_round_bytes"], c


@pytest.mark.parametrize("mesh", MESHES)
def test_bounded_rounds_equal_the_worst_case_exchange(report, mesh):
    for c in report[mesh]["rounds"]:
        assert c["rows_equal_worst_case"] and c["rows_equal_gather"], c
        assert c["grad_err_worst_case"] < 1e-6 and c["grad_err"] < 1e-6, c
        assert c["overflow"] == c["expected_overflow"] > 0 and c["worst_case_overflow"] == 0, c
        assert c["sent_rows"] == c["expected_sent_rows"], c
        assert c["sent_bytes"] == c["expected_sent_bytes"] > 0, c


@pytest.fixture(scope="module")
def fp8_report(run_worker, tmp_path_factory):
    return run_worker("fp8", tmp_path_factory.mktemp("fp8"), worker=WORKER)


@pytest.mark.parametrize("mesh", MESHES)
def test_fp8_kernels_are_quantized_on_the_shard_and_gathered_in_8_bits(fp8_report, mesh):
    r = fp8_report[mesh]
    assert r["fp8_layers"] == 14 and len(r["gathers"]) == 14, r["gathers"]
    expected_axes = {"2x2x2": [["node", "expert"]], "1x2x4": [["node", "expert"], ["node", "expert", "gpu"]]}[mesh]
    assert all(g["axes"] in expected_axes for g in r["gathers"].values()), r["gathers"]  # 1x2x4: d=128 / 8 GPUs < a block
    assert len(r["kernels_gathered_in_8_bits"]) == 14 and r["u8_all_gathers"] == 28  # data and scales of each
    assert r["kernels_checked_for_float_gathers"] >= 8 and r["kernels_gathered_in_float"] == [], r


@pytest.mark.parametrize("mesh", MESHES)
def test_fp8_sharded_step_matches_the_unsharded_fp8_step(fp8_report, mesh):
    r = fp8_report[mesh]
    # Against one device: the activations' 32x32 tiles group other rows (per-device batches).
    assert r["loss_err"] < 1e-4 and r["logits_err"] < 1e-3 and r["grad_err"] < 0.04, r


def test_fp8_on_the_shard_is_bit_identical_to_gathering_first(fp8_report):
    r = fp8_report["1x2x4"]
    assert r["logits_equal_gathered_first"] and r["loss_equal_gathered_first"], r
    assert r["grad_err_gathered_first"] < 1e-6, r  # the reduce-scatter split in two: another summation order
