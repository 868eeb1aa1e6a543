"""W8A8 GEMMs split along K for decode-sized calls: backend "triton_splitk" of `fp8_gemm`, `fp4_gemm` and
`quantized_moe_experts`.

A few token rows against a weight of few row tiles give the dense kernel (`w8a8_gemm`) one program per
column tile: a 1024-row weight is 16 programs of 64 columns on a GPU of 132 SMs, each walking all of K
alone, so the weight is read at a fraction of the copy bandwidth. Here the K blocks (128 columns, one
activation scale each) are split into S consecutive ranges so that (column tiles x row tiles x S) is about
two programs per SM; each program sums its range's block products exactly as the dense kernel does
(`_b_tile`, `_block_dot`: the same FP8 values, scales and fp32 accumulation) into an fp32 partial, and a
second kernel adds the S partials in split order and rounds once to the output dtype. The sums are those
of the dense kernel grouped differently (fp32 rounding of the block sums only, the bound the tests use);
the order is fixed, so results repeat bit for bit. The grouped experts (`quantized_moe_experts`: the
routing plan, tile table and activation quantizations of `w8a8_gemm.grouped_experts`) split each of their
three grouped GEMMs the same way; the partials are kept in sorted-row order and the sum kernel rounds and
scatters them as the grouped kernel writes its rows.

Only for calls of at most `MAX_ROWS` token rows (decode). At those sizes the MXFP4 experts run here by
default (measured 2.0-2.9x the dense kernel, `scripts/bench_fp4_experts.py`), and so do FP8 GEMMs with K >=
4096 and N >= 1024 (1.1-1.7x, `dsv4 bench w8a8 --only decode`); not in deterministic mode, where the dense
kernel runs every batch so that a row's sums do not change with its step's size. The other FP8 GEMMs, the
MXFP4 GEMMs and the FP8 experts run here when asked for by name (`backend="triton_splitk"`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import register
from ..precision import is_exact
from ..reference import ACT_BLOCK
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import launch as _launch
from ._mm_utils import round_to
from .quant_gemm import _e2m1
from .w8a8_gemm import (
    _b_tile,
    _block_dot,
    _fp4_can_run,
    _fp8_can_run,
    _moe_can_run,
    _scale_arg,
    grouped_experts,
    operands,
)

MAX_ROWS = 64  # token rows up to which this backend runs (decode and small speculative verifies)
PROGRAMS_PER_SM = 2
# the grouped experts' layout, from `scripts/bench_fp4_experts.py` (flash's shapes, one H100, BENCHMARKS.md):
# MXFP4 rows one at a time on the CUDA cores, about 16 programs per SM (2.0-2.9x the dense kernel at 1-64 tokens)
GROUPED_PROGRAMS_PER_SM = 16  # the grouped experts' split count: programs per SM it aims for
FP4_ROW_TILE = 1  # MXFP4 experts: row tiles of this many rows on the CUDA cores (0: tensor-core tiles)


@triton.jit
def e2m1_pair_as_e4m3(p):
    """A byte of two E2M1 codes (int32 0..255; element 2i in the low nibble) -> the E4M3 bytes (int32) of
    each value times 2^-6: magnitude bits two places up, the sign bit to the top (E2M1's 0.5 becomes
    E4M3's subnormal 4/8 x 2^-6; every other code a normal number, exactly)."""
    return ((p & 7) << 2) | ((p & 8) << 4), ((p >> 2) & 0x1C) | (p & 0x80)


@triton.jit
def _fp4_groups(
    a_ptr,
    a_rows,
    rmask,
    b_ptr,
    bs_ptr,
    rn64,
    nmask,
    k0,
    K,
    stride_am,
    stride_bn,
    stride_bsn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """sum over the 32-column groups g of K block k0 of (A_g . V_g^T) x 2^(e_g - 127), fp32 [BM, BN]: an
    MXFP4 weight's block product without its activation scale. Each group's E2M1 codes become E4M3 bytes by
    bit moves alone (magnitude bits up two places, the sign to the top: the value times 2^-6, 0.5 landing
    on E4M3's subnormal 2^-6 x 4/8), one FP8 dot per group, and the group's E8M0 scale on the dot's fp32
    result times 2^6: no per-weight arithmetic, where `_b_tile` decodes and scales every weight in fp32.
    The products are the same exact values; the block sum is grouped by 32 columns."""
    G: tl.constexpr = 32
    kg = tl.arange(0, G)
    kh = tl.arange(0, G // 2)
    block = tl.zeros((BM, BN), dtype=tl.float32)
    for g in tl.static_range(BK // G):
        kk = k0 + g * G + kg
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :], other=0.0
        )
        kb = (k0 + g * G) // 2 + kh
        p = (
            tl.load(
                b_ptr + rn64[:, None] * stride_bn + kb[None, :], mask=nmask[:, None] & (kb < K // 2)[None, :], other=0
            ).to(tl.int32)
            & 0xFF
        )  # [BN, 16] bytes: element 2i in the low nibble
        # (a scalar condition joins a mask through tl.where, not &: Triton 3.9's interpreter gives a splatted
        # scalar comparison int32 values, which no load takes as a mask)
        e = tl.load(
            bs_ptr + rn64 * stride_bsn + (k0 + g * G) // G, mask=tl.where(k0 + g * G < K, nmask, False), other=0
        )
        gs = ((e.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127)
        if UPCAST:  # (the interpreter: the same values in fp32)
            v = tl.reshape(tl.join(_e2m1(p & 0xF), _e2m1(p >> 4)), (BN, G)) * 0.015625
            d = tl.dot(a.to(tl.float32), tl.trans(v), input_precision="ieee")
        else:
            lo, hi = e2m1_pair_as_e4m3(p)
            v = tl.reshape(tl.join(lo, hi), (BN, G)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            d = tl.dot(a, tl.trans(v))
        block += (d * 64.0) * gs[None, :]  # (the 2^6 first: exact, and no overflow where the result has none)
    return block


@triton.jit
def _fp4_rows_sum(
    a_ptr,
    as_ptr,
    a_rows,
    rmask,
    b_ptr,
    bs_ptr,
    rn64,
    nmask,
    pid_s,
    per_split,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """`_split_sum` of an MXFP4 weight for a tile of a few rows (BM <= 8) on the CUDA cores, no tensor-core
    dot: each K block's 64 bytes per weight row are loaded once, their two codes per byte become fp32 values
    by bit moves (the E2M1 code as FP16 bits: the value times 2^-14, exactly), and each row's products with
    the even and odd activation columns are summed per 32-column group, scaled by the group's E8M0 scale,
    added over the block's groups and times the row's activation scale. The same exact products as the
    other paths; the sums grouped by 32 columns (the tests' fp32 sum bound)."""
    G: tl.constexpr = 32
    kh = tl.arange(0, BK // 2)
    rid = tl.arange(0, BM)
    kb0 = pid_s * per_split
    kb1 = tl.minimum(kb0 + per_split, tl.cdiv(K, BK))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * BK
        kbytes = k0 // 2 + kh
        p = (
            tl.load(
                b_ptr + rn64[:, None] * stride_bn + kbytes[None, :],
                mask=nmask[:, None] & (kbytes < K // 2)[None, :],
                other=0,
            ).to(tl.int32)
            & 0xFF
        )  # [BN, BK/2]
        lo = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((p & 0x80) << 8) | ((p & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        gk = k0 // G + tl.arange(0, BK // G)
        e = tl.load(
            bs_ptr + rn64[:, None] * stride_bsn + gk[None, :], mask=nmask[:, None] & (gk * G < K)[None, :], other=0
        )
        gs = ((e.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)  # [BN, BK/32]: 2^(e - 127)
        for r in tl.static_range(BM):
            row = tl.sum(tl.where(rid == r, a_rows, 0))  # (a row of the tile, as a scalar)
            ok = tl.sum(tl.where(rid == r, rmask.to(tl.int32), 0)) > 0
            ae = tl.load(
                a_ptr + row * stride_am + k0 + 2 * kh, mask=tl.where(ok, k0 + 2 * kh < K, False), other=0.0
            ).to(tl.float32)
            ao = tl.load(
                a_ptr + row * stride_am + k0 + 2 * kh + 1, mask=tl.where(ok, k0 + 2 * kh < K, False), other=0.0
            ).to(tl.float32)
            prod = lo * ae[None, :] + hi * ao[None, :]  # [BN, BK/2]: group g in bytes 16g .. 16g+15
            grp = tl.sum(tl.reshape(prod, (BN, BK // G, G // 2)), axis=2) * 16384.0  # [BN, BK/32] (2^14: exact)
            blk = tl.sum(grp * gs, axis=1)  # [BN]
            sa = tl.load(as_ptr + row * stride_asm + kb, mask=ok, other=0.0)
            acc = tl.where(rid[:, None] == r, acc + blk[None, :] * sa, acc)
    return acc


@triton.jit
def _split_sum(
    a_ptr,
    as_ptr,
    a_rows,
    rmask,
    b_ptr,
    bs_ptr,
    rn64,
    nmask,
    pid_s,
    per_split,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    bs_cols,
    FP4: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The fp32 sum over the K blocks of split pid_s of (A_kb . W_kb^T) x (a_scale[:, kb] x w_scale[kb]) for
    the activation rows a_rows [BM] (int64) and weight rows rn64 [BN]: the dense kernel's block sums."""
    ks = tl.arange(0, BK)
    kb0 = pid_s * per_split
    kb1 = tl.minimum(kb0 + per_split, tl.cdiv(K, BK))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if FP4 and BM <= 8:  # a few rows: on the CUDA cores
        return _fp4_rows_sum(a_ptr, as_ptr, a_rows, rmask, b_ptr, bs_ptr, rn64, nmask, pid_s, per_split, K,
                             stride_am, stride_asm, stride_bn, stride_bsn, BM, BN, BK)  # fmt: skip
    if FP4:
        for kb in range(kb0, kb1):
            sa = tl.load(as_ptr + a_rows * stride_asm + kb, mask=rmask, other=0.0)
            block = _fp4_groups(a_ptr, a_rows, rmask, b_ptr, bs_ptr, rn64, nmask, kb * BK, K, stride_am,
                                stride_bn, stride_bsn, BM, BN, BK, UPCAST)  # fmt: skip
            acc += block * sa[:, None]
        return acc
    for kb in range(kb0, kb1):
        k0 = kb * BK
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :],
            mask=rmask[:, None] & ((k0 + ks) < K)[None, :],
            other=0.0,
        )
        sa = tl.load(as_ptr + a_rows * stride_asm + kb, mask=rmask, other=0.0)
        w, sw = _b_tile(
            b_ptr, bs_ptr, rn64, nmask, k0, K, stride_bn, stride_bsn, bs_cols, FP4, SCALE_E8M0, BN, BK, UPCAST
        )
        acc += _block_dot(a, w, UPCAST) * (sa[:, None] * sw[None, :])
    return acc


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
    acc = _split_sum(
        a_ptr,
        as_ptr,
        rm64,
        mmask,
        b_ptr,
        bs_ptr,
        rn64,
        nmask,
        pid_s,
        per_split,
        K,
        stride_am,
        stride_asm,
        stride_bn,
        stride_bsn,
        bs_cols,
        FP4,
        SCALE_E8M0,
        BM,
        BN,
        BK,
        UPCAST,
    )
    p_ptrs = p_ptr + pid_s.to(tl.int64) * M * N + rm64[:, None] * N + rn64[None, :]
    tl.store(p_ptrs, acc, mask=mmask[:, None] & nmask[None, :])


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that the tests split K
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(
    m: int, n: int, k: int, bm: int, bn: int, sms: int, block: int = ACT_BLOCK, programs: int = PROGRAMS_PER_SM
) -> tuple[int, int]:
    """(S, K blocks of `block` columns per split): enough splits for `programs` programs per SM, none of
    them empty."""
    nk = triton.cdiv(k, block)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    want = max(1, min(nk, triton.cdiv(programs * sms, tiles)))
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
    # under exact accumulation (deterministic mode) the K split of one row tile whatever the batch
    n_splits, per = splits_for(1 if is_exact() else m, n, k, bm, bn, _sm_count(q.device))
    partial = torch.empty(n_splits, m, n, dtype=torch.float32, device=q.device)
    args = (a, sa, w, bs, partial, m, n, k, a.stride(0), sa.stride(0), w.stride(0), bs.stride(0), bs.size(-1), per)
    meta = dict(FP4=fp4, SCALE_E8M0=e8m0, BM=bm, BN=bn, BK=ACT_BLOCK, UPCAST=_INTERPRET)
    if not _INTERPRET:
        meta.update(num_warps=warps, num_stages=4)
    _launch(_w8a8_splitk_kernel, (triton.cdiv(n, bn), n_splits, triton.cdiv(m, bm)), *args, **meta)
    _sum_splits(partial, c)
    return c.view(*q.shape[:-1], n)


def splitk_fp8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return _splitk(q, s, weight, scale, out_dtype, fp4=False)


def splitk_fp4_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return _splitk(q, s, weight, scale, out_dtype, fp4=True)


# ----------------------------------------------------------------------------- grouped experts
@triton.jit
def _w8a8_gmm_splitk_kernel(
    a_ptr,
    as_ptr,
    a_idx_ptr,
    b_ptr,
    bs_ptr,
    p_ptr,
    tile_group_ptr,
    tile_row_ptr,
    tile_end_ptr,
    M,
    N,
    K,
    n_groups,
    stride_am,
    stride_asm,
    stride_be,
    stride_bse,
    stride_bn,
    stride_bsn,
    bs_cols,
    per_split,
    GATHER_A: tl.constexpr,
    FP4: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """P[s, r] = the W8A8 product of sorted row r with its group's weight over the K blocks of split s (the
    grouped kernel's tiles and sums); rows of the foreign bucket (g >= n_groups) are zeros."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    g = tl.load(tile_group_ptr + pid_m)
    row0 = tl.load(tile_row_ptr + pid_m)
    rend = tl.load(tile_end_ptr + pid_m)
    if row0 >= rend:
        return
    rows = row0 + tl.arange(0, BM)
    rmask = rows < rend
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rows64 = rows.to(tl.int64)
    p_ptrs = p_ptr + pid_s.to(tl.int64) * M * N + rows64[:, None] * N + rn[None, :]
    smask = rmask[:, None] & nmask[None, :]
    if g >= n_groups:
        tl.store(p_ptrs, tl.zeros((BM, BN), dtype=tl.float32), mask=smask)
        return
    if GATHER_A:
        a_rows = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        a_rows = rows64
    b_base = b_ptr + g.to(tl.int64) * stride_be
    bs_base = bs_ptr + g.to(tl.int64) * stride_bse
    acc = _split_sum(
        a_ptr,
        as_ptr,
        a_rows,
        rmask,
        b_base,
        bs_base,
        rn.to(tl.int64),
        nmask,
        pid_s,
        per_split,
        K,
        stride_am,
        stride_asm,
        stride_bn,
        stride_bsn,
        bs_cols,
        FP4,
        SCALE_E8M0,
        BM,
        BN,
        BK,
        UPCAST,
    )
    tl.store(p_ptrs, acc, mask=smask)


@triton.jit
def _sum_splits_rows_kernel(
    p_ptr,
    c_ptr,
    c_idx_ptr,
    N,
    MN,
    stride_cm,
    n_splits,
    SCATTER_C: tl.constexpr,
    BLOCK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """C[out row of r] = P[0, r] + P[1, r] + ... in split order, rounded once (out row: c_idx[r] or r)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in range(1, n_splits):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    r = offs // N
    if SCATTER_C:
        r = tl.load(c_idx_ptr + r, mask=mask, other=0).to(tl.int64)
    tl.store(c_ptr + r * stride_cm + offs % N, round_to(acc, c_ptr.dtype.element_ty, UPCAST), mask=mask)


def _sum_splits(partial: torch.Tensor, out: torch.Tensor, c_idx: torch.Tensor | None = None) -> None:
    """out[row] (out[c_idx[row]] given c_idx) = the sum of partial [S, M, N] over S in split order, rounded."""
    n_splits, m, n = partial.shape
    block = 1024
    args = (partial, out, c_idx if c_idx is not None else partial, n, m * n, out.stride(0), n_splits)
    grid = (triton.cdiv(m * n, block),)
    _launch(_sum_splits_rows_kernel, grid, *args, SCATTER_C=c_idx is not None, BLOCK=block, UPCAST=_INTERPRET)


def _launch_gmm_splitk(a, sa, b, bs, out, tiles, *, fp4: bool, a_idx=None, c_idx=None) -> None:
    """`w8a8_gemm._launch_gmm`, its K split over about two programs per SM: fp32 partials of the sorted
    rows, then their sum in split order, rounded to out's dtype and scattered (c_idx) as the grouped
    kernel writes them."""
    n, k, m = b.size(1), a.size(1), out.size(0)
    bsv, e8m0 = _scale_arg(bs)
    bn = 32 if _INTERPRET else 64
    # the tile table's row tiles (an upper bound: some may be empty) in place of cdiv(M, BM); under exact
    # accumulation (deterministic mode) one row tile whatever the batch, so that a row's K splits, and so
    # its sums, do not depend on the other rows of the step
    row_tiles = 1 if is_exact() else tiles.n_tiles
    n_splits, per = splits_for(row_tiles, n, k, 1, bn, _sm_count(a.device), programs=GROUPED_PROGRAMS_PER_SM)
    partial = torch.empty(n_splits, m, n, dtype=torch.float32, device=a.device)
    dummy = tiles.group
    args = (
        a,
        sa,
        a_idx if a_idx is not None else dummy,
        b,
        bsv,
        partial,
        tiles.group,
        tiles.row,
        tiles.end,
        m,
        n,
        k,
        tiles.n_groups,
        a.stride(0),
        sa.stride(0),
        b.stride(0),
        bsv.stride(0),
        b.stride(1),
        bsv.stride(1),
        bsv.size(-1),
        per,
    )
    meta = dict(GATHER_A=a_idx is not None, FP4=fp4, SCALE_E8M0=e8m0, BM=tiles.bm, BN=bn, BK=ACT_BLOCK)
    meta["UPCAST"] = _INTERPRET
    if not _INTERPRET:
        meta.update(num_warps=4, num_stages=4)
    _launch(_w8a8_gmm_splitk_kernel, (triton.cdiv(n, bn), tiles.n_tiles, n_splits), *args, **meta)
    _sum_splits(partial, out, c_idx)


def splitk_quantized_moe_experts(
    x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset=0, fmt="fp8", act="ue8m0"
) -> torch.Tensor:
    """`quantized_moe_experts` with its three grouped GEMMs split along K (decode-sized calls)."""
    args = (x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset, fmt, act)
    bm = FP4_ROW_TILE if fmt == "fp4" and FP4_ROW_TILE else None  # (rows on the CUDA cores: `_fp4_rows_sum`)
    return grouped_experts(*args, launch=_launch_gmm_splitk, bm=bm)


def _moe_splitk_can_run(
    x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset=0, fmt="fp8", act="ue8m0"
) -> str | None:
    args = (x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset, fmt, act)
    return _moe_can_run(*args) or _rows_reason(x)


def _rows_reason(q: torch.Tensor) -> str | None:
    rows = q.numel() // max(q.size(-1), 1)
    if rows > MAX_ROWS:
        return f"{rows} token rows: the split-K kernel is for decode-sized calls (at most {MAX_ROWS})"
    return None


def _fp8_splitk_can_run(q, s, weight, scale, out_dtype=torch.bfloat16) -> str | None:
    return _fp8_can_run(q, s, weight, scale, out_dtype) or _rows_reason(q)


def _fp4_splitk_can_run(q, s, weight, scale, out_dtype=torch.bfloat16) -> str | None:
    return _fp4_can_run(q, s, weight, scale, out_dtype) or _rows_reason(q)


# FP8 GEMMs of at least these sizes take the split-K kernel by default at decode sizes: `dsv4 bench w8a8
# --only decode` (flash's shapes, one H100, three runs: BENCHMARKS.md) had it faster at 1, 16 and 64 rows for K = 4096
# or 8192 with N >= 1024 (wq_a, wo_b, the shared expert's w1: 1.1-1.7x) and no faster for K <= 2048 or the
# 512-row wkv, where the dense kernel's column tiles fill the GPU already
FP8_SPLITK_MIN_K = 4096
FP8_SPLITK_MIN_N = 1024


def _fp8_splitk_prefer(q, s, weight, scale, out_dtype=torch.bfloat16) -> bool:
    """The default for the deep FP8 GEMMs above, outside deterministic mode (there a row's sums must not
    depend on whether its step holds more than MAX_ROWS rows, past which the dense kernel's grouping runs)."""
    return not is_exact() and q.size(-1) >= FP8_SPLITK_MIN_K and weight.size(0) >= FP8_SPLITK_MIN_N


def _moe_splitk_prefer(
    x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset=0, fmt="fp8", act="ue8m0"
) -> bool:
    """The default for MXFP4 experts (their row tiles on the CUDA cores) outside deterministic mode (as
    above); FP8 experts keep the dense kernel."""
    return fmt == "fp4" and not is_exact()


# below the dense kernel (priority 10) by name; above it where a `prefer` says so (deep FP8 GEMMs, MXFP4
# experts), and always refusing calls of more than MAX_ROWS rows
register(
    "fp8_gemm",
    "triton_splitk",
    splitk_fp8_gemm,
    can_run=_fp8_splitk_can_run,
    deterministic=True,
    priority=11,
    prefer=_fp8_splitk_prefer,
)
register("fp4_gemm", "triton_splitk", splitk_fp4_gemm, can_run=_fp4_splitk_can_run, deterministic=True, priority=5)
register(
    "quantized_moe_experts",
    "triton_splitk",
    splitk_quantized_moe_experts,
    can_run=_moe_splitk_can_run,
    deterministic=True,
    priority=11,
    prefer=_moe_splitk_prefer,
)
