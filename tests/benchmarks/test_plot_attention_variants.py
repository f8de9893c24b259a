"""benchmarks/plot_attention_variants.py: the bars it draws are the records' device_ms split at forward_ms."""

import json

import pytest

RECORD = {
    "device": "NVIDIA H100 80GB HBM3",
    "timing": {
        "block_local_pallas": {"device_ms": 2.0, "forward_ms": 0.5, "wall_ms": 2.1},
        "full_jfa_pallas": {"device_ms": 3.0, "wall_ms": 3.1},  # forward not timed
        "window_cudnn": {"skipped": "cuDNN needs an NVIDIA GPU"},
    },
}


def test_bars_are_device_ms_and_forward_ms_of_the_timed_variants(load_benchmark):
    plot = load_benchmark("plot_attention_variants")
    assert plot.bars(RECORD, "r.json") == [("block_local_pallas", 2.0, 0.5), ("full_jfa_pallas", 3.0, None)]
    assert plot.bars(RECORD, "r.json", ["full_jfa_pallas", "block_local_pallas"]) == [
        ("full_jfa_pallas", 3.0, None), ("block_local_pallas", 2.0, 0.5)]


def test_a_record_without_timing_or_variant_is_refused_naming_the_file(load_benchmark):
    plot = load_benchmark("plot_attention_variants")
    with pytest.raises(ValueError, match=r"r\.json: no 'timing'"):
        plot.bars({"device": "H100"}, "r.json")
    with pytest.raises(ValueError, match=r"r\.json: variant 'window_cudnn' not timed \(cuDNN needs"):
        plot.bars(RECORD, "r.json", ["window_cudnn"])
    with pytest.raises(ValueError, match=r"r\.json: variant 'nope' not timed \(absent\)"):
        plot.bars(RECORD, "r.json", ["nope"])


def test_key_selects_a_record_inside_the_file(load_benchmark, tmp_path):
    plot = load_benchmark("plot_attention_variants")
    other = {"device": "NVIDIA H200", "timing": {"block_local_pallas": {"device_ms": 1.0, "forward_ms": 0.25}}}
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"what": "two runs", "main": RECORD, "two_in_flight": other}))
    assert plot.read(f"two in flight={path}:two_in_flight") == ("two in flight", f"{path}:two_in_flight", other)
    label, source, record = plot.read(f"main={path}:main")
    assert (label, source, plot.bars(record, source)[0]) == ("main", f"{path}:main", ("block_local_pallas", 2.0, 0.5))
    with pytest.raises(ValueError, match="no top-level key 'missing'"):
        plot.read(f"x={path}:missing")
    single = tmp_path / "single.json"
    single.write_text(json.dumps(RECORD))
    assert plot.read(f"one={single}") == ("one", str(single), RECORD)


def test_main_writes_a_png(load_benchmark, tmp_path):
    plot = load_benchmark("plot_attention_variants")
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"main": RECORD, "two_in_flight": RECORD}))
    out = tmp_path / "figures" / "variants.png"
    plot.main([f"main={path}:main", f"two={path}:two_in_flight", "--variants", "block_local_pallas",
               "full_jfa_pallas", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
