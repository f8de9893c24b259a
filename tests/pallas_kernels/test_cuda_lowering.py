"""Every Mosaic GPU kernel lowers for CUDA on a CPU machine (`jax.export`, platforms=["cuda"]), and
scripts/kernel_fingerprints.py's digests name a kernel's GPU code: stable across lowerings and source
line moves, changed by any change to the kernel."""

import importlib.util
import re

import pytest


@pytest.fixture(scope="module")
def fingerprints(repo_root):
    spec = importlib.util.spec_from_file_location("kernel_fingerprints", repo_root / "scripts" / "kernel_fingerprints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Kernels per case: forward, and the two backward passes (block-local's backward is one kernel);
# the FP8 GEMM has no VJP of its own.
KERNELS = {"jfa": 3, "gdpa": 3, "block_local": 2, "mxfp8_matmul": 1}


def test_every_case_lowers_to_its_kernels_with_stable_digests(fingerprints):
    for case in fingerprints.CASES:
        digests = fingerprints.fingerprint(case)
        assert len(digests) == next(n for family, n in KERNELS.items() if case.startswith(family)), case
        assert all(re.fullmatch(r"[0-9a-f]{16}", d) for d in digests), digests
        assert len(set(digests)) == len(digests), f"{case}: two passes lowered to one kernel"
    assert fingerprints.fingerprint("jfa_d64") == fingerprints.fingerprint("jfa_d64")


def test_a_kernel_change_changes_its_digest_and_compare_says_which(fingerprints, tmp_path, monkeypatch, capsys):
    before = tmp_path / "before.json"
    assert fingerprints.main(["--cases", "jfa_d64", "block_local_rope_d128", "--out", str(before)]) == 0
    assert fingerprints.main(["--cases", "jfa_d64", "block_local_rope_d128", "--compare", str(before)]) == 0
    assert "2 of 2 cases lower to the same kernels" in capsys.readouterr().out

    import jax

    from pallas_kernels.jagged_flash_attention import _mgpu

    with monkeypatch.context() as patch:
        patch.setattr(_mgpu, "LOG2E", _mgpu.LOG2E * (1 + 1e-6))  # the forward's and backward's exp2 scale
        jax.clear_caches()  # the kernels' jits are traced again, with the changed constant
        assert fingerprints.main(["--cases", "jfa_d64", "block_local_rope_d128", "--compare", str(before)]) == 1
    jax.clear_caches()  # nothing traced with the changed constant outlives the test
    out = capsys.readouterr().out
    assert "DIFFERS jfa_d64" in out and "DIFFERS block_local" not in out
    assert "1 of 2 cases lower to the same kernels" in out
