"""scripts/kernel_resources.py: ptxas's verbose report parses into one record per kernel, `--compare`
fails when a kernel's registers or spills grow (or a case cannot be compared) and not otherwise, and
a real case compiles for the compile-only H200 with its ptxas report read back."""

import json

import pytest

# Two kernels as jaxlib prints them with MOSAIC_GPU_DUMP_PTXAS=1, with a line of other output between them.
REPORT = """\
ptxas warning : Registers are spilled to local memory in function 'kernel_mosaic_gpu_kernel', 984 bytes spill stores, 1168 bytes spill loads
ptxas info    : 24 bytes gmem
ptxas info    : Compiling entry function 'kernel_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for kernel_mosaic_gpu_kernel
    552 bytes stack frame, 984 bytes spill stores, 1168 bytes spill loads
ptxas info    : Used 255 registers, used 16 barriers, 552 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compile time = 889.973 ms

compiled
ptxas info    : 24 bytes gmem
ptxas info    : Compiling entry function 'kernel_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for kernel_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 176 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 531.138 ms
"""


@pytest.fixture(scope="module")
def resources(load_script):
    return load_script("kernel_resources")


def _kernel(registers=168, spill_stores=0, spill_loads=0, stack=0, barriers=16) -> dict:
    return {"function": "entry_mosaic_gpu_kernel", "arch": "sm_90a", "registers": registers, "barriers": barriers,
            "stack_bytes": stack, "spill_store_bytes": spill_stores, "spill_load_bytes": spill_loads}


def test_a_ptxas_report_parses_into_a_record_per_kernel(resources):
    spilling, clean = resources.parse_ptxas(REPORT)
    assert spilling == {"function": "kernel_mosaic_gpu_kernel", "arch": "sm_90a", "registers": 255, "barriers": 16,
                        "stack_bytes": 552, "spill_store_bytes": 984, "spill_load_bytes": 1168}
    assert clean == {"function": "kernel_mosaic_gpu_kernel", "arch": "sm_90a", "registers": 176, "barriers": 2,
                     "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}
    assert resources.parse_ptxas("compiled\n") == []


def test_a_kernel_without_barriers_has_zero_and_an_incomplete_report_is_refused(resources):
    without_barriers = REPORT.split("compiled\n")[1].replace(", used 2 barriers", "")
    assert resources.parse_ptxas(without_barriers)[0]["barriers"] == 0
    with pytest.raises(ValueError, match="kernel 1 .* has no registers"):
        resources.parse_ptxas(REPORT.replace("Used 176 registers", "Used registers"))
    with pytest.raises(ValueError, match="stack_bytes"):
        resources.parse_ptxas(REPORT.replace("0 bytes stack frame", "stack frame"))


def test_the_table_has_a_line_per_kernel_and_says_why_a_case_has_none(resources):
    results = {"jfa_d64": {"kernels": [_kernel(), _kernel(spill_stores=8)]}, "gdpa_gelu_d64": {"kernels": []},
               "mxfp8_matmul_k128": {"error": "RuntimeError: no"}}
    lines = [resources.heading(17)] + [line for case, result in results.items() for line in resources.rows(case, result, 17)]
    assert lines[0].split() == ["case", "kernel", "registers", "barriers", "stack", "B", "spill", "stores", "B", "spill",
                                "loads", "B"]
    assert [line.split() for line in lines[1:3]] == [["jfa_d64", "0", "168", "16", "0", "0", "0"],
                                                     ["jfa_d64", "1", "168", "16", "0", "8", "0"]]
    assert lines[3:] == [f"{'gdpa_gelu_d64':17s} no Mosaic GPU kernel", f"{'mxfp8_matmul_k128':17s} ERROR RuntimeError: no"]


def test_compare_fails_when_registers_or_spills_grow(resources):
    before = {"jfa_d64": {"kernels": [_kernel(), _kernel(spill_stores=8, spill_loads=8)]}}
    lines, fails = resources.compare(before, before)
    assert not fails and lines == ["2 of 2 kernels use the same registers, barriers, stack and spills"]

    grown = {"jfa_d64": {"kernels": [_kernel(), _kernel(spill_stores=16, spill_loads=8, stack=8)]}}
    lines, fails = resources.compare(before, grown)
    assert fails and lines[0] == "GREW jfa_d64 kernel 1: stack B 0 -> 8, spill stores B 8 -> 16"
    assert resources.compare(before, {"jfa_d64": {"kernels": [_kernel(registers=176), _kernel(spill_stores=8, spill_loads=8)]}})[1]

    shrunk = {"jfa_d64": {"kernels": [_kernel(registers=160), _kernel()]}}
    lines, fails = resources.compare(before, shrunk)
    assert not fails and lines[:2] == ["CHANGED jfa_d64 kernel 0: registers 168 -> 160",
                                       "CHANGED jfa_d64 kernel 1: spill stores B 8 -> 0, spill loads B 8 -> 0"]


def test_compare_fails_on_a_case_it_cannot_compare(resources):
    before = {"jfa_d64": {"kernels": [_kernel()]}, "gdpa_gelu_d64": {"error": "RuntimeError: no"}}
    for after, line in [
        ({"jfa_d128": {"kernels": [_kernel()]}}, "MISSING jfa_d128: not in the compared file"),
        ({"jfa_d64": {"kernels": [_kernel(), _kernel()]}}, "NOT COMPARED jfa_d64: 1 kernels -> 2"),
        ({"gdpa_gelu_d64": {"kernels": []}}, "NOT COMPARED gdpa_gelu_d64: RuntimeError: no -> compiled"),
    ]:
        lines, fails = resources.compare(before, after)
        assert fails and lines[0] == line


def test_main_writes_the_records_and_exits_by_the_comparison(resources, monkeypatch, tmp_path, capsys):
    results = {"jfa_d64": {"kernels": [_kernel(), _kernel(spill_stores=8, spill_loads=8)]}}
    monkeypatch.setattr(resources, "target", lambda: "NVIDIA H200")
    monkeypatch.setattr(resources, "resources", lambda case: results[case])
    out = tmp_path / "before.json"
    assert resources.main(["--cases", "jfa_d64", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["target"] == "NVIDIA H200" and record["cases"] == results and record["jax"]
    assert resources.main(["--cases", "jfa_d64", "--compare", str(out)]) == 0
    assert "2 of 2 kernels use the same" in capsys.readouterr().out

    results["jfa_d64"]["kernels"][1]["spill_load_bytes"] = 12
    assert resources.main(["--cases", "jfa_d64", "--compare", str(out)]) == 1
    assert "GREW jfa_d64 kernel 1: spill loads B 8 -> 12" in capsys.readouterr().out

    results["jfa_d64"] = {"error": "RuntimeError: no"}
    assert resources.main(["--cases", "jfa_d64"]) == 1
    assert "jfa_d64 ERROR RuntimeError: no" in capsys.readouterr().out
    (tmp_path / "other.json").write_text("{}")
    assert resources.main(["--cases", "jfa_d64", "--compare", str(tmp_path / "other.json")]) == 2


def test_a_missing_plugin_is_refused(resources, monkeypatch, capsys):
    def missing():
        raise resources.PluginMissing("no plugin")

    monkeypatch.setattr(resources, "target", missing)
    assert resources.main(["--cases", "jfa_d64"]) == 2
    assert "no plugin" in capsys.readouterr().err


@pytest.mark.slow  # about 6 s a run on 2 cores, two runs
def test_a_case_compiles_for_the_h200_with_its_ptxas_report(resources, tmp_path, capsys):
    try:
        resources.target()
    except resources.PluginMissing as exc:
        pytest.skip(str(exc))
    out = tmp_path / "forward.json"
    assert resources.main(["--cases", "jfa_forward_only_d128", "--out", str(out)]) == 0
    (kernel,) = json.loads(out.read_text())["cases"]["jfa_forward_only_d128"]["kernels"]
    assert kernel["arch"] == "sm_90a" and 0 < kernel["registers"] <= 255 and kernel["barriers"] > 0, kernel
    assert resources.main(["--cases", "jfa_forward_only_d128", "--compare", str(out)]) == 0  # ptxas allocates alike each time
    assert "1 of 1 kernels use the same" in capsys.readouterr().out
