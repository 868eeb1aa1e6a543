"""INT8 W8A8 for decode-sized calls: backend "triton_splitk" of `int8_gemm`, and backend "triton" of
`int8_linear` (the activations' quantization and the GEMM in one launch; last section; by name only).

At a few token rows the dense kernel (`int8_gemm`) has one program per column tile, each walking all of K:
a narrow weight leaves most SMs idle while it is read. Here the K blocks are split into S consecutive
ranges so that (column tiles x row tiles x S) is about two programs per SM (`w8a8_decode.splits_for`);
each program writes its INT32 sum of INT8 products, and a second kernel adds the S partials and
dequantizes as the reference does (fp32(sum) x token scale x row scale, one rounding). INT32 sums are exact
in any grouping, so the results equal the reference (and the dense kernel) bit for bit.

Only for calls of at most `MAX_ROWS` token rows; registered below the dense kernel's priority, so it runs
when asked for by name (`backend="triton_splitk"`) until a measurement makes it a default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import register
from ..reference import INT8_AMAX_FLOOR, INT8_MAX
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import device_reason, round_to
from ._mm_utils import launch as _launch
from .int8_gemm import INT32_MAX, OUT_DTYPES, _dense_can_run, _int8_cores_reason, operands
from .w8a8_decode import MAX_ROWS, _rows_reason, _sm_count, splits_for


@triton.jit
def _int8_splitk_kernel(
    a_ptr, b_ptr, p_ptr, M, N, K, stride_am, stride_bn, per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    """P[s] [M, N] = A . B^T over the K blocks of split s, as INT32 (exact)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    ks = tl.arange(0, BK)
    kb0 = pid_s * per_split
    kb1 = tl.minimum(kb0 + per_split, tl.cdiv(K, BK))
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for kb in range(kb0, kb1):
        k = kb * BK + ks
        kmask = k < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0)
        b = tl.load(b_ptr + rn[None, :] * stride_bn + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    p_ptrs = p_ptr + pid_s.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(p_ptrs, acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _int8_dequant_splits_kernel(
    p_ptr, as_ptr, bs_ptr, c_ptr, N, MN, n_splits, BLOCK: tl.constexpr, UPCAST: tl.constexpr
):
    """C = fp32(P[0] + P[1] + ...) x a_scale[m] x b_scale[n], rounded once to C's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0)
    for s in range(1, n_splits):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0)
    sa = tl.load(as_ptr + offs // N, mask=mask, other=0.0)
    sb = tl.load(bs_ptr + offs % N, mask=mask, other=0.0)
    y = acc.to(tl.float32) * sa * sb
    tl.store(c_ptr + offs, round_to(y, c_ptr.dtype.element_ty, UPCAST), mask=mask)


def splitk_int8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    n = weight.size(0)
    a, sa, w, sb = operands(q, s, weight, scale)
    m, k = a.shape
    c = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m == 0:
        return c.view(*q.shape[:-1], n)
    bm, bn, bk = (16, 32, 64) if _INTERPRET else (16, 64, 256)
    n_splits, per = splits_for(m, n, k, bm, bn, _sm_count(q.device), block=bk)
    partial = torch.empty(n_splits, m, n, dtype=torch.int32, device=q.device)
    meta = dict(BM=bm, BN=bn, BK=bk)
    if not _INTERPRET:
        meta.update(num_warps=4, num_stages=4)
    grid = (triton.cdiv(n, bn), n_splits, triton.cdiv(m, bm))
    _launch(_int8_splitk_kernel, grid, a, w, partial, m, n, k, a.stride(0), w.stride(0), per, **meta)
    block = 1024
    grid = (triton.cdiv(m * n, block),)
    _launch(_int8_dequant_splits_kernel, grid, partial, sa, sb, c, n, m * n, n_splits, BLOCK=block, UPCAST=_INTERPRET)
    return c.view(*q.shape[:-1], n)


def _splitk_can_run(q, s, weight, scale, out_dtype=torch.float32) -> str | None:
    return _dense_can_run(q, s, weight, scale, out_dtype) or _rows_reason(q)


# below the dense kernel (priority 10): by name only, until measured (module docstring)
register("int8_gemm", "triton_splitk", splitk_int8_gemm, can_run=_splitk_can_run, deterministic=True, priority=5)


# ----------------------------------------------------------------------------- int8_linear, fused
# At a few token rows an INT8 linear was two launches, the activations' quantization and the GEMM, against
# one bf16 GEMV, and the launches, not the weight bytes, set a decode step's time. Here each program
# quantizes its (at most BM) rows itself, with the operations of `int8_quant`'s kernel (`int8_quant.py`):
# a first pass over the row for amax (the rows are a few KB and stay in L2 for every column tile), a
# second that quantizes each K block and multiplies it with the weight's block in INT32. The codes, the
# INT32 sums and the dequantization are the reference's, so the result is `int8_gemm(int8_quant(x))` bit
# for bit.
FUSED_MAX_ROWS = 16  # token rows up to which the fused kernel runs (one row tile: each program quantizes all)


@triton.jit
def _int8_linear_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_cm,
    floor,
    qmax,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """C [M, N] = int8_gemm(int8_quant(X)) for X [M, K] float and W [N, K] int8 with row scales [N]."""
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BM).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    ks = tl.arange(0, BK)
    big = tl.zeros((BM, BK), tl.float32)
    nan = tl.zeros((BM, BK), tl.int32)
    for k0 in range(0, K, BK):
        m2 = mmask[:, None] & ((k0 + ks) < K)[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + ks)[None, :], mask=m2, other=0.0).to(tl.float32)
        nan = tl.maximum(nan, (x != x).to(tl.int32))
        big = tl.maximum(big, tl.where(x == x, tl.abs(x), 0.0))
    amax = tl.maximum(tl.max(big, axis=1), floor)
    amax = tl.where(tl.max(nan, axis=1) > 0, float("nan"), amax)
    s = tl.math.div_rn(amax, qmax)  # [BM] the tokens' scales
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        m2 = mmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + ks)[None, :], mask=m2, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, s[:, None])
        a = tl.minimum((tl.abs(v) + 8388608.0) - 8388608.0, qmax)  # round half to even, then clamp
        r = tl.where(v < 0, -a, a)
        q = tl.where(v == v, r, 0.0).to(tl.int8)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + (k0 + ks)[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        acc = tl.dot(q, b, acc, out_dtype=tl.int32)
    sb = tl.load(ws_ptr + rn, mask=nmask, other=0.0)
    y = acc.to(tl.float32) * s[:, None] * sb[None, :]
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :],
        round_to(y, c_ptr.dtype.element_ty, UPCAST),
        mask=mmask[:, None] & nmask[None, :],
    )


def fused_int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    n, k = weight.shape
    x2 = x.detach().reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.size(0)
    c = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        w, sb = weight.contiguous(), scale.float().contiguous()
        bm, bk = 16, (64 if _INTERPRET else 256)
        # narrow weights: 16 columns per program, so that the grid still covers the SMs
        bn = 32 if triton.cdiv(n, 32) >= _sm_count(x.device) else 16
        meta = dict(BM=bm, BN=bn, BK=bk, UPCAST=_INTERPRET)
        if not _INTERPRET:
            meta.update(num_warps=4, num_stages=3)
        args = (x2, w, sb, c, m, n, k, x2.stride(0), w.stride(0), c.stride(0), INT8_AMAX_FLOOR, float(INT8_MAX))
        _launch(_int8_linear_kernel, (triton.cdiv(n, bn),), *args, **meta)
    return c.view(*x.shape[:-1], n)


def _fused_can_run(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> str | None:
    reason = device_reason(x) or _int8_cores_reason(x)
    if reason:
        return reason
    if x.dtype not in OUT_DTYPES or (out_dtype or x.dtype) not in OUT_DTYPES:
        return f"x and out_dtype must be fp32, bf16 or fp16, got {x.dtype} and {out_dtype}"
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.size(1) != x.size(-1) or x.size(-1) == 0:
        return f"weight must be int8 [N, K={x.size(-1)}] with K >= 1, got {weight.dtype} {tuple(weight.shape)}"
    if tuple(scale.shape) != (weight.size(0),):
        return f"scale must be one per weight row ({weight.size(0)},), got {tuple(scale.shape)}"
    if len({x.device, weight.device, scale.device}) != 1:
        return "operands on several devices"
    if x.size(-1) * 127 * 127 > INT32_MAX:
        return f"K = {x.size(-1)} can overflow the INT32 sums"
    rows = x.numel() // x.size(-1)
    if rows > FUSED_MAX_ROWS:
        return f"{rows} token rows: the fused kernel is for decode-sized calls (at most {FUSED_MAX_ROWS})"
    return None


# by name only: on one H200 (2026-12-05, `small`) decoding with it ran 0.71x / 0.89x bf16 at batch 1 / 16,
# against 0.96x / 0.97x for backend "parts" (int8_quant's kernel, then int8_gemm's): every column tile
# quantizes the whole row again (21 us a call at one row, BENCHMARKS.md)
register("int8_linear", "triton", fused_int8_linear, can_run=_fused_can_run, deterministic=True, priority=3)

__all__ = ["FUSED_MAX_ROWS", "MAX_ROWS", "fused_int8_linear", "splitk_int8_gemm"]
