"""W8A8 GEMMs split along K for decode-sized calls: backend "triton_splitk" of `fp8_gemm` and `fp4_gemm`.

A few token rows against a weight of few row tiles give the dense kernel (`w8a8_gemm`) one program per
column tile: a 1024-row weight is 16 programs of 64 columns on a GPU of 132 SMs, each walking all of K
alone, so the weight is read at a fraction of the copy bandwidth. Here the K blocks (128 columns, one
activation scale each) are split into S consecutive ranges so that (column tiles x row tiles x S) is about
two programs per SM; each program sums its range's block products exactly as the dense kernel does
(`_b_tile`, `_block_dot`: the same FP8 values, scales and fp32 accumulation) into an fp32 partial, and a
second kernel adds the S partials in split order and rounds once to the output dtype. The sums are those
of the dense kernel grouped differently (fp32 rounding of the block sums only, the bound the tests use);
the order is fixed, so results repeat bit for bit.

Only for calls of at most `MAX_ROWS` token rows (decode); registered below the dense kernel's priority, so
it runs when asked for by name (`backend="triton_splitk"`, `dsv4 bench w8a8 --only decode` times every
backend) until a measurement makes it a default.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import register
from ..reference import ACT_BLOCK
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import launch as _launch
from ._mm_utils import round_to
from .w8a8_gemm import _b_tile, _block_dot, _fp4_can_run, _fp8_can_run, operands

MAX_ROWS = 64  # token rows up to which this backend runs (decode and small speculative verifies)
PROGRAMS_PER_SM = 2


@triton.jit
def _w8a8_splitk_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    p_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    bs_cols,
    per_split,
    FP4: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """P[s] [M, N] = sum over the K blocks kb of split s of (A_kb . W_kb^T) * (a_scale[:, kb] x w_scale[kb])."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    ks = tl.arange(0, BK)
    kb0 = pid_s * per_split
    kb1 = tl.minimum(kb0 + per_split, tl.cdiv(K, BK))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * BK
        a = tl.load(
            a_ptr + rm64[:, None] * stride_am + (k0 + ks)[None, :],
            mask=mmask[:, None] & ((k0 + ks) < K)[None, :],
            other=0.0,
        )
        sa = tl.load(as_ptr + rm64 * stride_asm + kb, mask=mmask, other=0.0)
        w, sw = _b_tile(
            b_ptr, bs_ptr, rn64, nmask, k0, K, stride_bn, stride_bsn, bs_cols, FP4, SCALE_E8M0, BN, BK, UPCAST
        )
        acc += _block_dot(a, w, UPCAST) * (sa[:, None] * sw[None, :])
    p_ptrs = p_ptr + pid_s.to(tl.int64) * M * N + rm64[:, None] * N + rn64[None, :]
    tl.store(p_ptrs, acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, c_ptr, MN, n_splits, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """C = P[0] + P[1] + ... in split order, rounded once to C's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in range(1, n_splits):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, round_to(acc, c_ptr.dtype.element_ty, UPCAST), mask=mask)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that the tests split K
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(m: int, n: int, k: int, bm: int, bn: int, sms: int, block: int = ACT_BLOCK) -> tuple[int, int]:
    """(S, K blocks of `block` columns per split): enough splits for PROGRAMS_PER_SM programs per SM, none
    of them empty."""
    nk = triton.cdiv(k, block)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    want = max(1, min(nk, triton.cdiv(PROGRAMS_PER_SM * sms, tiles)))
    per = triton.cdiv(nk, want)
    return triton.cdiv(nk, per), per


def _splitk(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, fp4: bool
) -> torch.Tensor:
    n = weight.size(0)
    a, sa, w, bs, e8m0 = operands(q, s, weight, scale, fp4)
    m, k = a.shape
    c = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m == 0:
        return c.view(*q.shape[:-1], n)
    bm, bn, warps = (16, 32, 4) if _INTERPRET else (64, 64, 4)
    n_splits, per = splits_for(m, n, k, bm, bn, _sm_count(q.device))
    partial = torch.empty(n_splits, m, n, dtype=torch.float32, device=q.device)
    args = (a, sa, w, bs, partial, m, n, k, a.stride(0), sa.stride(0), w.stride(0), bs.stride(0), bs.size(-1), per)
    meta = dict(FP4=fp4, SCALE_E8M0=e8m0, BM=bm, BN=bn, BK=ACT_BLOCK, UPCAST=_INTERPRET)
    if not _INTERPRET:
        meta.update(num_warps=warps, num_stages=4)
    _launch(_w8a8_splitk_kernel, (triton.cdiv(n, bn), n_splits, triton.cdiv(m, bm)), *args, **meta)
    block = 1024
    grid = (triton.cdiv(m * n, block),)
    _launch(_sum_splits_kernel, grid, partial, c, m * n, n_splits, BLOCK=block, UPCAST=_INTERPRET)
    return c.view(*q.shape[:-1], n)


def splitk_fp8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return _splitk(q, s, weight, scale, out_dtype, fp4=False)


def splitk_fp4_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return _splitk(q, s, weight, scale, out_dtype, fp4=True)


def _rows_reason(q: torch.Tensor) -> str | None:
    rows = q.numel() // max(q.size(-1), 1)
    if rows > MAX_ROWS:
        return f"{rows} token rows: the split-K kernel is for decode-sized calls (at most {MAX_ROWS})"
    return None


def _fp8_splitk_can_run(q, s, weight, scale, out_dtype=torch.bfloat16) -> str | None:
    return _fp8_can_run(q, s, weight, scale, out_dtype) or _rows_reason(q)


def _fp4_splitk_can_run(q, s, weight, scale, out_dtype=torch.bfloat16) -> str | None:
    return _fp4_can_run(q, s, weight, scale, out_dtype) or _rows_reason(q)


# below the dense kernel (priority 10): by name only, until measured (module docstring)
register("fp8_gemm", "triton_splitk", splitk_fp8_gemm, can_run=_fp8_splitk_can_run, deterministic=True, priority=5)
register("fp4_gemm", "triton_splitk", splitk_fp4_gemm, can_run=_fp4_splitk_can_run, deterministic=True, priority=5)
