"""8 fake CPU devices, meshes (2,2,2) and (1,2,4): the embedding exchange sends only real ids (no slack rows,
no padding ids), does not overflow at capacity factor 1 when the real ids fit, and its bounded rounds give the
worst-case exchange's rows and gradients. The FP8 model's sharded step (kernels exchanged in 8 bits) is checked
in `test_parallel_exchange.py`: a file of its own, so that pytest-xdist's `--dist loadfile` can run the two
workers' subprocesses side by side.

The checks run in a subprocess (`exchange_worker.py exchange`), since this test process already
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
        # Padding rows are table[0], slack rows zero; a table gradient sums <= 8 devices' rows: gamma_8 = 5e-7.
        assert c["rows_equal"] and c["grad_err"] < 1e-6, c
        assert c["overflow"] == 0 and c["out_of_range"] == 0, c  # sending the slack or the padding ids would overflow
        assert c["sent_bytes"] == c["one_round_bytes"], c


@pytest.mark.parametrize("mesh", MESHES)
def test_bounded_rounds_equal_the_worst_case_exchange(report, mesh):
    for c in report[mesh]["rounds"]:
        assert c["rows_equal_worst_case"] and c["rows_equal_gather"], c
        assert c["grad_err_worst_case"] < 1e-6 and c["grad_err"] < 1e-6, c  # as above: float32 sums of <= 8 rows
        assert c["overflow"] == c["expected_overflow"] > 0 and c["worst_case_overflow"] == 0, c
        assert c["sent_rows"] == c["expected_sent_rows"], c
        assert c["sent_bytes"] == c["expected_sent_bytes"] > 0, c
