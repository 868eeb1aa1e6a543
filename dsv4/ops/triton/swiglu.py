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

With autograd on (training: the shared expert, and the routed experts' rows with their router weight) the
backward is one launch too, the reference autograd's operations in fp32: the output gradient times the
weight, times clamp(up) and silu(min(gate, L)) for the two branches, silu's derivative s (1 + g (1 - s))
with s = 1 / (1 + exp(-g)), the clamps' masks (a clamped element passes no gradient), one rounding to each
input's dtype; the weight's gradient, the sum over the row of the output gradient times silu * up, in fp32
in the kernel's own order (one program per block of rows, the row walked in column blocks).
"""

from __future__ import annotations

import functools

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


def _swiglu_bwd_kernel(
    go_ptr,
    g_ptr,
    u_ptr,
    w_ptr,
    gg_ptr,
    gu_ptr,
    gw_ptr,
    R,
    I,
    limit,
    CLAMP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BR: tl.constexpr,
    BI: tl.constexpr,
    AT_LIMIT_G: tl.constexpr,
    AT_LIMIT_U: tl.constexpr,
    RNE_G: tl.constexpr,
    RNE_U: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Gradients of gate and up (their dtypes) and of the per-row weight (fp32) for rows of I elements."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    if HAS_WEIGHT:
        w = tl.load(w_ptr + rows, mask=rmask, other=0.0)  # [BR]
        gw = tl.zeros((BR,), dtype=tl.float32)
    for i0 in range(0, I, BI):
        cols = i0 + tl.arange(0, BI)
        m = rmask[:, None] & (cols < I)[None, :]
        offs = rows[:, None] * I + cols[None, :]
        go = tl.load(go_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if CLAMP:  # which elements pass a gradient: inside the clamps, and at the limit where torch passes it
            if AT_LIMIT_U:
                keep_u = (u >= -limit) & (u <= limit)
            else:
                keep_u = (u > -limit) & (u < limit)
            if AT_LIMIT_G:
                keep_g = g <= limit
            else:
                keep_g = g < limit
            u = tl.where(u < -limit, -limit, tl.where(u > limit, limit, u))
            g = tl.where(g > limit, limit, g)
        if INTERP:
            e = tl.exp(-g)
        else:
            e = libdevice.exp(-g)
        s = tl.div_rn(1.0, 1.0 + e)  # sigmoid
        if HAS_WEIGHT:
            gw += tl.sum(go * (tl.div_rn(g, 1.0 + e) * u), axis=1)
            go = go * w[:, None]
        dg = go * u * s * (1.0 + g * (1.0 - s))  # silu's derivative, as torch's silu backward
        du = go * tl.div_rn(g, 1.0 + e)
        if CLAMP:
            dg = tl.where(keep_g, dg, 0.0)
            du = tl.where(keep_u, du, 0.0)
        if INTERP and RNE_G:  # (the interpreter's fp32 -> bf16 conversion truncates)
            b = dg.to(tl.uint32, bitcast=True)
            dg = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        if INTERP and RNE_U:
            b = du.to(tl.uint32, bitcast=True)
            du = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(gg_ptr + offs, dg.to(gg_ptr.dtype.element_ty), mask=m)
        tl.store(gu_ptr + offs, du.to(gu_ptr.dtype.element_ty), mask=m)
    if HAS_WEIGHT:
        tl.store(gw_ptr + rows, gw, mask=rmask)


_bwd_kernel = Kernel(_swiglu_bwd_kernel)
BWD_ROWS, BWD_COLS = 16, 128  # rows per program, columns per step of the backward


def _forward(gate, up, swiglu_limit, out_dtype, weight):
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


@functools.cache
def _passes_at_the_limit(sides: str) -> bool:
    """Whether torch's clamp passes the gradient of an element equal to its limit (`clamp(max=L)`: "max";
    `clamp(-L, L)`: "both"): the reference's backward is torch's autograd, and torch releases have answered
    this both ways, so the kernel asks the torch it runs beside."""
    with torch.enable_grad():
        x = torch.tensor([1.0, -1.0], requires_grad=True)
        y = x.clamp(max=1.0) if sides == "max" else x.clamp(-1.0, 1.0)
        (g,) = torch.autograd.grad(y, x, torch.ones(2))
    return bool(g[0] == 1.0)


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, swiglu_limit, out_dtype):
        ctx.save_for_backward(gate, up, weight)
        ctx.limit = swiglu_limit
        return _forward(gate, up, swiglu_limit, out_dtype, weight)

    @staticmethod
    def backward(ctx, go):
        gate, up, weight = ctx.saved_tensors
        i = gate.size(-1)
        rows = gate.numel() // i if i else 0
        g_gate = torch.empty_like(gate)
        g_up = torch.empty_like(up)
        g_w = torch.empty(weight.shape, dtype=torch.float32, device=gate.device) if weight is not None else None
        if rows and i:
            _bwd_kernel[(triton.cdiv(rows, BWD_ROWS),)](
                go.contiguous(),
                gate,
                up,
                weight if weight is not None else gate,
                g_gate,
                g_up,
                g_w if g_w is not None else g_gate,
                rows,
                i,
                float(ctx.limit),
                CLAMP=ctx.limit > 0,
                HAS_WEIGHT=weight is not None,
                BR=BWD_ROWS,
                BI=BWD_COLS,
                AT_LIMIT_G=_passes_at_the_limit("max"),
                AT_LIMIT_U=_passes_at_the_limit("both"),
                RNE_G=gate.dtype == torch.bfloat16,
                RNE_U=up.dtype == torch.bfloat16,
                INTERP=interpret_mode(),
            )
        elif g_w is not None:
            g_w.zero_()
        return g_gate, g_up, g_w, None, None


def triton_clamped_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    swiglu_limit: float,
    out_dtype: torch.dtype,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """As the reference `clamped_swiglu`, one launch (and one for the backward where autograd tracks an
    input)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (gate, up, weight)):
        return _ClampedSwiGLU.apply(gate, up, weight, swiglu_limit, out_dtype)
    return _forward(gate, up, swiglu_limit, out_dtype, weight)


def _can_run(gate, up, swiglu_limit, out_dtype, weight=None) -> str | None:
    tensors = [t for t in (gate, up, weight) if t is not None]
    reason = device_reason(*tensors)
    if reason:
        return reason
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
