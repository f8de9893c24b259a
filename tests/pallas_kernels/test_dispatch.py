"""Choosing an implementation: what None picks on each kind of machine and why, and the errors for names
the machine cannot run. Devices other than the CPU are stand-ins with a device's attributes."""

import re
import types

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels
from pallas_kernels import Implementation, ImplementationUnavailableError, describe_choice
from pallas_kernels._src import dispatch


def _gpu(kind: str, cc: str):
    client = types.SimpleNamespace(platform_version="cuda 12080")
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc, client=client)


H200 = _gpu("NVIDIA H200", "9.0")
A100 = _gpu("NVIDIA A100-SXM4-80GB", "8.0")
L4 = _gpu("NVIDIA L4", "8.9")
CPU = jax.devices("cpu")[0]


@pytest.mark.parametrize(
    "op, dtype, head_dim, device, expected, reason",
    [
        ("jagged_flash_attention", jnp.bfloat16, 64, H200, "pallas", "Hopper GPU"),
        ("jagged_flash_attention", jnp.float16, 128, H200, "pallas", "Pallas kernels take these inputs"),
        ("jagged_flash_attention", jnp.bfloat16, 96, H200, "cudnn", "head dim in (64, 128), got 96"),
        ("jagged_flash_attention", jnp.float32, 64, H200, "xla", "cuDNN attention takes bfloat16 or float16"),
        ("jagged_flash_attention", jnp.bfloat16, 64, A100, "cudnn", "NVIDIA GPU (gpu NVIDIA A100"),
        ("jagged_flash_attention", jnp.float16, 128, L4, "cudnn", "cuDNN takes these inputs"),
        ("jagged_flash_attention", jnp.bfloat16, 256, A100, "xla", "at most 128 here, got 256"),
        ("jagged_flash_attention", jnp.float32, 64, A100, "xla", "got float32"),
        ("jagged_flash_attention", jnp.bfloat16, 64, CPU, "xla", "no Hopper GPU for the Pallas kernels (found cpu)"),
        ("gdpa", jnp.bfloat16, 64, H200, "pallas", "Hopper GPU"),
        ("gdpa", jnp.bfloat16, 96, H200, "xla", "head dim in (64, 128), got 96"),
        ("gdpa", jnp.bfloat16, 64, A100, "xla", "no Hopper GPU for the Pallas kernels (found gpu NVIDIA A100"),
        ("mxfp8_matmul", jnp.float8_e4m3fn, None, H200, "pallas", "Hopper GPU"),
        ("mxfp8_matmul", jnp.float8_e4m3fn, None, CPU, "xla", "found cpu"),
    ],
)
def test_none_picks_by_machine_and_inputs(op, dtype, head_dim, device, expected, reason):
    choice = describe_choice(op, dtype, head_dim, device=device)
    assert choice.implementation is Implementation(expected)
    assert reason in choice.reason and "\n" not in choice.reason


def test_names_run_only_where_the_machine_can():
    assert describe_choice("gdpa", jnp.float32, 96, implementation="xla", device=A100).implementation is Implementation.XLA
    assert describe_choice("jagged_flash_attention", jnp.bfloat16, 64, implementation="cudnn", device=H200).implementation is (
        Implementation.CUDNN
    )
    # The kernels' own checks name unsupported inputs on a Hopper GPU; the choice does not.
    assert describe_choice("gdpa", jnp.float32, 96, implementation="pallas", device=H200).implementation is Implementation.PALLAS
    for device, where in ((CPU, "found cpu"), (A100, "found gpu NVIDIA A100-SXM4-80GB (compute capability 8.0)")):
        with pytest.raises(ImplementationUnavailableError, match=f"gdpa: .*no Hopper GPU: {re.escape(where)}"):
            describe_choice("gdpa", jnp.bfloat16, 64, implementation="pallas", device=device)
    with pytest.raises(ImplementationUnavailableError, match="cuDNN needs an NVIDIA GPU: found cpu"):
        describe_choice("jagged_flash_attention", jnp.bfloat16, 64, implementation="cudnn", device=CPU)
    with pytest.raises(ValueError, match="implementation='cudnn': cuDNN attention takes bfloat16 or float16"):
        describe_choice("jagged_flash_attention", jnp.float32, 64, implementation="cudnn", device=H200)
    with pytest.raises(ValueError, match="a multiple of 8 and at most 128 here, got 256"):
        describe_choice("jagged_flash_attention", jnp.bfloat16, 256, implementation="cudnn", device=A100)
    with pytest.raises(ValueError, match="gdpa has no cuDNN implementation"):
        describe_choice("gdpa", jnp.bfloat16, 64, implementation="cudnn", device=H200)
    with pytest.raises(ValueError, match="unknown implementation 'triton'"):
        describe_choice("gdpa", jnp.bfloat16, 64, implementation="triton")
    with pytest.raises(ValueError, match="unknown op 'hstu'"):
        describe_choice("hstu", jnp.bfloat16, 64)


def test_interpret_mode_stands_in_for_a_hopper_gpu_only_when_asked_by_name():
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        assert dispatch.interpreting()
        assert describe_choice("gdpa", jnp.bfloat16, 64, implementation="pallas").implementation is Implementation.PALLAS
        assert describe_choice("gdpa", jnp.bfloat16, 64).implementation is Implementation.XLA  # None: still the CPU
    assert not dispatch.interpreting()


def test_implementations_per_op():
    assert Implementation.CUDNN in pallas_kernels.implementations("jagged_flash_attention")
    assert pallas_kernels.implementations("gdpa") == (Implementation.XLA, Implementation.PALLAS)
