"""Small building blocks: RMSNorm (fp32), fp32 linear, stage recording for `dsv4 check`.

`Linear` (the model's bf16 / fp32 projections) dispatches `ops.linear`: torch's own GEMM (the reference,
float64 under `exact_accumulation()`), or under exact accumulation on a GPU the "triton" fixed-plan GEMM,
whose rows do not depend on the batch without float64 copies of the weights (deterministic serving). The
fp32 projections (router, compressor, head) dispatch `ops.linear_fp32` (fast backend "bf16x3"; under exact
accumulation on a GPU the fixed-plan GEMM too).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import ops
from ..ops import reference
from ..scoped import scoped


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 with an fp32 weight; output in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalization (per-head query normalization), in fp32."""
    return ops.rms_norm(x, None, eps)


class Linear(nn.Linear):
    """nn.Linear without bias whose matmul follows the reference's accumulation precision.

    `stored_format` / `act_format` (`dsv4.model.quant`: `mark_stored` records a weight a checkpoint stored
    as FP8 / FP4, `set_quant_mode` chooses the numerics): None, or W8A8 - the input goes through the FP8
    round trip per token in blocks of 128 ("ue8m0": power-of-two scales, "fp32": amax/448) before the
    matmul with the exact dequantized weight.
    """

    stored_format: str | None = None
    act_format: str | None = None

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype, or in out_dtype (wider: x and the weight are multiplied in
        it, exactly for fp16 operands in fp32, and the result is not rounded to x's dtype)."""
        if self.act_format is not None:
            x = ops.fp8_round_trip(x, reference.ACT_BLOCK, reference.act_pow2(self.act_format))
        if out_dtype is not None and out_dtype != x.dtype:
            return reference.linear(x.to(out_dtype), self.weight.to(out_dtype))
        return ops.linear(x, self.weight)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The low-precision dtype of an enclosing autocast region on this device type (None outside one).

    Mixed-precision training keeps fp32 master weights and runs inside autocast. The model then carries
    its activations (the residual copies of mHC included) in this dtype, as a bf16 model does, and casts
    the stacked expert weights to it: the fused kernels (mHC, grouped-GEMM MoE) take bf16 operands, and
    autocast itself only casts the inputs of matmul-like torch ops.
    """
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T in fp32, also inside an autocast region (router, compressor, head): `ops.linear_fp32`."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return ops.linear_fp32(x, weight)  # float64 under exact accumulation, or there the fixed-plan GEMM


def linear_bf16_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T from bf16 operands into fp32 (a head under head_precision="bf16"): `ops.linear_bf16_fp32`."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return ops.linear_bf16_fp32(x, weight)


# ------------------------------------------------------------------------------------ stage capture
_RECORDER = threading.local()


def record(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Offer an intermediate tensor to the active stage recorder (no-op, no copy when none is active).

    A recorder may return a replacement tensor (used by `dsv4 check` to plant faults at a named stage);
    the model continues with what is returned.
    """
    fn = getattr(_RECORDER, "fn", None)
    if fn is None:
        return tensor
    out = fn(name, tensor)
    return tensor if out is None else out


def recording_active() -> bool:
    """Whether a stage recorder is active in this thread (a recorded tensor may be kept: never update one
    in place then)."""
    return getattr(_RECORDER, "fn", None) is not None


def record_as(name: str, tensor: torch.Tensor, shape: tuple[int, int] | None) -> torch.Tensor:
    """`record` for a tensor in the flat token layout [1, T, ...] offered as [b, s, ...] (the caller's
    layout, `shape` = (b, s)), so stages compare position by position with the full-sequence path."""
    if shape is None or getattr(_RECORDER, "fn", None) is None:
        return record(name, tensor)
    return record(name, tensor.reshape(*shape, *tensor.shape[2:])).reshape(tensor.shape)


@contextlib.contextmanager
def recording(fn: Callable[[str, torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """Route every `record(name, tensor)` call in this thread to fn while the block runs."""
    with scoped(_RECORDER, "fn", fn):
        yield


class _NoFillOnMeta(torch.overrides.TorchFunctionMode):
    """Random or constant fills of meta tensors (the initializers nn.Linear / nn.Embedding run in their
    constructors) return the tensor untouched: a meta tensor has no values to fill, and torch's meta
    implementations of the fills import its compiler (~2 s on a CPU) the first time one runs. Only this
    thread's calls pass through a mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes its tensor by keyword
        is_fill = getattr(func, "__module__", None) == "torch.nn.init" or getattr(func, "__name__", "") in _FILLS
        if is_fill and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


_FILLS = {"normal_", "uniform_", "fill_", "zero_", "trunc_normal_", "exponential_", "random_"}


def building_on(device: torch.device | str | None) -> contextlib.AbstractContextManager:
    """The context a model builds its modules in on `device`: on the meta device, no initializer runs."""
    return _NoFillOnMeta() if device is not None and torch.device(device).type == "meta" else contextlib.nullcontext()
