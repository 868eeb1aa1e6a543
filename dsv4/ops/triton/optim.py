"""`muon_momentum` and `muon_apply` (backend "triton"): Muon's elementwise passes, one read of each tensor.

The batched Muon step (`dsv4.train.muon_batched.MuonPlan`) around its Newton-Schulz products was a chain of
whole-tensor ops: momentum lerp, Nesterov mix, a rounding to bf16 before Newton-Schulz; after it a widening
to the weight's dtype, the scaling, the weight decay and the add. Each reads and writes every Muon weight
(500M parameters at `small`), so those passes, not the products, were most of the update's time. Here:

- `_momentum_kernel`: reads buf and grad once, writes the new buf and the bf16 update;
- `_apply_kernel`: reads the weight and the bf16 update once, writes the weight.

The arithmetic is the reference's, operation by operation: torch's lerp formula (self + w (end - self)
for |w| < 0.5, else end - (end - self)(1 - w), in fp32, rounded to the tensor's dtype), each product of
the apply rounded before the add (no fused multiply-add there), so the results are the reference's up to
the contraction torch's own lerp kernel may make.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .. import register
from ._common import Kernel, device_reason, interpret_mode

BLOCK = 2048
DTYPES = (torch.float32, torch.bfloat16)


def _momentum_kernel(
    buf_ptr,
    grad_ptr,
    out_ptr,
    n,
    a,
    m,
    SMALL_A: tl.constexpr,
    SMALL_M: tl.constexpr,
    NESTEROV: tl.constexpr,
    RNE_BUF: tl.constexpr,
    RNE_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    b = tl.load(buf_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if SMALL_A:  # buf.lerp_(grad, a), a = 1 - momentum
        b = b + a * (g - b)
    else:
        b = g - (g - b) * (1.0 - a)
    if RNE_BUF:  # (the interpreter truncates fp32 -> bf16: round to nearest even first)
        r = b.to(tl.uint32, bitcast=True)
        b = ((r + 0x7FFF + ((r >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    b = b.to(buf_ptr.dtype.element_ty)
    tl.store(buf_ptr + offs, b, mask=ok)
    b = b.to(tl.float32)
    u = b
    if NESTEROV:  # grad.lerp(buf, m)
        if SMALL_M:
            u = g + m * (b - g)
        else:
            u = b - (b - g) * (1.0 - m)
        if RNE_BUF:
            r = u.to(tl.uint32, bitcast=True)
            u = ((r + 0x7FFF + ((r >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        u = u.to(buf_ptr.dtype.element_ty).to(tl.float32)
    if RNE_OUT:
        r = u.to(tl.uint32, bitcast=True)
        u = ((r + 0x7FFF + ((r >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, u.to(tl.bfloat16), mask=ok)


def _apply_kernel(w_ptr, o_ptr, decay_ptr, scale_ptr, n, RNE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ty = w_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # (bf16 or w's dtype: exact in fp32)
    kept = w * tl.load(decay_ptr)
    step = o * tl.load(scale_ptr)
    if RNE:  # bf16 weights on the interpreter: round each product to nearest even, as the compiled cast does
        r = kept.to(tl.uint32, bitcast=True)
        kept = ((r + 0x7FFF + ((r >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        r = step.to(tl.uint32, bitcast=True)
        step = ((r + 0x7FFF + ((r >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    total = kept.to(ty).to(tl.float32) + step.to(ty).to(tl.float32)
    if RNE:
        r = total.to(tl.uint32, bitcast=True)
        total = ((r + 0x7FFF + ((r >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(w_ptr + offs, total.to(ty), mask=ok)


_momentum = Kernel(_momentum_kernel)
_apply = Kernel(_apply_kernel)


def _opts(fuse: bool) -> dict:
    """Compiled: 4 warps; `fuse=False` keeps every product rounded before its sum (no FMA contraction)."""
    if interpret_mode():
        return {}
    return {"num_warps": 4} if fuse else {"num_warps": 4, "enable_fp_fusion": False}


def triton_muon_momentum(
    buf: torch.Tensor, grad: torch.Tensor, momentum: float, nesterov: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """As the reference `muon_momentum`, in one launch."""
    if out is None:
        out = torch.empty(buf.shape, dtype=torch.bfloat16, device=buf.device)
    n = buf.numel()
    if n == 0:
        return out
    a = float(np.float32(1 - momentum))  # lerp's weight as torch receives it (a double, used in fp32)
    m = float(np.float32(momentum))
    _momentum[(triton.cdiv(n, BLOCK),)](
        buf,
        grad,
        out,
        n,
        a,
        m,
        SMALL_A=abs(a) < 0.5,
        SMALL_M=abs(m) < 0.5,
        NESTEROV=bool(nesterov),
        RNE_BUF=interpret_mode() and buf.dtype == torch.bfloat16,
        RNE_OUT=interpret_mode(),
        BLOCK=BLOCK,
        **_opts(True),
    )
    return out


def triton_muon_apply(w: torch.Tensor, ortho: torch.Tensor, decay: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """As the reference `muon_apply`, in one launch."""
    n = w.numel()
    if n:
        rne = interpret_mode() and w.dtype == torch.bfloat16
        _apply[(triton.cdiv(n, BLOCK),)](w, ortho, decay, scale, n, RNE=rne, BLOCK=BLOCK, **_opts(False))
    return w


def _flat_reason(*ts: torch.Tensor) -> str | None:
    for t in ts:
        if not t.is_contiguous():
            return f"a non-contiguous tensor of shape {tuple(t.shape)}"
    return None


def _can_momentum(buf, grad, momentum, nesterov, out=None) -> str | None:
    ts = (buf, grad) if out is None else (buf, grad, out)
    reason = device_reason(*ts) or _flat_reason(*ts)
    if reason:
        return reason
    if grad.shape != buf.shape or grad.dtype != buf.dtype or buf.dtype not in DTYPES:
        return f"buf {tuple(buf.shape)} {buf.dtype} and grad {tuple(grad.shape)} {grad.dtype} (one shape, fp32 or bf16)"
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != buf.numel()):
        return f"out {tuple(out.shape)} {out.dtype} (need bf16 with buf's {buf.numel()} elements)"
    return None


def _can_apply(w, ortho, decay, scale) -> str | None:
    reason = device_reason(w, ortho, decay, scale) or _flat_reason(w, ortho)
    if reason:
        return reason
    if w.dtype not in DTYPES or ortho.numel() != w.numel():
        return f"w {tuple(w.shape)} {w.dtype}, ortho {tuple(ortho.shape)} (fp32 or bf16 weights, one size)"
    if decay.numel() != 1 or scale.numel() != 1 or decay.dtype != torch.float32 or scale.dtype != torch.float32:
        return "decay and scale must be one-element fp32 tensors"
    return None


register("muon_momentum", "triton", triton_muon_momentum, can_run=_can_momentum, deterministic=True, priority=10)
register("muon_apply", "triton", triton_muon_apply, can_run=_can_apply, deterministic=True, priority=10)
