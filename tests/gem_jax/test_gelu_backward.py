"""`gem_jax.nn.gelu_backward` and the MLP's `gelu_backward` setting: the same forward as the layers it replaces, and
gradients as accurate as autodiff's, with the GELU-backward GEMM in the Pallas interpreter (its own bounds are
tests/pallas_kernels/test_gelu_grad_matmul.py's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels
from gem_jax.model.config import ModelConfig, describe_attention
from gem_jax.nn import gelu_backward
from gem_jax.nn.layers import MLP, rms_norm
from pallas_kernels.gelu_grad_matmul import ops as gelu_grad_ops

PALLAS, XLA = pallas_kernels.Implementation.PALLAS, pallas_kernels.Implementation.XLA


def _operands(rng, rows, hidden, out, dtype):
    h = rng.standard_normal((rows, hidden)) * 2.0
    up_bias = rng.standard_normal(hidden) * 0.5
    kernel = rng.standard_normal((hidden, out)) / np.sqrt(hidden)
    bias = rng.standard_normal(out) * 0.1
    dy = rng.standard_normal((rows, out))
    return tuple(jnp.asarray(x, dtype) for x in (h, up_bias, kernel, bias)), jnp.asarray(dy, dtype)


def _autodiff(h, up_bias, kernel, bias):
    return jnp.dot(jax.nn.gelu(h + up_bias), kernel) + bias


def _value_and_vjp(f, operands, dy):
    y, vjp = jax.vjp(f, *operands)
    return y, vjp(dy)


def test_reference_backward_matches_autodiff_in_float32():
    """implementation="xla" (the op's jnp reference in the backward): the forward is autodiff's bit for bit, the four
    gradients agree with autodiff's to float32 rounding (the reference keeps the GEMM's product in float32)."""
    operands, dy = _operands(np.random.default_rng(0), 128, 48, 24, jnp.float32)
    ours = jax.jit(lambda *o: _value_and_vjp(lambda *a: gelu_backward.bias_gelu_dense(*a, implementation=XLA), o, dy))(*operands)
    want = jax.jit(lambda *o: _value_and_vjp(_autodiff, o, dy))(*operands)
    np.testing.assert_array_equal(np.asarray(ours[0]), np.asarray(want[0]))
    for name, got, ref in zip(("dh", "d_up_bias", "d_kernel", "d_bias"), ours[1], want[1], strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5 * float(jnp.abs(ref).max()), err_msg=name)


def test_kernel_backward_is_as_accurate_as_autodiff_in_bfloat16():
    """The kernel (interpreter) against autodiff, both bf16, measured against the same function in float64: each
    gradient's relative error is at most autodiff's own (the kernel rounds the product once, autodiff twice), with a
    floor of two bf16 ulps; leading axes are flattened into rows (`[2, 64, N]`)."""
    operands, dy = _operands(np.random.default_rng(1), 128, 128, 64, jnp.bfloat16)
    operands = (operands[0].reshape(2, 64, 128), *operands[1:])
    dy = dy.reshape(2, 64, 64)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        assert gelu_backward.takes(PALLAS, 128, 128, 64, jnp.bfloat16)
        ours = jax.jit(lambda *o: _value_and_vjp(lambda *a: gelu_backward.bias_gelu_dense(*a, implementation=PALLAS), o, dy))(*operands)
    bf16 = jax.jit(lambda *o: _value_and_vjp(_autodiff, o, dy))(*operands)
    np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(bf16[0], np.float32))
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in operands]
        exact = _value_and_vjp(_autodiff, wide, jnp.asarray(np.asarray(dy, np.float32), jnp.float64))[1]
        exact = [np.asarray(e) for e in exact]
    floor = 2 * 2.0**-8
    for name, got, ref, e in zip(("dh", "d_up_bias", "d_kernel", "d_bias"), ours[1], bf16[1], exact, strict=True):
        assert got.dtype == jnp.bfloat16 and got.shape == e.shape, name
        size = np.linalg.norm(e)
        ours_error = np.linalg.norm(np.asarray(got, np.float64) - e) / size
        autodiff_error = max(np.linalg.norm(np.asarray(ref, np.float64) - e) / size, floor)
        assert ours_error <= autodiff_error, (name, ours_error, autodiff_error)


def _mlp(setting, norm_setting=XLA, dtype=jnp.bfloat16):
    rngs = nnx.Rngs(2)
    with nnx.use_eager_sharding(False):
        mlp = MLP(64, 128, rngs=rngs, dtype=dtype, gelu_backward=setting)
        norm = rms_norm(64, rngs=rngs, dtype=dtype, implementation=norm_setting)
    return mlp, norm


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_mlp_setting_keeps_the_forward_and_routes_the_backward(residual):
    """`MLP(gelu_backward="pallas")`: the same output bit for bit as "xla" (one program forward), the kernel called once
    in the backward, and every parameter's and the input's gradient as accurate as autodiff's: measured against the
    same MLP computed in float32 (the same float32 parameters), each leaf's error at most twice autodiff's bf16 error
    (two bf16 computations of one function, their roundings of one size), with a floor of four bf16 ulps."""
    calls = []
    op = gelu_grad_ops.gelu_grad_matmul

    def counting(*args, implementation=None, **kwargs):
        calls.append(implementation)
        return op(*args, implementation=implementation, **kwargs)

    x = jnp.asarray(np.random.default_rng(3).standard_normal((128, 64)), jnp.float32)

    def run(setting, dtype=jnp.bfloat16):
        mlp, norm = _mlp(setting, dtype=dtype)
        graph, params = nnx.split((mlp, norm))

        def loss(p, x):
            m, n = nnx.merge(graph, p)
            y = m.residual(x, n) if residual else m(x, norm=n)
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    with pytest.MonkeyPatch.context() as patch, plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        patch.setattr(gelu_grad_ops, "gelu_grad_matmul", counting)
        (loss_k, y_k), grads_k = run(PALLAS)
    assert calls == [PALLAS]
    (loss_x, y_x), grads_x = run(XLA)
    np.testing.assert_array_equal(np.asarray(y_k, np.float32), np.asarray(y_x, np.float32))
    assert float(loss_k) == float(loss_x)
    _, grads_32 = run(XLA, jnp.float32)
    leaves = [jax.tree_util.tree_leaves_with_path(g) for g in (grads_k, grads_x, grads_32)]
    for (path, k), (_, x16), (_, e) in zip(*leaves, strict=True):
        k, x16, e = (np.asarray(a, np.float64) for a in (k, x16, e))
        size = np.linalg.norm(e)
        autodiff_error = max(np.linalg.norm(x16 - e) / size, 4 * 2.0**-8)
        assert np.linalg.norm(k - e) / size <= 2 * autodiff_error, (jax.tree_util.keystr(path), np.linalg.norm(k - e) / size, autodiff_error)


def test_the_kernel_runs_only_where_it_takes_the_layer():
    """None picks the kernel on a Hopper GPU only (here, with or without the interpreter, autodiff); "pallas" runs it
    for bf16 layers of its tiles (in the interpreter here) and is refused for others, naming why; without a
    Hopper GPU or the interpreter, "pallas" is unavailable."""
    assert not gelu_backward.takes(None, 128, 128, 64, jnp.bfloat16)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        assert not gelu_backward.takes(None, 128, 128, 64, jnp.bfloat16)
        assert gelu_backward.takes(PALLAS, 128, 128, 64, jnp.bfloat16)
        assert not gelu_backward.takes(PALLAS, 0, 128, 64, jnp.bfloat16)  # no rows: nothing to run
        with pytest.raises(ValueError, match="the kernel takes bfloat16"):
            gelu_backward.takes(PALLAS, 128, 128, 64, jnp.float32)
        with pytest.raises(ValueError, match="w's rows N must be a multiple of 128"):
            gelu_backward.takes(PALLAS, 128, 96, 64, jnp.bfloat16)
        with pytest.raises(ValueError, match="rows M must be a multiple of 128"):
            gelu_backward.takes(PALLAS, 100, 128, 64, jnp.bfloat16)
    with pytest.raises(pallas_kernels.ImplementationUnavailableError):
        gelu_backward.takes(PALLAS, 128, 128, 64, jnp.bfloat16)


def test_none_keeps_autodiff_for_rows_the_kernel_does_not_take():
    """Under None a row count off the kernel's 128 is autodiff's to run (a model called outside the trainer's rounded
    capacities), not an error; "pallas" is refused, and mismatched shapes are errors under any setting."""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        assert not gelu_backward.takes(None, 100, 128, 64, jnp.bfloat16)
    dy, w = jax.ShapeDtypeStruct((100, 64), jnp.bfloat16), jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"h must be \[M, N\] = \(100, 128\)"):
        gelu_grad_ops.runs_kernel(dy, w, jax.ShapeDtypeStruct((100, 96), jnp.bfloat16))
    with pytest.raises(ValueError, match="config must be a kernel.TuningConfig"):
        gelu_grad_ops.runs_kernel(dy, w, jax.ShapeDtypeStruct((100, 128), jnp.bfloat16), config="bad")
    mlp, norm = _mlp(None)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((100, 64)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(mlp(x, norm=norm), np.float32), np.asarray(_mlp(XLA)[0](x, norm=norm), np.float32))


def test_start_up_refuses_pallas_for_layers_the_kernel_does_not_take():
    """The start-up line names what runs: "pallas" for float32 layers or a hidden width off the tiles is refused
    there, naming the setting and the layers, not in the first backward; FP8 MLPs say the setting is unused."""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        line = describe_attention(ModelConfig(embed_dim=64, mlp_implementation="pallas", compute_dtype="bfloat16"))[-1]
        assert line.startswith("MLP GELU backward (sequence tower): pallas (asked for the Pallas kernels"), line
        with pytest.raises(ValueError, match=r"^model.mlp_implementation=pallas: gelu_grad_matmul: implementation='pallas': the kernel takes bfloat16 .* \(the sequence MLPs: float32, 64 -> 128 -> 64\)"):
            describe_attention(ModelConfig(embed_dim=64, mlp_implementation="pallas", compute_dtype="float32"))
        with pytest.raises(ValueError, match=r"w's rows N must be a multiple of 128 .* \(the sequence MLPs: bfloat16, 48 -> 96 -> 48\)"):
            describe_attention(ModelConfig(embed_dim=48, num_heads=2, mlp_implementation="pallas", compute_dtype="bfloat16"))
    fp8 = describe_attention(ModelConfig(embed_dim=64, fp8=True, fp8_block=32, mlp_implementation="xla"))
    assert any(line.startswith("MLP GELU backward (sequence tower): the FP8 path") for line in fp8)


def test_operands_of_mixed_dtypes_are_refused():
    (h, up_bias, kernel, bias), _ = _operands(np.random.default_rng(5), 128, 48, 24, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"must share one dtype .*'up_bias': dtype\('float32'\)"):
        gelu_backward.bias_gelu_dense(h, up_bias.astype(jnp.float32), kernel, bias, implementation=XLA)


def test_model_config_names_the_setting():
    config = ModelConfig(mlp_implementation="pallas")
    assert config.mlp_implementation is PALLAS
    assert ModelConfig().mlp_implementation is XLA
    assert any(line.startswith("MLP GELU backward (sequence tower): xla") for line in describe_attention(dataclasses.replace(config, mlp_implementation="xla")))
    with pytest.raises(ValueError, match="^ModelConfig.mlp_implementation must be XLA, PALLAS or None, got 'fast'$"):
        ModelConfig(mlp_implementation="fast")
    with pytest.raises(ValueError, match="^ModelConfig.mlp_implementation must be XLA, PALLAS or None, got CUDNN: the GELU backward has no cuDNN implementation$"):
        ModelConfig(mlp_implementation="cudnn")
