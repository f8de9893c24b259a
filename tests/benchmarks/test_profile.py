"""The step profile's kernel classifier (benchmarks/_profile.py) on real GPU kernel names."""

import pytest


@pytest.fixture(scope="module")
def profile(load_benchmark):
    return load_benchmark("_profile")


# Names as CUPTI reported them on the H200 (cuBLAS, cuBLASLt, CUTLASS, cuDNN, NCCL, XLA, Pallas Mosaic GPU).
KERNELS = [
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "gemm_f32_tf32"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_TNN", "gemm"),
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_TNT", "gemm"),  # seen on the H200: bf16, not float32
    ("nvjet_sm90_sss_128x128_64x4_1x2_h_bz_NNT", "gemm_f32_tf32"),
    ("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x1x1_0_tnn_align8_warpspecialized_cooperative_epi_tma", "gemm"),
    ("cutlass3x_sm90_tensorop_s64x128x8tf32gemm_f32_f32_f32_f32_128x128x32_1x2x1_0_tnn_align4", "gemm_f32_tf32"),
    ("cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, false, false>", "gemm"),
    ("gemm_fusion_dot_17", "gemm"),
    ("gdpa_fwd_mosaic_gpu_kernel", "pallas"),
    ("gdpa_bwd_dkv_mosaic_gpu_kernel", "pallas"),
    ("entry_mosaic_gpu_kernel", "pallas"),
    ("mosaic_gpu_kernel", "pallas"),
    ("qk_norm_rope_forward", "pallas"),  # Triton-lowered Pallas kernels carry the function's name
    ("qk_norm_rope_backward", "pallas"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "cudnn"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "collectives"),
    ("input_transpose_fusion_12", "transposes"),
    ("wrapped_transpose", "transposes"),
    ("loop_add_fusion_3", "xla_fusions"),
    ("loop_broadcast_select_fusion_2", "xla_fusions"),
    ("input_concatenate_fusion_1", "xla_fusions"),
    ("wrapped_iota", "xla_fusions"),
    ("input_reduce_fusion_7", "reductions"),
    ("input_clamp_maximum_negate_reduce_fusion", "reductions"),
    ("loop_reduce_window_fusion_4", "reductions"),
    ("input_scatter_fusion_3", "gather_scatter"),
    ("loop_gather_fusion_1", "gather_scatter"),
    ("loop_dynamic_update_slice_fusion", "gather_scatter"),
    ("dynamic_slice_fusion_2", "gather_scatter"),
    ("rms_norm_forward__1", "pallas"),
    ("rms_norm_backward__11", "pallas"),
    ("sort_87_1__4", "other"),
    ("memcpy32_post", "other"),
]


@pytest.mark.parametrize("name, group", KERNELS)
def test_classify_real_kernel_names(profile, name, group):
    assert profile.classify(name) == group


def test_breakdown_sums_groups_and_ranks_kernels_by_total_time(profile):
    kernels = [("loop_add_fusion_3", 0.5), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 2.0), ("loop_add_fusion_3", 0.25), ("input_reduce_fusion_7", 1.0)]
    result = profile.breakdown(kernels, top=2)
    assert result["device_ms"] == pytest.approx(3.75) and result["num_kernels"] == 4
    assert set(result["groups_ms"]) == set(profile.GROUPS)
    assert result["groups_ms"]["gemm"] == 2.0 and result["groups_ms"]["xla_fusions"] == 0.75 and result["groups_ms"]["reductions"] == 1.0
    assert sum(result["groups_ms"].values()) == pytest.approx(result["device_ms"])
    assert result["top_kernels"] == [
        {"name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "group": "gemm", "calls": 1, "ms": 2.0},
        {"name": "input_reduce_fusion_7", "group": "reductions", "calls": 1, "ms": 1.0},
    ]
    assert "GEMM (bf16/fp8)" in profile.format_breakdown(result)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_breakdown_rejects_bad_times(profile, bad):
    with pytest.raises(ValueError, match="loop_add_fusion"):
        profile.breakdown([("loop_add_fusion", bad)])


def test_idle_between_kernels_counts_each_gap_once_across_streams_and_names_what_follows(profile):
    gemm = "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_TNT"
    activities = [  # (name, start us, duration us), out of order, two streams overlapping
        ("loop_add_fusion", 0.0, 10.0),
        ("input_reduce_fusion", 5.0, 20.0),  # overlaps the first: busy 0-25
        ("Memset 0", 85.0, 0.0),  # an empty activity where the GEMM starts: the GEMM is named after the gap
        ("MemcpyD2D", 102.0, 4.0),  # inside the GEMM's run
        (gemm, 85.0, 100.0),  # 60 us gap before the GEMM
        ("loop_convert_fusion", 100.0, 10.0),  # inside the GEMM's run
        ("gdpa_fwd_mosaic_gpu_kernel", 190.0, 10.0),  # 5 us gap after the GEMM (ends at 185)
        ("rms_norm_forward", 310.0, 30.0),  # 110 us gap (the Mosaic kernel ends at 200)
    ]
    result = profile.idle_between_kernels(activities, top=2)
    assert result["span_ms"] == pytest.approx(0.340) and result["busy_ms"] == pytest.approx(0.165)
    assert result["idle_ms"] == pytest.approx(0.175) and result["gaps"] == 3
    assert result["gaps_over_us"] == {10: 2, 50: 2, 100: 1}
    assert result["idle_by_next_group_ms"]["gemm"] == pytest.approx(0.060)
    assert result["idle_by_next_group_ms"]["pallas"] == pytest.approx(0.115)  # 5 + 110 us
    assert sum(result["idle_by_next_group_ms"].values()) == pytest.approx(result["idle_ms"])
    assert result["memsets"] == {"count": 1, "ms": 0.0} and result["copies"] == {"count": 1, "ms": pytest.approx(0.004)}
    assert result["longest_gaps"] == [
        {"us": 110.0, "before": "gdpa_fwd_mosaic_gpu_kernel", "after": "rms_norm_forward"},
        {"us": 60.0, "before": "input_reduce_fusion", "after": gemm},
    ]
    assert "idle 0.17" in profile.format_idle(result)


@pytest.mark.parametrize("activities", [[], [("loop_add_fusion", 0.0, float("nan"))], [("loop_add_fusion", 0.0, -1.0)]])
def test_idle_between_kernels_rejects_an_empty_or_bad_timeline(profile, activities):
    with pytest.raises(ValueError, match="loop_add_fusion" if activities else "no device activities"):
        profile.idle_between_kernels(activities)
