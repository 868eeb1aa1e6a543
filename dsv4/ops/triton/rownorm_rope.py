"""Row-wise RMS normalization and the rotary embedding of a head's tail (backends "triton"): `rms_norm`,
`rope_tail`. Each forward is one kernel launch; no host sync anywhere (fixed shapes, positions read on
the device), so both stay inside captured CUDA graphs.

`rms_norm`: one program normalizes BR rows held in registers (the whole row: n up to MAX_NORM). fp32 as
the reference; the sum of squares is added in another order than torch's `mean`, so results agree to
fp32 rounding (a few ulp; the bf16 outputs are nearly always identical). `rsqrt` is libdevice's
(`rsqrtf`, as in torch's CUDA kernel) when compiled. Backward: one launch computes dx and, when there is
a weight, per-program partial sums of `g * x_hat` over its rows; a second launch adds the partials in a
fixed order (no atomics: the weight gradient is bitwise repeatable for a given shape and device).

`rope_tail`: one program handles BR rows of x [b, s, (h,) d] through its strides: the first d - r dims
are copied unchanged (same bits), the last r are rotated pairwise in fp32 with the reference's formula,
each product and sum rounded separately (no FMA contraction), with libdevice `cosf` / `sinf` when
compiled, so the compiled kernel reproduces torch's CUDA results. The backward is the same kernel with the
inverse rotation applied to the incoming gradient. `inplace=True` (inference) writes into x and skips the
copy of the first d - r dims: a [T, h, 512] head with a 64-dim tail moves an eighth of the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import register
from ..precision import is_exact
from ..reference import check_inplace
from ._common import Kernel, device_reason, interpret_mode, num_sms
from ._common import rows_view as _rows

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NORM = 16384  # widest row held in registers by one program
MAX_ROPE_DIM = 16384

# output allocator (tests swap in one that poisons the memory with NaN)
_alloc = torch.empty


# ----------------------------------------------------------------------------- kernels
def _norm_fwd_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    R,
    N,
    stride_x,
    stride_o,
    inv_n,
    eps,
    BN: tl.constexpr,
    BR: tl.constexpr,
    HAS_W: tl.constexpr,
    INTERP: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """out = (w *) x * rsqrt(mean(x^2) + eps) for BR rows of N elements, in fp32."""
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BN)
    cmask = cols < N
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) * inv_n + eps  # [BR]
    if INTERP:
        r = tl.rsqrt(ms)
    else:
        r = libdevice.rsqrt(ms)
    y = x * r[:, None]
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = w[None, :] * y
    if RNE_BF16:  # the interpreter truncates fp32 -> bf16
        u = y.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m2)


def _norm_bwd_kernel(
    x_ptr,
    w_ptr,
    g_ptr,
    dx_ptr,
    dwp_ptr,
    R,
    N,
    rows_per_prog,
    stride_x,
    stride_g,
    stride_dx,
    inv_n,
    eps,
    BN: tl.constexpr,
    BR: tl.constexpr,
    HAS_W: tl.constexpr,
    INTERP: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """dx for rows [pid * rows_per_prog, ...) in chunks of BR, and (HAS_W) this program's partial
    weight gradient sum(g * x_hat) over those rows into row pid of dwp [programs, N] (fp32)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    cmask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BN,), dtype=tl.float32)
    start = pid * rows_per_prog
    for off in range(0, rows_per_prog, BR):
        rows = start + off + tl.arange(0, BR)
        rmask = (rows < R) & (off + tl.arange(0, BR) < rows_per_prog)
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=1) * inv_n + eps
        if INTERP:
            r = tl.rsqrt(ms)
        else:
            r = libdevice.rsqrt(ms)
        if HAS_W:
            dw += tl.sum(g * (x * r[:, None]), axis=0)
            gx = g * w[None, :]  # d loss / d x_hat
        else:
            gx = g
        # d/dx [x r] = r g - x r^3 mean(g x)
        dot = tl.sum(gx * x, axis=1)  # [BR]
        c = -(dot * (r * r * r)) * inv_n
        dx = gx * r[:, None] + x * c[:, None]
        if RNE_BF16:
            u = dx.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            dx = u.to(tl.float32, bitcast=True)
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
    if HAS_W:
        tl.store(dwp_ptr + pid.to(tl.int64) * N + cols, dw, mask=cmask)


def _col_sum_kernel(p_ptr, out_ptr, P, N, BP: tl.constexpr, BC: tl.constexpr, RNE_BF16: tl.constexpr):
    """out[c] = sum_p p[p, c] over a [P, N] fp32 matrix, always in the same order (tiles of BP rows)."""
    pid = tl.program_id(0)
    cols = pid * BC + tl.arange(0, BC)
    cmask = cols < N
    acc = tl.zeros((BP, BC), dtype=tl.float32)
    for p0 in range(0, P, BP):
        ps = p0 + tl.arange(0, BP)
        m2 = (ps < P)[:, None] & cmask[None, :]
        acc += tl.load(p_ptr + ps.to(tl.int64)[:, None] * N + cols[None, :], mask=m2, other=0.0)
    total = tl.sum(acc, axis=0)
    if RNE_BF16:
        u = total.to(tl.uint32, bitcast=True)
        total = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cmask)


def _rope_kernel(
    x_ptr,
    pos_ptr,
    f_ptr,
    out_ptr,
    R,
    S,
    H,
    sxb,
    sxs,
    sxh,
    sob,
    sos,
    soh,
    pos_stride,
    NOPE: tl.constexpr,
    BNOPE: tl.constexpr,
    RH: tl.constexpr,
    BRH: tl.constexpr,
    BR: tl.constexpr,
    INVERSE: tl.constexpr,
    INTERP: tl.constexpr,
    RNE_BF16: tl.constexpr,
    COPY_NOPE: tl.constexpr,
):
    """BR rows (b, s, h) of x: copy the first NOPE dims (unless out is x: COPY_NOPE False), rotate the RH
    interleaved pairs after them."""
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    hi = rows64 % H
    si = (rows64 // H) % S
    bi = rows64 // (H * S)
    xrow = x_ptr + bi * sxb + si * sxs + hi * sxh  # [BR] pointers
    orow = out_ptr + bi * sob + si * sos + hi * soh
    if NOPE > 0 and COPY_NOPE:
        c = tl.arange(0, BNOPE)
        m = rmask[:, None] & (c < NOPE)[None, :]
        v = tl.load(xrow[:, None] + c[None, :], mask=m, other=0.0)
        tl.store(orow[:, None] + c[None, :], v, mask=m)
    j = tl.arange(0, BRH)
    jmask = j < RH
    # the tail as one contiguous [BR, 2 BRH] tile (vector loads and stores), split into its even and odd
    # dims in registers: two loads and two stores of every other element cost several times the bandwidth
    c2 = tl.arange(0, 2 * BRH)
    mt = rmask[:, None] & (c2 < 2 * RH)[None, :]
    tail = tl.load(xrow[:, None] + NOPE + c2[None, :], mask=mt, other=0.0).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(tail, (BR, BRH, 2)))  # [BR, BRH] each
    pos = tl.load(pos_ptr + si * pos_stride, mask=rmask, other=0).to(tl.float32)  # [BR]
    f = tl.load(f_ptr + j, mask=jmask, other=0.0).to(tl.float32)  # [BRH]
    ang = pos[:, None] * f[None, :]
    if INTERP:
        cs = tl.cos(ang)
        sn = tl.sin(ang)
    else:
        cs = libdevice.cos(ang)
        sn = libdevice.sin(ang)
    if INVERSE:
        sn = -sn
    a = x0 * cs
    b = x1 * sn
    y0 = a - b
    a = x0 * sn
    b = x1 * cs
    y1 = a + b
    if RNE_BF16:
        u = y0.to(tl.uint32, bitcast=True)
        y0 = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        u = y1.to(tl.uint32, bitcast=True)
        y1 = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    ety = out_ptr.dtype.element_ty
    y = tl.reshape(tl.join(y0, y1), (BR, 2 * BRH))
    tl.store(orow[:, None] + NOPE + c2[None, :], y.to(ety), mask=mt)


_norm_fwd_k = Kernel(_norm_fwd_kernel)
_norm_bwd_k = Kernel(_norm_bwd_kernel)
_col_sum_k = Kernel(_col_sum_kernel)
_rope_k = Kernel(_rope_kernel)


def _launch_opts() -> dict:
    """Compiled: libdevice without flush-to-zero (as torch's CUDA kernels), and no FMA contraction, so
    every product and sum rounds like torch's separate elementwise kernels."""
    if interpret_mode():
        return {}
    opts = {"enable_fp_fusion": False}
    if not torch.version.hip:
        opts["enable_reflect_ftz"] = False
    return opts


def _bf16_fix(dtype: torch.dtype) -> bool:
    return interpret_mode() and dtype == torch.bfloat16


# ----------------------------------------------------------------------------- rms_norm
def _norm_tiles(n: int, rows: int) -> tuple[int, int, int]:
    """(columns, rows per program, warps). The rows per program set how a program's threads share a row,
    and so the order of its sum: under exact accumulation (the engine's deterministic mode) they do not
    follow the row count, so that a row's norm rounds the same alone and in a batch."""
    bn = triton.next_power_of_2(n)
    most = max(1, 4096 // bn)
    br = most if is_exact() else max(1, min(most, triton.next_power_of_2(max(rows, 1))))
    warps = 4 if bn * br <= 4096 else 8
    return bn, br, warps


def _norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    n = x.size(-1)
    out = _alloc(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2 = _rows(x)
    o2 = out.view(-1, n)
    rows = x2.size(0)
    bn, br, warps = _norm_tiles(n, rows)
    w = weight if weight is not None else x2
    _norm_fwd_k[(triton.cdiv(rows, br),)](
        x2,
        w,
        o2,
        rows,
        n,
        x2.stride(0),
        o2.stride(0),
        1.0 / n,
        eps,
        BN=bn,
        BR=br,
        HAS_W=weight is not None,
        INTERP=interpret_mode(),
        RNE_BF16=_bf16_fix(x.dtype),
        num_warps=warps,
        **_launch_opts(),
    )
    return out


def _norm_backward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, grad: torch.Tensor, need_w: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.size(-1)
    dx = _alloc(x.shape, dtype=x.dtype, device=x.device)
    has_w = weight is not None
    if x.numel() == 0:
        dw = torch.zeros(n, dtype=weight.dtype, device=x.device) if has_w and need_w else None
        return dx, dw
    x2, g2 = _rows(x), _rows(grad)
    d2 = dx.view(-1, n)
    rows = x2.size(0)
    bn, br, warps = _norm_tiles(n, rows)
    progs = max(1, min(triton.cdiv(rows, br), 4 * num_sms(x.device)))
    per = triton.cdiv(rows, progs)
    progs = triton.cdiv(rows, per)
    partial = _alloc((progs, n), dtype=torch.float32, device=x.device) if has_w else d2
    w = weight if has_w else x2
    _norm_bwd_k[(progs,)](
        x2,
        w,
        g2,
        d2,
        partial,
        rows,
        n,
        per,
        x2.stride(0),
        g2.stride(0),
        d2.stride(0),
        1.0 / n,
        eps,
        BN=bn,
        BR=br,
        HAS_W=has_w,
        INTERP=interpret_mode(),
        RNE_BF16=_bf16_fix(x.dtype),
        num_warps=warps,
        **_launch_opts(),
    )
    if not (has_w and need_w):
        return dx, None
    dw = _alloc((n,), dtype=weight.dtype, device=x.device)
    bc = min(32, triton.next_power_of_2(n))
    _col_sum_k[(triton.cdiv(n, bc),)](
        partial, dw, progs, n, BP=32, BC=bc, RNE_BF16=_bf16_fix(weight.dtype), num_warps=4, **_launch_opts()
    )
    return dx, dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _norm_forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_w = weight is not None and ctx.needs_input_grad[1]
        dx, dw = _norm_backward(x, weight, ctx.eps, grad, need_w)
        return (dx if ctx.needs_input_grad[0] else None), dw, None


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _RMSNorm.apply(x, weight, eps)
    return _norm_forward(x.detach(), None if weight is None else weight.detach(), eps)


def _norm_can_run(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> str | None:
    reason = device_reason(x) if weight is None else device_reason(x, weight)
    if reason:
        return reason
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} (need fp32, bf16 or fp16)"
    if x.dim() == 0:
        return "a 0-d tensor has no last dim"
    n = x.size(-1)
    if n < 1 or n > MAX_NORM:
        return f"row width {n} (need 1..{MAX_NORM})"
    if weight is not None:
        if weight.dtype not in DTYPES:
            return f"weight dtype {weight.dtype} (need fp32, bf16 or fp16)"
        if weight.shape != (n,):
            return f"weight shape {tuple(weight.shape)} (need [{n}])"
        if weight.stride(0) != 1:
            return "weight is not contiguous"
    return None


# ----------------------------------------------------------------------------- rope_tail
def _rope_launch(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool, inplace: bool = False
) -> torch.Tensor:
    """-> x rotated (a new tensor; inplace=True: x itself, its tail rewritten, the rest not touched)."""
    s, d = x.size(1), x.size(-1)
    rh = inv_freq.numel()
    if positions.numel() not in (1, s):
        raise ValueError(f"rope_tail: {positions.numel()} positions for {s} tokens")
    if inplace and x.stride(-1) != 1:  # the kernel addresses rows through strides, dims contiguously
        return x.copy_(_rope_launch(x, positions, inv_freq, inverse))
    out = x if inplace else _alloc(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    xv = x if x.stride(-1) == 1 else x.contiguous()
    x4 = xv.unsqueeze(2) if xv.dim() == 3 else xv  # [b, s, h, d]
    o4 = out.unsqueeze(2) if out.dim() == 3 else out
    b, _, h, _ = x4.shape
    rows = b * s * h
    nope = d - 2 * rh
    brh = triton.next_power_of_2(rh)
    # rows per program: 4096 // the row's padded width (in place too: 128 rows of a 64-dim tail per program
    # made a 1,600-token step's RoPE 1.48 ms against 0.41 ms with 8 rows on an H200), and few enough rows
    # that the grid keeps about 512 programs (a batch-64 decode step's 4,096 head rows as 32 programs of 128
    # took 0.73 ms per step against 0.06 ms as 512 programs of 8)
    width = max(brh, triton.next_power_of_2(max(nope, 1)))
    br = max(1, min(4096 // width, triton.next_power_of_2(triton.cdiv(rows, 512))))
    pos = positions if positions.stride(0) == 1 or positions.numel() == 1 else positions.contiguous()
    freq = inv_freq if inv_freq.stride(0) == 1 else inv_freq.contiguous()
    _rope_k[(triton.cdiv(rows, br),)](
        x4,
        pos,
        freq,
        o4,
        rows,
        s,
        h,
        x4.stride(0),
        x4.stride(1),
        x4.stride(2),
        o4.stride(0),
        o4.stride(1),
        o4.stride(2),
        0 if positions.numel() == 1 else pos.stride(0),
        NOPE=nope,
        BNOPE=triton.next_power_of_2(max(nope, 1)),
        RH=rh,
        BRH=brh,
        BR=br,
        INVERSE=inverse,
        INTERP=interpret_mode(),
        RNE_BF16=_bf16_fix(x.dtype),
        COPY_NOPE=not inplace,
        num_warps=4,
        **_launch_opts(),
    )
    return out


class _RopeTail(torch.autograd.Function):
    """Linear in x: the gradient is the inverse rotation of the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool):
        ctx.save_for_backward(positions, inv_freq)
        ctx.inverse = inverse
        return _rope_launch(x, positions, inv_freq, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        positions, inv_freq = ctx.saved_tensors
        return _rope_launch(grad, positions, inv_freq, not ctx.inverse), None, None, None


def triton_rope_tail(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, inplace: bool = False
) -> torch.Tensor:
    if inplace:
        check_inplace(x)
        return _rope_launch(x, positions, inv_freq, inverse, inplace=True)
    if torch.is_grad_enabled() and x.requires_grad:
        return _RopeTail.apply(x, positions, inv_freq, inverse)
    return _rope_launch(x.detach(), positions, inv_freq, inverse)


def _rope_can_run(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, inplace: bool = False
) -> str | None:
    reason = device_reason(x, positions, inv_freq)
    if reason:
        return reason
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} (need fp32, bf16 or fp16)"
    if x.dim() not in (3, 4):
        return f"x must be [b, s, d] or [b, s, h, d], got {x.dim()}-d"
    if positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32):
        return f"positions must be a 1-d int64 / int32 tensor, got {positions.dim()}-d {positions.dtype}"
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        return f"inv_freq must be a 1-d fp32 tensor, got {inv_freq.dim()}-d {inv_freq.dtype}"
    r = 2 * inv_freq.numel()
    if r < 2 or r > x.size(-1) or x.size(-1) > MAX_ROPE_DIM:
        return f"rope dims {r} must lie in [2, d={x.size(-1)}] (d <= {MAX_ROPE_DIM})"
    return None


# ----------------------------------------------------------------------------- registration
register("rms_norm", "triton", triton_rms_norm, can_run=_norm_can_run, deterministic=True, priority=10)
register("rope_tail", "triton", triton_rope_tail, can_run=_rope_can_run, deterministic=True, priority=10)

__all__ = ["triton_rms_norm", "triton_rope_tail"]
