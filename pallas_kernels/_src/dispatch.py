"""Choosing an op's implementation: the Pallas Mosaic GPU kernels, cuDNN, or the jnp reference.

Every op describes what its paths take in one `OpSupport` and asks `choose` for
an implementation; `pallas_kernels.describe_choice` asks the same function, so
what a trainer logs at start-up is what the op runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src import config as jax_config


class Implementation(enum.StrEnum):
    """Which implementation an op runs."""

    XLA = "xla"  # the pure-jnp reference compiled by XLA (the spec; runs anywhere)
    PALLAS = "pallas"  # the Pallas Mosaic GPU kernels (Hopper, sm_90a)
    CUDNN = "cudnn"  # cuDNN fused attention through jax.nn.dot_product_attention (NVIDIA GPUs)


class ImplementationUnavailableError(RuntimeError):
    """The requested implementation cannot run on this machine (no Hopper GPU, no NVIDIA GPU)."""


class Choice(NamedTuple):
    """An implementation and the one-line reason it was chosen."""

    implementation: Implementation
    reason: str


# cuDNN flash attention (jax.nn.dot_product_attention, implementation="cudnn"): half-precision
# inputs, head dim a multiple of 8, at most 256 on Hopper and later, 128 before
# (jax/_src/cudnn/fused_attention_stablehlo.py, check_is_flash_attention).
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class OpSupport:
    """What an op's non-reference paths take.

    Attributes:
      name: the op's public name (used in messages and by `describe_choice`).
      kernel_dtypes: input dtypes the Mosaic GPU kernels take (None: any the op accepts).
      kernel_head_dims: head dims the kernels take (None: the op has no head dim).
      dim_name: what that dimension is called in messages ("head dim"; rms_norm's is its "width").
      cudnn: whether the op has a cuDNN path.
      reference_otherwise: whether inputs the kernels do not take run the jnp reference under
        "pallas" too (else the kernels refuse them with their own message).
      size_limit: a condition on the inputs' size the kernels also need, which `choose` (given no
        shape) cannot check, e.g. "under 2**31 elements"; named in the reason of a Pallas choice.
    """

    name: str
    kernel_dtypes: tuple[jnp.dtype, ...] | None = None
    kernel_head_dims: tuple[int, ...] | None = None
    dim_name: str = "head dim"
    cudnn: bool = False
    reference_otherwise: bool = False
    size_limit: str | None = None

    @property
    def implementations(self) -> tuple[Implementation, ...]:
        """The implementations this op accepts (besides None)."""
        impls = (Implementation.XLA, Implementation.PALLAS)
        return impls + (Implementation.CUDNN,) if self.cudnn else impls

    def kernel_problem(self, dtypes: Sequence, head_dim: int | None) -> str | None:
        """Why the Mosaic GPU kernels do not take these inputs, or None when they do."""
        dtypes = [jnp.dtype(d) for d in dtypes]
        if self.kernel_dtypes is not None and (len(set(dtypes)) != 1 or dtypes[0] not in self.kernel_dtypes):
            wanted = " or ".join(d.name for d in self.kernel_dtypes)
            return f"the kernels take {wanted} inputs of one dtype, got {', '.join(d.name for d in dtypes)}"
        if self.kernel_head_dims is not None and head_dim not in self.kernel_head_dims:
            return f"the kernels take {self.dim_name} in {self.kernel_head_dims}, got {head_dim}"
        return None

    def cudnn_problem(self, dtypes: Sequence, head_dim: int | None, device: jax.Device) -> str | None:
        """Why cuDNN attention does not take these inputs on `device` (an NVIDIA GPU), or None."""
        dtypes = [jnp.dtype(d) for d in dtypes]
        if len(set(dtypes)) != 1 or dtypes[0] not in CUDNN_DTYPES:
            return f"cuDNN attention takes bfloat16 or float16 inputs of one dtype, got {', '.join(d.name for d in dtypes)}"
        limit = 256 if _compute_capability(device) >= (9, 0) else 128
        if head_dim is None or head_dim % 8 or head_dim > limit:
            return f"cuDNN attention takes a head dim that is a multiple of 8 and at most {limit} here, got {head_dim}"
        return None


def is_floating_dtype(dtype) -> bool:
    """Whether `dtype` names a floating dtype (False for anything that is not a dtype, e.g. "bogus")."""
    try:
        return jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # not a dtype
        return False


def interpreting() -> bool:
    """True while tracing under `plgpu.force_gpu_interpret_mode` (the Mosaic GPU simulator on the CPU)."""
    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


_TARGET: contextvars.ContextVar[jax.Device | None] = contextvars.ContextVar("pallas_kernels_target_device", default=None)


@contextlib.contextmanager
def compiling_for(device: jax.Device) -> Iterator[None]:
    """Inside the block, ops decide for `device` (implementation, persistent grid sizes) instead of
    `jax.devices()[0]`.

    For compiling ahead of time for a device this process does not have, e.g. a compile-only
    device of `jax.experimental.topologies.get_topology_desc` (`benchmarks/offline_compile.py`).
    A kernel call traced before the block, with the same arguments, is reused from the trace
    cache (`shared_lowering`) as it was decided then: trace inside the block.
    """
    token = _TARGET.set(device)
    try:
        yield
    finally:
        _TARGET.reset(token)


def default_device() -> jax.Device:
    """The device an op decides for when none is given: the `compiling_for` device inside that
    block, else the first of `jax.devices()`."""
    return _TARGET.get() or jax.devices()[0]


def describe_device(device: jax.Device) -> str:
    """E.g. "cpu", "tpu (TPU v5 lite)" or "gpu NVIDIA A100-SXM4-80GB (compute capability 8.0)"."""
    if device.platform == "gpu":
        cc = getattr(device, "compute_capability", None)
        return f"gpu {device.device_kind}" + (f" (compute capability {cc})" if cc else "")
    return device.platform if device.device_kind == device.platform else f"{device.platform} ({device.device_kind})"


def _compute_capability(device: jax.Device) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(getattr(device, "compute_capability", "")).split("."))
    except ValueError:
        return ()


def is_nvidia_gpu(device: jax.Device | None = None) -> bool:
    """True when `device` (default: the first device) is an NVIDIA (CUDA) GPU."""
    device = device or default_device()
    version = str(getattr(device.client, "platform_version", "")).lower()
    return device.platform == "gpu" and ("cuda" in version or "nvidia" in device.device_kind.lower())


def is_hopper_gpu(device: jax.Device | None = None) -> bool:
    """True when `device` (default: the first device) is an NVIDIA Hopper GPU (sm_90)."""
    device = device or default_device()
    if device.platform != "gpu":
        return False
    return _compute_capability(device) == (9, 0) or "H100" in device.device_kind or "H200" in device.device_kind


def parse(implementation: str | Implementation | None) -> Implementation | None:
    """`None` stays None; names are parsed.

    Raises:
      ValueError: an unknown implementation name.
    """
    if implementation is None:
        return None
    try:
        return Implementation(implementation)
    except ValueError:
        raise ValueError(
            f"unknown implementation {implementation!r}; expected one of {[i.value for i in Implementation]} or None"
        ) from None


def choose(
    op: OpSupport,
    implementation: str | Implementation | None,
    dtypes: Sequence,
    head_dim: int | None = None,
    device: jax.Device | None = None,
) -> Choice:
    """The implementation `op` runs for inputs of `dtypes` / `head_dim`, and why.

    `None` picks: the Pallas kernels on a Hopper GPU when they take the inputs;
    cuDNN on another NVIDIA GPU (or on Hopper when the kernels do not take the
    inputs) for an op with a cuDNN path, when cuDNN takes them; else the jnp
    reference. A name is taken as asked, once the machine can run it: "pallas"
    needs a Hopper GPU, or Mosaic GPU interpret mode (the CPU simulator the tests
    force); "cudnn" needs an NVIDIA GPU and inputs cuDNN takes. Whether the
    kernels take the inputs is left to them, so their own messages name the
    dtype or head dim; for an op with `reference_otherwise`, "pallas" with
    inputs the kernels do not take (dtype, head dim) chooses the reference.
    A Pallas choice's reason names the op's `size_limit`, if any.

    Raises:
      ValueError: an unknown name, "cudnn" for an op without a cuDNN path, or
        "cudnn" with inputs cuDNN does not take (dtype, head dim).
      ImplementationUnavailableError: "pallas" without a Hopper GPU, "cudnn" without an NVIDIA GPU.
    """
    requested = parse(implementation)
    device = device or default_device()
    where = describe_device(device)
    if requested is Implementation.XLA:
        return Choice(requested, "asked for the jnp reference")
    limit = f" ({op.size_limit}; else the jnp reference)" if op.size_limit else ""
    if requested is Implementation.PALLAS:
        if not interpreting() and not is_hopper_gpu(device):
            raise ImplementationUnavailableError(
                f"{op.name}: implementation='pallas' runs Pallas kernels for Hopper (sm_90): "
                f"no Hopper GPU: found {where}; use implementation=None or 'xla'"
            )
        kernel_problem = op.kernel_problem(dtypes, head_dim) if op.reference_otherwise else None
        if kernel_problem is not None:
            return Choice(Implementation.XLA, f"asked for the Pallas kernels, but {kernel_problem}: the jnp reference")
        if interpreting():
            return Choice(requested, f"asked for the Pallas kernels (Mosaic GPU interpret mode){limit}")
        return Choice(requested, f"asked for the Pallas kernels on {where}{limit}")
    if requested is Implementation.CUDNN:
        if not op.cudnn:
            raise ValueError(
                f"{op.name} has no cuDNN implementation; expected one of {[i.value for i in op.implementations]} or None"
            )
        if not is_nvidia_gpu(device):
            raise ImplementationUnavailableError(
                f"{op.name}: implementation='cudnn': cuDNN needs an NVIDIA GPU: found {where}; use implementation=None or 'xla'"
            )
        problem = op.cudnn_problem(dtypes, head_dim, device)
        if problem is not None:
            raise ValueError(f"{op.name}: implementation='cudnn': {problem}")
        return Choice(requested, f"asked for cuDNN on {where}")
    kernel_problem = op.kernel_problem(dtypes, head_dim)
    if is_hopper_gpu(device) and kernel_problem is None:
        return Choice(Implementation.PALLAS, f"Hopper GPU ({where}) and the Pallas kernels take these inputs{limit}")
    if op.cudnn and is_nvidia_gpu(device):
        cudnn_problem = op.cudnn_problem(dtypes, head_dim, device)
        if cudnn_problem is None:
            why = f"{kernel_problem}; " if is_hopper_gpu(device) else ""
            return Choice(Implementation.CUDNN, f"{why}NVIDIA GPU ({where}) and cuDNN takes these inputs")
        return Choice(Implementation.XLA, f"{cudnn_problem} ({where}): the jnp reference")
    if is_hopper_gpu(device):
        return Choice(Implementation.XLA, f"{kernel_problem} ({where}): the jnp reference")
    return Choice(Implementation.XLA, f"no Hopper GPU for the Pallas kernels (found {where}): the jnp reference")
