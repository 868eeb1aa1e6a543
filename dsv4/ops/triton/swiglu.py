"""`clamped_swiglu` (backend "triton"): the shared expert's activation in one launch instead of seven.

The reference (`dsv4.ops.reference.clamped_swiglu`) runs two casts to fp32, two clamps, silu, the product
and the cast back as separate torch kernels, in every MoE layer of every step. Here one program per block
of elements does the same operations in the same order on the same operands: fp32 from the inputs,
min(gate, L) and clamp(up, -L, L) by comparisons (so NaN stays NaN, as torch's clamp keeps it),
silu(g) = g / (1 + exp(-g)) with libdevice's `exp` (what torch's CUDA silu calls) and a correctly rounded
division, the product, the optional weight, one rounding to the output dtype. So the output is the
reference's bits on CUDA. On the CPU interpreter numpy's exp stands in for libdevice's and torch's CPU silu
uses its own vectorized exp: a few ulp apart there (and the interpreter's fp32 -> bf16 conversion, which
truncates, is replaced by a rounding to nearest even on the bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import register
from ._common import Kernel, device_reason, interpret_mode

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024
_alloc = torch.empty  # (the tests poison it: every output element must be written)


def _swiglu_kernel(
    g_ptr,
    u_ptr,
    w_ptr,
    out_ptr,
    N,
    I,
    limit,
    CLAMP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    RNE_BF16: tl.constexpr,
    INTERP: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if CLAMP:
        u = tl.where(u < -limit, -limit, tl.where(u > limit, limit, u))
        g = tl.where(g > limit, limit, g)
    if INTERP:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    h = tl.div_rn(g, 1.0 + e) * u
    if HAS_WEIGHT:
        h = h * tl.load(w_ptr + offs // I, mask=inside, other=0.0)
    if INTERP and RNE_BF16:  # the interpreter's own fp32 -> bf16 conversion truncates; round to nearest even
        b = h.to(tl.uint32, bitcast=True)
        h = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=inside)


_kernel = Kernel(_swiglu_kernel)


def triton_clamped_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    swiglu_limit: float,
    out_dtype: torch.dtype,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """As the reference `clamped_swiglu`, one launch."""
    out = _alloc(gate.shape, dtype=out_dtype, device=gate.device)
    n = gate.numel()
    if n == 0:
        return out
    _kernel[(triton.cdiv(n, BLOCK),)](
        gate,
        up,
        weight if weight is not None else gate,
        out,
        n,
        gate.size(-1),
        float(swiglu_limit),
        CLAMP=swiglu_limit > 0,
        HAS_WEIGHT=weight is not None,
        BLOCK=BLOCK,
        RNE_BF16=out_dtype == torch.bfloat16,
        INTERP=interpret_mode(),
    )
    return out


def _can_run(gate, up, swiglu_limit, out_dtype, weight=None) -> str | None:
    tensors = [t for t in (gate, up, weight) if t is not None]
    reason = device_reason(*tensors)
    if reason:
        return reason
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd: the kernel has no backward (training runs the reference)"
    if gate.dtype not in FLOAT_DTYPES or up.dtype not in FLOAT_DTYPES or out_dtype not in FLOAT_DTYPES:
        return f"gate {gate.dtype}, up {up.dtype}, out {out_dtype}: fp32 / bf16 / fp16 only"
    if gate.shape != up.shape or gate.dim() == 0 or not gate.is_contiguous() or not up.is_contiguous():
        return f"gate and up must be contiguous and of one shape, got {tuple(gate.shape)}, {tuple(up.shape)}"
    if weight is not None and (
        weight.dtype != torch.float32 or not weight.is_contiguous() or tuple(weight.shape) != (*gate.shape[:-1], 1)
    ):
        return f"weight must be {(*gate.shape[:-1], 1)} fp32 contiguous, got {tuple(weight.shape)} {weight.dtype}"
    return None  # (the limit: torch's clamp rounds it to the tensor's fp32 as the kernel's argument is)


register("clamped_swiglu", "triton", triton_clamped_swiglu, can_run=_can_run, deterministic=True, priority=10)

__all__ = ["triton_clamped_swiglu"]
