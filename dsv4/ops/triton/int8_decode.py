"""INT8 W8A8 GEMMs split along K for decode-sized calls: backend "triton_splitk" of `int8_gemm`.

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
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import launch as _launch
from ._mm_utils import round_to
from .int8_gemm import _dense_can_run, operands
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

__all__ = ["MAX_ROWS", "splitk_int8_gemm"]
