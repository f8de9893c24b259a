"""A bfloat16 train step has no float32 GEMM: no dot or convolution takes a float32 operand.

Float32 operands make XLA run TF32 GEMMs on Hopper (half the bf16 rate). Master weights,
optimizer state, accumulation (a dot's float32 *result*) and softmax/norm statistics stay
float32; a float32 *operand* of a dot is a bug. The check walks the lowered StableHLO of the
whole jitted train step (forward, backward and update) of the tiny MovieLens model, with
bf16 and with FP8 saved activations (whose backward dequantizes to bf16).
"""

import dataclasses
import re

import pytest
from jax.extend.mlir import ir

from gem_jax.train.config import load_config
from gem_jax.train.setup import setup_training

CONTRACTIONS = ("stablehlo.dot_general", "stablehlo.convolution")


def _walk(operation):
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op
                yield from _walk(op.operation)


def _source(location: str) -> str:
    """The innermost frame in this repository (gem_jax, pallas_kernels, tests) of an MLIR location, with the op name."""
    name = re.match(r'loc\("([^"]*)"', location)
    frames = re.findall(r'"([^"]*/(?:gem_jax|pallas_kernels|tests)/[^"]+)":(\d+)', location)
    where = f"{frames[0][0]}:{frames[0][1]}" if frames else location[:300]
    return f"{name.group(1) if name else '?'} at {where}"


def float32_contractions(module) -> list[str]:
    """Every dot/convolution of an MLIR module with a float32 operand: 'op (operand types) op_name at file:line'."""
    found = []
    for op in _walk(module.operation):
        if op.operation.name in CONTRACTIONS:
            types = [ir.RankedTensorType(v.type) for v in op.operands]
            if any(str(t.element_type) == "f32" for t in types):
                found.append(f"{op.operation.name} ({', '.join(str(t) for t in types)}) {_source(str(op.location))}")
    return found


@pytest.fixture(scope="module", params=[False, True], ids=["bf16_residuals", "fp8_saved_activations"])
def bf16_step_module(repo_root, request):
    config = load_config(str(repo_root / "configs" / "movielens_tiny.py"))
    model = dataclasses.replace(
        config.model, compute_dtype="bfloat16", attention_implementation="xla", fp8_saved_activations=request.param
    )
    training, state = setup_training(dataclasses.replace(config, model=model))
    batch = next(iter(training.dataset.train_iterator()))
    return training.train_step.lower(state, training.placement.put(batch)).compiler_ir("stablehlo")


def test_bfloat16_train_step_has_no_float32_dot(bf16_step_module):
    contractions = [op for op in _walk(bf16_step_module.operation) if op.operation.name in CONTRACTIONS]
    assert len(contractions) > 20  # the walk sees the model's matmuls (forward and backward)
    offenders = float32_contractions(bf16_step_module)
    assert not offenders, "float32 operands in a bfloat16 step:\n" + "\n".join(offenders)


def test_detector_names_the_float32_dot_and_its_source_line():
    import jax
    import jax.numpy as jnp

    def mixed(x, w):
        return (x.astype(jnp.float32) @ w).sum() + (x @ w.astype(jnp.bfloat16)).sum()

    args = (jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.float32))
    offenders = float32_contractions(jax.jit(mixed).lower(*args).compiler_ir("stablehlo"))
    assert len(offenders) == 1
    assert "tensor<4x8xf32>, tensor<8x2xf32>" in offenders[0] and "test_step_precision.py:" in offenders[0]
