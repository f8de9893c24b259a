"""benchmarks/offline_compile.py reads a GPU compile's kernels: launches from the thunk sequence, bytes and
kinds from the optimized HLO, measured times joined from a profile, and what changed between two compiles."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from stand_in_gpu import Hopper

import pallas_kernels
from pallas_kernels._src import dispatch

# The shapes of XLA's text, cut down: an entry with a loop fusion, a deduplicated copy of it, a Triton
# fusion and a cuBLAS GEMM, and the thunk sequence that runs it.
HLO = """\
HloModule jit_step, entry_computation_layout={(bf16[1024,512]{1,0}, bf16[512,256]{1,0})->f32[1024,256]{1,0}}

%fused_add (param_0: bf16[1024,256], param_1: f32[256]) -> f32[1024,256] {
  %param_0 = bf16[1024,256]{1,0} parameter(0)
  ROOT %add = f32[1024,256]{1,0} add(%param_0, %param_0), metadata={op_name="jit(step)/add" stack_frame_id=1}
}

%fused_reduce (param_0.1: f32[1024,256]) -> (f32[1024], bf16[1024,256]) {
  %param_0.1 = f32[1024,256]{1,0} parameter(0)
  ROOT %tuple = (f32[1024]{0}, bf16[1024,256]{1,0}) tuple(%param_0.1, %param_0.1)
}

ENTRY %main (x.1: bf16[1024,512], w.1: bf16[512,256]) -> f32[1024,256] {
  %x.1 = bf16[1024,512]{1,0} parameter(0)
  %w.1 = bf16[512,256]{1,0} parameter(1)
  %bias.1 = f32[256]{0} parameter(2)
  %custom-call.1 = bf16[1024,256]{1,0} custom-call(%x.1, %w.1), custom_call_target="__cublas$lt$matmul", backend_config={"epilogue":"DEFAULT"}
  %loop_add_fusion.3 = f32[1024,256]{1,0} fusion(%custom-call.1, /*index=1*/%bias.1), kind=kLoop, calls=%fused_add
  %loop_add_fusion.4 = f32[1024,256]{1,0} fusion(%custom-call.1, %bias.1), kind=kLoop, calls=%fused_add, metadata={deduplicated_name="loop_add_fusion.3"}
  %input_reduce_fusion = (f32[1024]{0}, bf16[1024,256]{1,0}) fusion(%loop_add_fusion.3), kind=kCustom, calls=%fused_reduce, backend_config={"fusion_backend_config":{"kind":"__triton","block_level_fusion_config":{}}}
  ROOT %sort.1 = f32[1024,256]{1,0} sort(%loop_add_fusion.4), dimensions={1}
}
"""

THUNKS = """\
001: kCublasLtMatmul [source         | next=002 (1)   ] kCublasLtMatmul
002: kCustomKernel   [prev=001 (1)   | next=003 (1)   ] loop_add_fusion_3 grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
003: kCustomKernel   [prev=002 (1)   | next=004 (1)   ] loop_add_fusion_3 grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
004: kCustomKernel   [prev=003 (1)   | sink           ] input_reduce_fusion grid: [1024, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
005: kCustomCall     [prev=004 (1)   | sink           ] kCustomCall
"""

MIB = 1 << 20
ADD_BYTES = MIB // 2 + 1024 + MIB  # bf16 [1024,256] and f32 [256] in, f32 [1024,256] out
REDUCE_BYTES = MIB + 4096 + MIB // 2  # f32 [1024,256] in; f32 [1024] and bf16 [1024,256] out


@pytest.fixture
def offline(repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root))  # it imports its siblings as `benchmarks.<name>`
    from benchmarks import offline_compile

    return offline_compile


def test_launches_count_every_kernel_launch_and_its_grid(offline):
    kinds, kernels = offline.launches(THUNKS)
    assert kinds == {"kCublasLtMatmul": 1, "kCustomKernel": 3, "kCustomCall": 1}
    assert kernels == {
        "loop_add_fusion_3": {"launches": 2, "grid": [512, 1, 1], "threads": [128, 1, 1]},
        "input_reduce_fusion": {"launches": 1, "grid": [1024, 1, 1], "threads": [256, 1, 1]},
    }


def test_fusion_bytes_kinds_and_gemm_types_are_read_from_the_hlo(offline):
    types, fusions = offline.instructions(HLO)
    assert types["custom-call.1"] == "bf16[1024,256]"
    assert fusions["loop_add_fusion_3"] == {"kind": "kLoop", "result": "f32[1024,256]", "bytes": ADD_BYTES}
    assert fusions["input_reduce_fusion"] == {"kind": "__triton", "result": "(f32[1024], bf16[1024,256])", "bytes": REDUCE_BYTES}
    assert offline.gemms(HLO, types) == ({"bf16 x bf16 -> bf16": 1}, MIB // 2)


def test_kernel_table_orders_kernels_by_bytes_moved_and_joins_a_profile(offline):
    table = offline.kernel_table(HLO, THUNKS)
    assert (table["sorts"], table["gemm_output_bytes"]) == (1, MIB // 2)
    assert table["fusion_bytes"] == 2 * ADD_BYTES + REDUCE_BYTES
    assert [k["name"] for k in table["kernels"]] == ["loop_add_fusion_3", "input_reduce_fusion"]
    profile = {"git_commit": "abc", "runs": [{"profile": {"top_kernels": [
        {"name": "loop_add_fusion_3", "calls": 2, "ms": 0.002},
        {"name": "input_reduce_fusion", "calls": 1, "ms": 0.004},
        {"name": "nvjet_sm90_tst_128x128", "calls": 1, "ms": 1.0},
    ]}}]}
    joined = offline.join_profile(table["kernels"], profile)
    add, reduce = table["kernels"]
    assert add["tb_per_s"] == pytest.approx(2 * ADD_BYTES / 2e-6 / 1e12)
    assert reduce["tb_per_s"] == pytest.approx(REDUCE_BYTES / 4e-6 / 1e12)
    groups = offline.by_source(table["kernels"])  # no source locations in this text: one group, "?"
    assert [(g["ms"], g["bytes"], g["launches"], g["kernels"]) for g in groups] == [
        (pytest.approx(0.006), 2 * ADD_BYTES + REDUCE_BYTES, 3, ["loop_add_fusion_3", "input_reduce_fusion"])
    ]
    assert joined == {"matched": 2, "median_tb_per_s": pytest.approx((add["tb_per_s"] + reduce["tb_per_s"]) / 2), "measured_ms": pytest.approx(0.006), "profile_commit": "abc", "unmatched": []}


def test_compare_predicts_the_step_change_from_the_fusion_bytes_that_went(offline):
    old = {**offline.kernel_table(HLO, THUNKS), "memory": {"peak": 10_000}, "profile": {"median_tb_per_s": 2.0}}
    fewer = THUNKS.replace("003: kCustomKernel   [prev=002 (1)   | next=004 (1)   ] loop_add_fusion_3", "003: kCopy   [prev=002 (1)   | next=004 (1)   ] kCopy")
    new = {**offline.kernel_table(HLO, fewer), "memory": {"peak": 9_000}}
    new["gemm_output_bytes"] += MIB  # e.g. an epilogue that took the fusion over writes a second output
    change = offline.compare(new, old)
    assert (change["fusion_bytes_change"], change["gemm_output_bytes_change"]) == (-ADD_BYTES, MIB)
    assert change["predicted_ms_change"] == pytest.approx((MIB - ADD_BYTES) / 2e12 * 1e3)
    assert change["launches_change"] == {"kCublasLtMatmul": 0, "kCustomKernel": -1, "kCustomCall": 0, "kCopy": 1}
    assert change["peak_memory_change"] == -1_000
    assert [c["name"] for c in change["largest_changes"]] == ["loop_add_fusion_3"]


def test_ops_decide_for_the_compiling_for_device_inside_the_block():
    assert dispatch.default_device() is jax.devices()[0]
    with pallas_kernels.compiling_for(Hopper()):
        assert dispatch.default_device().device_kind == "NVIDIA H200"
        assert dispatch.is_hopper_gpu()
        from pallas_kernels._src import mgpu_common

        assert mgpu_common.sm_count() == 132
    assert dispatch.default_device() is jax.devices()[0]


def _plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def test_a_profile_joins_only_kernels_of_the_same_launch_count_and_overcounted_bytes_stay_out_of_the_median(offline):
    kernels = [
        {"name": "a", "launches": 2, "bytes": 10**9},
        {"name": "b", "launches": 1, "bytes": 10**9},
        {"name": "c", "launches": 1, "bytes": 10**10},
        {"name": "d", "launches": 1, "bytes": 4 * 10**9},
    ]
    measured = [{"name": "a", "calls": 2, "ms": 1.0}, {"name": "b", "calls": 3, "ms": 1.0}, {"name": "c", "calls": 1, "ms": 1.0}, {"name": "d", "calls": 1, "ms": 2.0}]
    joined = offline.join_profile(kernels, {"runs": [{"profile": {"top_kernels": measured}}]})
    a, b, c, d = kernels
    assert (a["tb_per_s"], d["tb_per_s"]) == (pytest.approx(2.0), pytest.approx(2.0))
    assert "ms" not in b and joined["unmatched"] == ["b"]  # another launch count: another fusion of the same name
    assert c["tb_per_s"] == pytest.approx(10.0) and c["bytes_overcounted"]  # above the 4.8 TB/s peak
    assert (joined["matched"], joined["median_tb_per_s"], joined["measured_ms"]) == (3, pytest.approx(2.0), pytest.approx(4.0))


def test_bad_inputs_are_refused_before_anything_compiles(offline, repo_root, tmp_path, capsys):
    config = str(repo_root / "configs" / "gem_h200_tiny.py")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"config": "configs/gem_h200.py", "overrides": [], "runs": [{"profile": {"top_kernels": []}}]}))
    cases = [
        (["--xla", "foo"], "KEY=VALUE"),
        (["--compare", str(tmp_path / "missing.json")], "missing.json"),
        (["--compare", str(profile)], "has no 'kernels'"),
        (["--profile", str(profile)], "kernel names are only comparable within one program"),
        (["--config", str(repo_root / "configs" / "gem_sharded_tiny.py")], "runs on 8 devices"),
    ]
    for extra, message in cases:
        assert offline.main(["--config", config, *extra]) == 2
        assert message in capsys.readouterr().err


def test_xla_flag_values_become_typed_compile_options(offline):
    assert [offline.option_value(v) for v in ("true", "False", "134217728", "0.5", "/tmp/x")] == [True, False, 134217728, 0.5, "/tmp/x"]
    assert offline.project_xla_options()["xla_gpu_enable_triton_gemm"] is False  # gem_jax.xla_options's, as training sets them


@pytest.mark.skipif(not _plugin_installed(), reason="the CUDA PJRT plugin is not installed")
def test_a_program_compiles_for_the_h200_without_one(offline, tmp_path):
    device = offline.h200_device()
    assert (device.platform, device.device_kind, device.core_count) == ("gpu", "NVIDIA H200", 132)
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=sharding)
    compiled = jax.jit(lambda a, b: (a @ b.T + 1.0).astype(jnp.bfloat16)).lower(x, x).compile(
        compiler_options={"xla_dump_to": str(tmp_path), "xla_gpu_enable_triton_gemm": False}  # as gem_jax.xla_options sets it
    )
    (thunks,) = tmp_path.glob("*thunk_sequence.txt")
    table = offline.kernel_table(compiled.as_text(), thunks.read_text())
    assert (table["gemms"], table["gemm_output_bytes"]) == ({"bf16 x bf16 -> bf16": 1}, 4096 * 4096 * 2)
    assert table["thunks"] == {"kCublasLtMatmul": 1, "kCustomKernel": 1}
    (add,) = table["kernels"]  # the + 1 and the cast after the GEMM: one pass, bf16 [4096, 4096] in and out
    assert (add["kind"], add["launches"], add["bytes"]) == ("kLoop", 1, 2 * 4096 * 4096 * 2)
    assert add["grid"][0] * add["threads"][0] * 4 == 4096 * 4096  # four elements a thread (vectorised)


@pytest.mark.skipif(not _plugin_installed(), reason="the CUDA PJRT plugin is not installed")
def test_xla_splits_a_bias_gradient_over_a_rounded_capacity_without_padding_and_fuses_it(offline):
    """The sum over tokens of a GELU's input gradient, beside the gradient itself: at a capacity of
    `round_capacity` XLA's tree-reduction rewriter finds an exact split and computes both in one pass;
    at 166528 rows (128 * 1301, the capacity a multiple of 128 gave) it pads and reduces in a pass of its own."""
    from gem_jax.jagged import capacity_multiple, round_capacity

    sharding = jax.sharding.SingleDeviceSharding(offline.h200_device())
    options = offline.project_xla_options()

    def gelu_input_gradient_and_bias_gradient(x, dy):
        dx = jax.vjp(jax.nn.gelu, x)[1](dy)[0]
        return dx, jnp.sum(dx.astype(jnp.float32), axis=0)

    def compiled(rows: int) -> str:
        x = jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16, sharding=sharding)
        return jax.jit(gelu_input_gradient_and_bias_gradient).lower(x, x).compile(compiler_options=options).as_text()

    def gradient_fusions(text: str, rows: int) -> list[str]:
        """The names of the fusions that write the `[rows, 512]` gradient."""
        return [line.split(" = ")[0].strip() for line in text.splitlines() if f"bf16[{rows},512]" in line and " fusion(" in line]

    padded = compiled(166528)
    assert " pad(" in padded
    (alone,) = gradient_fusions(padded, 166528)
    assert "reduce" not in alone  # the gradient in a pass of its own; a reduction reads it again
    # Worst cases: a capacity multiple times a prime (no other divisor), from 16 thousand to 4 million rows.
    for rows in (166528, 256 * 1021, 512 * 2039, 1024 * 4093, 128 * 131, 24_000, 3_000_001):
        capacity = round_capacity(rows)
        text = compiled(capacity)
        assert " pad(" not in text, (rows, capacity, capacity_multiple(capacity))
        fusions = gradient_fusions(text, capacity)
        assert len(fusions) == 1 and "reduce" in fusions[0], (capacity, fusions)  # dx and the first partial sums, one kernel


# Pallas kernels as XLA's text shows them: Triton and Mosaic GPU custom calls named by the op path that traced them,
# one taking a cuBLAS GEMM's output as `name#0` (element 0 of its tuple result, beside the workspace).
KERNELS_HLO = """\
ENTRY %main (x.1: bf16[1024,512], w.1: bf16[512,256], s.1: f32[256]) -> bf16[1024,256] {
  %x.1 = bf16[1024,512]{1,0} parameter(0)
  %w.1 = bf16[512,256]{1,0} parameter(1)
  %s.1 = f32[256]{0} parameter(2)
  %cublas-lt-matmul.1 = (bf16[1024,256]{1,0}, s8[4194304]{0}) custom-call(%x.1, %w.1), custom_call_target="__cublas$lt$matmul"
  %pallas_call.1 = bf16[1024,256]{1,0} custom-call(%cublas-lt-matmul.1#0, %s.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp()/rms_norm_forward/pallas_call"}
  %pallas_call.2 = bf16[1024,256]{1,0} custom-call(%pallas_call.1, %s.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp()/rms_norm_forward/pallas_call"}
  ROOT %mosaic.1 = bf16[1024,256]{1,0} custom-call(%pallas_call.2), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/jvp()/jit(gdpa)/gdpa_fwd/mpmd_map"}
}
"""


def test_pallas_kernels_are_counted_by_op_with_their_operands_and_results(offline):
    types, _ = offline.instructions(KERNELS_HLO)
    assert offline._operand_type(types, "cublas-lt-matmul.1#0") == "bf16[1024,256]" and offline._operand_type(types, "cublas-lt-matmul.1#1") == "s8[4194304]"
    assert offline._operand_type(types, "cublas-lt-matmul.1#2") == "" and offline._operand_type(types, "missing") == ""
    assert offline.pallas_kernels(KERNELS_HLO, types) == [
        {"name": "jvp()/rms_norm_forward", "calls": 2, "bytes": 2 * (MIB + 1024)},  # bf16 [1024,256] in and out, the f32 scale
        {"name": "jvp()/jit(gdpa)/gdpa_fwd", "calls": 1, "bytes": MIB},
    ]
    assert offline.gemms(KERNELS_HLO, types) == ({"bf16 x bf16 -> bf16": 1}, MIB // 2)


def test_compare_adds_the_pallas_kernels_bytes_when_both_records_have_them(offline):
    base = {**offline.kernel_table(HLO, THUNKS), "memory": {"peak": 0}, "profile": {"median_tb_per_s": 2.0}}
    with_kernels = {**base, "pallas_kernel_bytes": 3 * MIB, "profile": None}
    assert offline.compare(with_kernels, {**base, "pallas_kernel_bytes": MIB})["predicted_ms_change"] == pytest.approx(2 * MIB / 2e12 * 1e3)
    older = {key: value for key, value in base.items() if key != "pallas_kernel_bytes"}  # a record from before the count
    change = offline.compare(with_kernels, older)
    assert change["pallas_kernel_bytes_change"] is None and change["predicted_ms_change"] == 0
