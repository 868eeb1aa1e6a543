"""`cross_entropy` backend "triton": the training losses' mean cross entropy over fp32 logits, reading the
logits once forward and once backward. `F.cross_entropy` writes and saves the log-softmax ([N, V] fp32),
then its backward writes a one-hot gradient and reads both to write the logits' gradient: five [N, V]
passes where these kernels make three (at `medium`'s 4,096 x 129,280 logits, 2.1 GB a pass, per head).

Forward: one program per row walks V in blocks, each lane keeping a running max and a sum of exponentials
rescaled when its max moves, and picks the target's logit; the lanes are combined at the end into the
row's log-sum-exp and loss (lse - logit[target]; 0 for an ignored row; NaN for a target outside [0, V)).
The mean over the counted rows is a torch sum divided by the count, on the device (no host read).
Backward: programs over (row, block of V) write (exp(logit - lse) - [v == target]) * g / count, zeros in
ignored rows. Fixed orders, no atomics: repeats are bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import register
from ._common import Kernel, device_reason, interpret_mode

_alloc = torch.empty  # (the tests poison it: every output element must be written)


def _blocks() -> tuple[int, int]:
    """(logits per lane step of a row's forward walk, logits per backward program); small on the interpreter."""
    return (64, 64) if interpret_mode() else (2048, 4096)


def _ce_fwd_kernel(x_ptr, t_ptr, lse_ptr, loss_ptr, V, stride, ignore, BV: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    t = tl.load(t_ptr + row)
    m = tl.full((BV,), float("-inf"), tl.float32)  # per lane: running max and sum of exp(x - max)
    s = tl.zeros((BV,), dtype=tl.float32)
    picked = tl.zeros((BV,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        vs = v0 + tl.arange(0, BV)
        x = tl.load(base + vs, mask=vs < V, other=float("-inf"))
        m_new = tl.maximum(m, x)
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # (a lane that has seen only -inf keeps s = 0)
        if INTERP:
            e_old, e_new = tl.exp(m - m_ref), tl.exp(x - m_ref)
        else:  # libdevice's expf, torch's
            e_old, e_new = libdevice.exp(m - m_ref), libdevice.exp(x - m_ref)
        s = s * e_old + e_new
        m = m_new
        picked += tl.where(vs == t, x, 0.0)
    mx = tl.max(m, axis=0)
    mx_ref = tl.where(mx > float("-inf"), mx, 0.0)
    if INTERP:
        e = tl.exp(m - mx_ref)
    else:
        e = libdevice.exp(m - mx_ref)
    total = tl.sum(s * e, axis=0)
    if INTERP:
        lse = mx + tl.log(total)
    else:
        lse = mx + libdevice.log(total)
    x_t = tl.sum(picked, axis=0)
    valid = (t >= 0) & (t < V)
    loss = tl.where(t == ignore, 0.0, tl.where(valid, lse - x_t, float("nan")))
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, loss)


def _ce_bwd_kernel(x_ptr, t_ptr, lse_ptr, scale_ptr, gx_ptr, V, stride, ignore, BV: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    vmask = vs < V
    t = tl.load(t_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr)  # g / count
    x = tl.load(x_ptr + row.to(tl.int64) * stride + vs, mask=vmask, other=float("-inf"))
    if INTERP:
        p = tl.exp(x - lse)
    else:
        p = libdevice.exp(x - lse)
    g = (p - tl.where(vs == t, 1.0, 0.0)) * scale
    g = tl.where(t == ignore, 0.0, g)
    tl.store(gx_ptr + row.to(tl.int64) * V + vs, g, mask=vmask)


_fwd = Kernel(_ce_fwd_kernel)
_bwd = Kernel(_ce_bwd_kernel)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        n, v = logits.shape
        lse = _alloc((n,), dtype=torch.float32, device=logits.device)
        rows = _alloc((n,), dtype=torch.float32, device=logits.device)
        if n > 0:
            args = (logits, target, lse, rows, v, logits.stride(0), ignore_index)
            _fwd[(n,)](*args, BV=_blocks()[0], INTERP=interpret_mode(), num_warps=8)
        count = (target != ignore_index).sum().float()
        ctx.save_for_backward(logits, target, lse, count)
        ctx.ignore_index = ignore_index
        return rows.sum() / count

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        logits, target, lse, count = ctx.saved_tensors
        n, v = logits.shape
        gx = _alloc((n, v), dtype=torch.float32, device=logits.device)
        scale = (g.float() / count).reshape(1)
        if n > 0:
            bv = _blocks()[1]
            args = (logits, target, lse, scale, gx, v, logits.stride(0), ctx.ignore_index)
            _bwd[(n, triton.cdiv(v, bv))](*args, BV=bv, INTERP=interpret_mode(), num_warps=8)
        return gx, None, None


def triton_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return _CrossEntropy.apply(logits, target, ignore_index)


def _can_run(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> str | None:
    reason = device_reason(logits, target)
    if reason:
        return reason
    if logits.dim() != 2 or logits.dtype != torch.float32:
        return f"expects fp32 logits [N, V], got {logits.dtype} {tuple(logits.shape)}"
    if logits.stride(-1) != 1:
        return "expects logits whose rows are contiguous"
    if target.dim() != 1 or target.size(0) != logits.size(0) or target.dtype not in (torch.int64, torch.int32):
        return f"expects an int64 target [N] for logits [N, V], got {target.dtype} {tuple(target.shape)}"
    if logits.size(1) == 0:
        return "no classes (V = 0)"
    return None


register("cross_entropy", "triton", triton_cross_entropy, can_run=_can_run, deterministic=True, priority=10)
