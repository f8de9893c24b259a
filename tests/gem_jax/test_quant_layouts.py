"""The FP8 path transposes no quantized operand and quantizes nothing twice.

The check walks the lowered StableHLO of the whole jitted train step of configs/gem_h200_tiny.py
with every `Fp8Region` in FP8 (calls inlined), labels every value computed from FP8 data
(E4M3, from an activation or from a weight) or FP8 scales (E8M0) by elementwise or layout ops,
and every activation that is quantized, and lists the transposes of labelled values.

The "xla" path has none. The Pallas path (its pre-kernel glue; the kernel is replaced by an
opaque stand-in, it is tested in tests/pallas_kernels) has exactly two documented kinds:

- `data:weight`: the forward GEMM's K-major copy of the 8-bit weight (`[in, out] -> [out, in]`).
  Hopper's FP8 wgmma reads only K-major operands; the weight is quantized once with square
  tiles and the backward uses the untransposed bytes, so this is the one copy, weight-sized.
- `scale`: E8M0 scales turned K-block-major (`[rows/r, K/kb] -> [K/kb, rows/r]`) inside the
  expansion to the kernel's per-row float32 scale layout; 1/1024 (32x32) or 1/128 (1x128)
  of the activation's elements, fused with the expansion the kernel needs anyway.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from gem_jax.model.config import Fp8Region, ModelConfig
from gem_jax.train.config import load_config
from gem_jax.train.setup import setup_training
from pallas_kernels.mxfp8 import Fp8Recipe, kernel_matmul, mxfp8_matmul, quantize_mxfp8

DATA, SCALE = "f8E4M3FN", "f8E8M0FNU"
# Ops whose results are new values, not an elementwise or layout image of their operands.
OPAQUE = {
    "stablehlo.dot_general", "stablehlo.convolution", "stablehlo.reduce", "stablehlo.reduce_window", "stablehlo.sort",
    "stablehlo.custom_call", "stablehlo.while", "stablehlo.case", "stablehlo.if", "stablehlo.scatter", "stablehlo.gather",
    "stablehlo.dynamic_slice", "stablehlo.dynamic_update_slice", "stablehlo.rng_bit_generator", "stablehlo.iota",
    "stablehlo.constant",
}  # fmt: skip
# Ops that lie between a quantized tensor and the tensor it quantizes (the quantizer's arithmetic).
QUANTIZER = {
    "stablehlo.convert", "stablehlo.reshape", "stablehlo.pad", "stablehlo.broadcast_in_dim", "stablehlo.multiply",
    "stablehlo.divide", "stablehlo.clamp", "stablehlo.select", "stablehlo.abs", "stablehlo.negate", "stablehlo.maximum",
    "stablehlo.minimum", "stablehlo.slice", "stablehlo.bitcast_convert", "stablehlo.floor", "stablehlo.round_nearest_even",
}  # fmt: skip
ALLOWED_IN_KERNEL_GLUE = {"data:weight", "scale"}


@dataclasses.dataclass
class Op:
    name: str
    operands: list[int]
    results: list[int]
    operand_types: list[str]
    result_types: list[str]
    location: str


def flatten(module) -> tuple[list[Op], set[int]]:
    """The ops of `main` in program order with every `func.call` inlined (values as int ids), and main's argument ids."""
    funcs = {op.attributes["sym_name"].value: op for op in module.body.operations if op.operation.name == "func.func"}
    ops, ids = [], itertools.count()

    def run(block, env):
        for op in block.operations:
            name = op.operation.name
            ins = [env[v] for v in op.operands]
            if name in ("func.return", "stablehlo.return"):
                return ins
            if name == "func.call":
                callee = funcs[op.attributes["callee"].value].regions[0].blocks[0]
                outs = run(callee, dict(zip(callee.arguments, ins)))
            else:
                outs = [next(ids) for _ in op.results]
                ops.append(Op(name, ins, outs, [str(v.type) for v in op.operands], [str(v.type) for v in op.results], str(op.location)))
                for region in op.regions:  # nested bodies see the op's operands (conservatively) and the enclosing values
                    for inner in region.blocks:
                        args = [next(ids) for _ in inner.arguments]
                        ops.append(Op("region.arguments", ins, args, [], [], ""))
                        run(inner, {**env, **dict(zip(inner.arguments, args))})
            env.update(zip(op.results, outs))
        return []

    main = funcs["main"].regions[0].blocks[0]
    args = [next(ids) for _ in main.arguments]
    run(main, dict(zip(main.arguments, args)))
    return ops, set(args)


def element_type(tensor_type: str) -> str:
    return re.match(r"tensor<(?:[0-9?]+x)*([^,>]+)", tensor_type).group(1)


def is_quantization(op: Op) -> bool:
    """A cast of a (non-scalar) float tensor to E4M3: where quantized data is born."""
    if op.name != "stablehlo.convert":
        return False
    source = op.operand_types[0]
    return element_type(op.result_types[0]) == DATA and element_type(source) != DATA and "x" in source


def fp8_transposes(ops: list[Op], main_args: set[int]) -> list[tuple[set[str], str, str]]:
    """`(labels, operand type, location)` of every transpose whose operand is FP8 data or scales, computed
    from them by elementwise or layout ops, or an activation that is quantized."""
    producer = {r: op for op in ops for r in op.results}

    def quantized_from(value: int) -> tuple[set[int], bool]:
        """The values between a quantization and its inputs; whether its float inputs are all main arguments (a weight)."""
        seen, stack, inputs = set(), [value], []
        while stack:
            v = stack.pop()
            if v not in seen:
                seen.add(v)
                op = producer.get(v)
                if op is None or op.name not in QUANTIZER:
                    inputs.append(v)
                else:
                    stack.extend(op.operands)
        floats = [
            v for v in inputs
            if v in main_args
            or (producer[v].name != "stablehlo.constant" and element_type(producer[v].result_types[producer[v].results.index(v)]).startswith(("f", "bf")))
        ]  # fmt: skip
        return seen, all(v in main_args for v in floats)

    labels: dict[int, set[str]] = {}
    quantized_activations: set[int] = set()
    for op in ops:
        own = set()
        if is_quantization(op):
            seen, from_weight = quantized_from(op.operands[0])
            own = {"data:weight" if from_weight else "data:activation"}
            quantized_activations |= set() if from_weight else seen
        elif op.name == "stablehlo.bitcast_convert" and element_type(op.result_types[0]) == SCALE:
            own = {"scale"}
        inherited = set() if op.name in OPAQUE else set().union(*(labels.get(v, set()) for v in op.operands))
        for r in op.results:
            labels[r] = inherited | own
    found = []
    for op in ops:
        if op.name == "stablehlo.transpose":
            v = op.operands[0]
            tags = labels.get(v, set()) | ({"source activation"} if v in quantized_activations else set())
            if tags:
                found.append((tags, op.operand_types[0], _where(op.location)))
    return found


def _where(location: str) -> str:
    frames = re.findall(r'"([^"]*/(?:gem_jax|pallas_kernels|tests)/[^"]+)":(\d+)', location)
    return ", ".join(f"{f.rsplit('/', 1)[-1]}:{line}" for f, line in frames[:3]) or location[:200]


def _kernel_stand_in(a, b, row_scales, col_scales, *, block_k, col_group, out_dtype, config):
    """An opaque op of the kernel's signature: the glue around it lowers without the Mosaic GPU kernel body."""
    del block_k, col_group, config
    out = jax.ShapeDtypeStruct((a.shape[0], b.shape[0]), out_dtype)
    return jax.pure_callback(lambda *_: np.zeros(out.shape, out.dtype), out, a, b, row_scales, col_scales)


def _fp8_step_module(repo_root, block: int):
    config = load_config(str(repo_root / "configs" / "gem_h200_tiny.py"))
    model = dataclasses.replace(
        config.model, compute_dtype="bfloat16", attention_implementation="xla", fp8=True, fp8_block=block, fp8_regions=tuple(Fp8Region)
    )
    training, _ = setup_training(dataclasses.replace(config, model=model), init_state=False)
    batch = training.placement.put(next(iter(training.dataset.train_iterator())))
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return training.train_step.lower(training.state.abstract, batch).compiler_ir("stablehlo")


@pytest.mark.parametrize("implementation, block", [("xla", 32), ("pallas", 128)])
def test_fp8_step_transposes_no_quantized_operand(repo_root, monkeypatch, implementation, block):
    if implementation == "pallas":
        monkeypatch.setattr(kernel_matmul, "scaled_matmul", _kernel_stand_in)
        recipe = lambda self: Fp8Recipe(block=self.fp8_block, implementation="pallas") if self.fp8 else None  # noqa: E731
        monkeypatch.setattr(ModelConfig, "fp8_recipe", property(recipe))
    ops, main_args = flatten(_fp8_step_module(repo_root, block))
    quantizations = [op for op in ops if is_quantization(op)]
    # 18 FP8 layers of the tiny model (every region), each quantizing its input, its weight and its output gradient once.
    assert len(quantizations) == 3 * 18, "a tensor is quantized more than once (or a layer is missing)"
    found = fp8_transposes(ops, main_args)
    allowed = set() if implementation == "xla" else ALLOWED_IN_KERNEL_GLUE
    offenders = [f"{sorted(tags)} {t} at {where}" for tags, t, where in found if not tags <= allowed]
    assert not offenders, "transposes of quantized operands:\n" + "\n".join(offenders)
    if implementation == "pallas":  # one K-major weight copy per FP8 layer (forward), nothing else of E4M3 data
        assert sum("data:weight" in tags for tags, _, _ in found) == 18


def test_detector_finds_transposes_of_quantized_data_scales_and_sources():
    def layer(inputs, w):
        x = jax.numpy.tanh(inputs)  # an activation (a weight is an argument of the step)
        (xq, sx), (wq, sw) = quantize_mxfp8(x), quantize_mxfp8(w)
        y = mxfp8_matmul(xq, sx, wq.T, sw.T, implementation="xla")  # the weight's bytes and scales transposed
        return y, x.T @ y  # the quantized activation itself transposed

    module = jax.jit(layer).lower(jax.numpy.ones((64, 32)), jax.numpy.ones((32, 64))).compiler_ir("stablehlo")
    found = sorted((sorted(tags), t) for tags, t, _ in fp8_transposes(*flatten(module)))
    assert found == [
        (["data:weight"], "tensor<32x64xf8E4M3FN>"),
        (["scale"], "tensor<1x2xf8E8M0FNU>"),
        (["source activation"], "tensor<64x32xf32>"),
    ]


def test_kernel_glue_copies_no_activation_at_aligned_shapes(monkeypatch):
    """At token counts and widths that fit the tiles (the model's), the Pallas path pads and slices nothing."""
    monkeypatch.setattr(kernel_matmul, "scaled_matmul", _kernel_stand_in)
    x, w = jax.numpy.ones((256, 256), jax.numpy.bfloat16), jax.numpy.ones((256, 512))
    for act_block, w_block in (((32, 32), (32, 32)), ((1, 128), (128, 128))):

        def forward(x, w, act_block=act_block, w_block=w_block):
            (xq, sx), (wq, sw) = quantize_mxfp8(x, block=act_block), quantize_mxfp8(w, block=w_block)
            return mxfp8_matmul(xq, sx, wq, sw, b_contracting_dim=0, implementation="pallas")

        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            ops, _ = flatten(jax.jit(forward).lower(x, w).compiler_ir("stablehlo"))
        copies = [op for op in ops if op.name in ("stablehlo.pad", "stablehlo.slice") and DATA in op.operand_types[0]]
        assert not copies, [(op.name, op.operand_types[0]) for op in copies]
