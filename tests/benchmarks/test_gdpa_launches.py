"""benchmarks/gdpa_launches.py files a GDPA forward's XLA kernels, from XLA's H200 compile, as work list or data."""

import importlib.util

import pytest

# A cut-down optimized module: an integer cumulative sum and a tuple of int32 and pred (work list),
# a bf16 tail window (data), and the thunk sequence that launches them and the GDPA kernel.
HLO = """\
ENTRY %main (qo.1: s32[257], k.1: bf16[136,4,128]) -> bf16[136,4,128] {
  %qo.1 = s32[257]{0} parameter(0)
  %k.1 = bf16[136,4,128]{2,1,0} parameter(1)
  %loop_reduce_window_fusion = s32[2,16]{1,0} fusion(%qo.1), kind=kLoop, calls=%fused_reduce_window
  %loop_add_broadcast_compare_fusion = (pred[2056]{0}, s32[2056,1]{1,0}) fusion(%qo.1), kind=kLoop, calls=%fused_compare
  %loop_select_fusion = bf16[136,4,128]{2,1,0} fusion(%k.1, %qo.1), kind=kLoop, calls=%fused_select
  ROOT %custom-call = bf16[136,4,128]{2,1,0} custom-call(%loop_select_fusion), custom_call_target="mosaic_gpu_v2"
}
"""
THUNKS = """\
001: kCustomKernel   [source         | next=002 (1)   ] loop_reduce_window_fusion grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel   [prev=001 (1)   | next=003 (1)   ] loop_add_broadcast_compare_fusion grid: [17, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
003: kCustomKernel   [prev=002 (1)   | next=004 (1)   ] loop_select_fusion grid: [544, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
004: kCustomCall     [prev=003 (1)   | sink           ] kCustomCall
"""


def _plugin_installed() -> bool:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None


@pytest.fixture
def launches(repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))  # it imports its siblings as `benchmarks.<name>`
    from benchmarks import gdpa_launches

    return gdpa_launches


def test_integer_kernels_are_the_work_list_and_the_rest_data(launches):
    got = launches.classify(HLO, THUNKS)
    assert got["kinds"] == {"kCustomKernel": 3, "kCustomCall": 1}
    assert got["work_list"] == {
        "loop_reduce_window_fusion": {"launches": 1, "result": "s32[2,16]"},
        "loop_add_broadcast_compare_fusion": {"launches": 1, "result": "(pred[2056], s32[2056,1])"},
    }
    assert got["data"] == {"loop_select_fusion": {"launches": 1, "result": "bf16[136,4,128]"}}


@pytest.mark.skipif(not _plugin_installed(), reason="the CUDA PJRT plugin is not installed")
def test_a_small_cross_forward_compiles_for_the_h200(launches, tmp_path):
    """Eight sequences of 136 queries over 64 keys: the GDPA kernel is one custom call, and its tail
    windows (bf16) are filed as data, its work list (integers) apart from them."""
    device = launches.offline_compile.h200_device()
    got = launches.classify(**launches.compile_forward(device, 8, 136, 64, False, str(tmp_path)))
    assert got["kinds"]["kCustomCall"] == 1
    assert got["work_list"] and all("bf16" not in k["result"] for k in got["work_list"].values())
    assert any(k["result"].startswith("(bf16") or k["result"].startswith("bf16") for k in got["data"].values())
