"""scripts/kernel_fingerprints.py: every case lowers for CUDA on a CPU machine, and its digests name the
GPU program: the same for repeated lowerings, changed by a change to a kernel's body (its kernel digest)
or to what feeds the kernel (the program digest); `--compare` says which case differs and refuses files
it cannot compare."""

import json
import re

import jax
import pytest


@pytest.fixture(scope="module")
def fingerprints(load_script):
    return load_script("kernel_fingerprints")


# Kernels per case with gradients: forward and the two backward passes (block-local's backward is
# one kernel); forward-only cases and the GEMMs (the FP8 one and the GELU backward: no VJP of their own) lower one.
KERNELS = {"jfa_forward_only": 1, "jfa": 3, "gdpa": 3, "block_local": 2, "mxfp8_matmul": 1, "gelu_grad_matmul": 1}
CASES = ["jfa_d64", "block_local_rope_d128"]


def test_every_case_lowers_to_its_kernels_with_stable_digests(fingerprints):
    for case in fingerprints.CASES:
        digests = fingerprints.fingerprint(case)
        kernels = digests["kernels"]
        assert len(kernels) == next(n for family, n in KERNELS.items() if case.startswith(family)), case
        assert all(re.fullmatch(r"[0-9a-f]{16}", d) for d in kernels + [digests["program"]]), digests
        assert len(set(kernels)) == len(kernels), f"{case}: two passes lowered to one kernel"
    assert fingerprints.fingerprint("jfa_d64") == fingerprints.fingerprint("jfa_d64")


def _changed(module, name, value):
    """A context in which `module.name` is `value`, traced afresh (jax caches the kernels' jits)."""

    class Patch:
        def __enter__(self):
            self.saved = getattr(module, name)
            setattr(module, name, value)
            jax.clear_caches()

        def __exit__(self, *exc):
            setattr(module, name, self.saved)
            jax.clear_caches()  # nothing traced with the change outlives it

    return Patch()


def test_a_kernel_body_change_changes_its_kernel_digest(fingerprints, tmp_path, capsys):
    from pallas_kernels.jagged_flash_attention import _mgpu

    before = tmp_path / "before.json"
    assert fingerprints.main(["--cases", *CASES, "--out", str(before)]) == 0
    assert fingerprints.main(["--cases", *CASES, "--compare", str(before)]) == 0
    assert "2 of 2 cases lower to the same program and kernels" in capsys.readouterr().out

    with _changed(_mgpu, "LOG2E", _mgpu.LOG2E * (1 + 1e-6)):  # the JFA kernels' exp2 scale
        assert fingerprints.main(["--cases", *CASES, "--compare", str(before)]) == 1
        changed = fingerprints.fingerprint("jfa_d64")
    out = capsys.readouterr().out
    assert "DIFFERS jfa_d64" in out and "DIFFERS block_local" not in out
    assert "1 of 2 cases lower to the same program and kernels" in out
    assert changed["program"] == json.loads(before.read_text())["digests"]["jfa_d64"]["program"]


def test_swapped_kernel_operands_change_the_program_digest(fingerprints):
    from pallas_kernels.jagged_flash_attention import walk

    def launch_swapped(kernel, scratch, out_type, num_ctas, *operands):
        table, meta, q, k, *rest = operands
        return launch(kernel, scratch, out_type, num_ctas, table, meta, k, q, *rest)

    launch = walk.launch
    before = fingerprints.fingerprint("jfa_d64")
    with _changed(walk, "launch", launch_swapped):
        after = fingerprints.fingerprint("jfa_d64")
    assert after["kernels"] == before["kernels"] and after["program"] != before["program"]


def test_compare_fails_on_a_missing_case_and_refuses_another_jax(fingerprints, tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"jax": jax.__version__, "digests": {}}))
    assert fingerprints.main(["--cases", "jfa_d64", "--compare", str(other)]) == 1
    assert "MISSING jfa_d64" in capsys.readouterr().out
    other.write_text(json.dumps({"jax": "0.0.1", "digests": {}}))
    assert fingerprints.main(["--cases", "jfa_d64", "--compare", str(other)]) == 2
    assert "jax 0.0.1" in capsys.readouterr().err
