"""Row-local ops of the attention path (backends "triton"): `fp8_round_trip`, `fp4_round_trip`,
`hadamard`, `compress_pool`, `pool_groups`. Each call is one kernel launch (backward: one more), with no host sync.

Round trips and `act_quant`: one program quantizes BM blocks of one row-major [rows, n] view (a row stride
is passed, so the model's `kv[..., :-64]` slice is read in place; a ragged last block of a row is masked).
They are bit-identical to the reference: the scale is `amax * fp32(1/qmax)`, rounded up to a power of two
from its bit fields (or kept as it is: FP8 with amax/448 scales, then a correctly rounded division), the
value is rounded to the E4M3 / E2M1 grid with exact integer-step arithmetic (round to nearest, ties to
even: the reference's "even code" rule), and the sign of zero is kept. `act_quant` writes the E4M3 bytes
assembled from the same integers. A block holding a NaN or an infinity becomes all NaN, as in the
reference's round trip (there `0 * inf` appears).

`hadamard`: an in-register fast Walsh-Hadamard transform (log2 n butterfly stages) of BR rows, then the
same fp32 factor `n^-0.5`; summation order differs from a matmul, so results agree with the reference to
fp32 rounding (a few ulp). Under `exact_accumulation()` the kernel adds in float64 like the reference and
rounds once (to odd first for a bf16 / fp16 output), which matches it bit for bit whenever the float64
sums are exact (+-1-weighted fp32 values spanning fewer than ~22 binades).

`compress_pool`: one program per (group, channel tile) holds all slots of the tile: max, exp, sum,
weights and the weighted sum in registers; the backward recomputes the softmax (nothing but the inputs is
saved). fp32 within a few ulp of the reference (exp is libdevice `expf`, as in torch's CUDA kernel).
`pool_groups` is the same kernel loading each slot from where it lies (this step's rows or the ring), so
its entries carry the bits that `compress_pool` gives the gathered groups; a group that is not live (a
paged step pools every group it touches, but keeps only the complete ones) costs one masked program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import register
from ..precision import acc_dtype
from ..reference import FP4_E2M1_MAX, FP8_E4M3_MAX, check_inplace
from ._common import Kernel, device_reason, interpret_mode
from ._common import rows_view as _rows

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HADAMARD = 4096
SQRT_HALF_BITS = tl.constexpr(0x3FE6A09E667F3BCD)  # float64 bits of sqrt(0.5)

# output allocator (tests swap in one that poisons the memory with NaN)
_alloc = torch.empty


# ----------------------------------------------------------------------------- kernels
def _round_trip_kernel(
    x_ptr,
    out_ptr,
    s_ptr,
    G,
    nb,
    n,
    stride_x,
    stride_o,
    stride_s,
    amax_floor,
    qmax,
    inv_qmax,
    BLOCK: tl.constexpr,
    BM: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    POW2: tl.constexpr,
    CODES: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Quantize BM blocks of BLOCK consecutive elements (the last block of a row may be ragged: n is the row
    length); block g is (row g // nb, g % nb). CODES: store the E4M3 bytes and the fp32 block scales
    (`act_quant`), else the dequantized values in out's dtype (the round trip)."""
    pid = tl.program_id(0)
    g = pid * BM + tl.arange(0, BM)  # [BM] block ids
    gmask = g < G
    row = (g // nb).to(tl.int64)
    col = (g % nb) * BLOCK
    offs = tl.arange(0, BLOCK)
    m2 = gmask[:, None] & ((col[:, None] + offs[None, :]) < n)
    x = tl.load(x_ptr + row[:, None] * stride_x + col[:, None] + offs[None, :], mask=m2, other=0.0).to(
        tl.float32
    )  # [BM, BLOCK]
    ax = tl.abs(x)
    finite = ax < float("inf")  # False for inf and NaN
    # a NaN or an infinity makes the reference's whole block NaN (amax / scale become NaN or inf)
    bad = tl.min(finite.to(tl.int32), axis=1) == 0
    amax = tl.maximum(tl.max(tl.where(finite, ax, 0.0), axis=1), amax_floor)  # [BM]
    y = amax * inv_qmax  # fp32, as the reference
    if POW2:
        # 2^ceil(log2 y) from the bit fields: exponent + 1 when any mantissa bit is set
        yb = y.to(tl.int32, bitcast=True)
        c = ((yb >> 23) & 0xFF) + ((yb & 0x7FFFFF) != 0).to(tl.int32) - 127
        c = tl.minimum(tl.maximum(c, -126), 126)  # finite blocks: inside
        scale = ((c + 127) << 23).to(tl.float32, bitcast=True)  # 2^c
        inv = ((127 - c) << 23).to(tl.float32, bitcast=True)  # 2^-c (c <= 126 here)
        v = x * inv[:, None]  # exact: power-of-two scaling
    else:
        scale = y
        v = tl.math.div_rn(x, scale[:, None])  # correctly rounded, as torch
    a = tl.minimum(tl.abs(v), qmax)
    # round |v| to the grid: MBITS mantissa bits above 2^EMIN, a fixed step 2^(EMIN-MBITS) below
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    up = ((127 + MBITS - e) << 23).to(tl.float32, bitcast=True)  # 1 / step
    step = ((127 - MBITS + e) << 23).to(tl.float32, bitcast=True)
    t = a * up  # < 2^(MBITS+1), exact
    r = (t + 8388608.0) - 8388608.0  # round to integer, ties to even
    qa = r * step
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    if CODES:
        # E4M3 byte of qa: normal (qa >= 2^-6) exponent field E + 7 and the top 3 mantissa bits, else the
        # subnormal step count qa / 2^-9 (the same integer r when e == EMIN)
        qb = qa.to(tl.int32, bitcast=True)
        ef = ((qb >> 23) & 0xFF) - 127 + 7
        normal = (ef > 0) & (qa > 0.0)
        mag = tl.where(normal, (ef << 3) | ((qb >> 20) & 7), r.to(tl.int32))
        code = mag | ((sign >> 24) & 0x80)
        code = tl.where(bad[:, None], 0x7F, code)  # the NaN byte
        tl.store(out_ptr + row[:, None] * stride_o + col[:, None] + offs[None, :], code.to(tl.uint8), mask=m2)
        sc = tl.where(bad, float("nan"), scale)
        tl.store(s_ptr + row * stride_s + (g % nb), sc, mask=gmask)
    else:
        q = (qa.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        out = q * scale[:, None]
        out = tl.where(bad[:, None], float("nan"), out)
        if RNE_BF16:  # amax/448 scales: q * s needs rounding; the interpreter truncates
            u = out.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            out = u.to(tl.float32, bitcast=True)
        tl.store(
            out_ptr + row[:, None] * stride_o + col[:, None] + offs[None, :], out.to(out_ptr.dtype.element_ty), mask=m2
        )


def _hadamard_kernel(
    x_ptr,
    out_ptr,
    R,
    stride_x,
    stride_o,
    scale,
    N: tl.constexpr,
    LOGN: tl.constexpr,
    BR: tl.constexpr,
    F64: tl.constexpr,
    ROUND_ODD: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """out = FWHT(x) * n^-0.5 for BR rows of N elements."""
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=rmask[:, None], other=0.0)
    if F64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    for st in tl.static_range(LOGN):  # butterfly on index bit st: (i, i + 2^st)
        x4 = tl.permute(tl.reshape(x, (BR, N >> (st + 1), 2, 1 << st)), (0, 1, 3, 2))  # [BR, N/2h, h, 2]
        lo, hi = tl.split(x4)
        x4 = tl.join(lo + hi, lo - hi)
        x = tl.reshape(tl.permute(x4, (0, 1, 3, 2)), (BR, N))
    if F64:
        s = tl.full((1,), 1.0, tl.float64)
        if LOGN % 2 == 1:  # n^-0.5 in float64, as Python computes it
            s = tl.full((1,), SQRT_HALF_BITS, tl.int64).to(tl.float64, bitcast=True)
        p2 = ((tl.full((1,), 1023 - LOGN // 2, tl.int64)) << 52).to(tl.float64, bitcast=True)
        x = x * (s * p2)[:, None]
        y = x.to(tl.float32)
        if ROUND_ODD:  # narrower output: fp64 -> fp32 rounds to odd, so the final rounding is single
            mag = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            over = tl.abs(y.to(tl.float64)) > tl.abs(x)
            mag = tl.where(over & (mag > 0), mag - 1, mag)
            t = (mag | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
            inexact = t.to(tl.float64) != x
            mag = tl.where(inexact & (mag < 0x7F800000), mag | 1, mag)
            y = (mag | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    else:
        y = x * scale
    if RNE_BF16:  # the interpreter truncates fp32 -> bf16
        u = y.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def _pool_kernel(
    kv_ptr,
    sc_ptr,
    g_ptr,
    out_ptr,
    dkv_ptr,
    dsc_ptr,
    C,
    skv_g,
    skv_s,
    ssc_g,
    ssc_s,
    sg_g,
    so_g,
    sdkv_g,
    sdkv_s,
    sdsc_g,
    sdsc_s,
    new_ptr,
    ring_ptr,
    live_ptr,
    rkv_ptr,
    rsc_ptr,
    snew,
    sring,
    srkv,
    srsc,
    S: tl.constexpr,
    SP: tl.constexpr,
    BC: tl.constexpr,
    BACKWARD: tl.constexpr,
    F64: tl.constexpr,
    INTERP: tl.constexpr,
    RNE_BF16: tl.constexpr,
    GATHER: tl.constexpr = False,
    R: tl.constexpr = 1,
):
    """Softmax over the S slots of score[g, :, c-tile], then the weighted sum of kv (or its gradients).

    GATHER (`pool_groups`, forward only): slot i of group g is row new[g, i] of kv / score ([T, W], row
    strides skv_s / ssc_s), or where that is -1 row ring[g, i] of rkv / rsc, at channels (i // R) * C + c;
    a group whose live byte is 0 stores 0 and returns (a decode step completes a group in one row of
    `ratio`: the others skipped the softmax over their slots, 11 calls 0.24 ms of a 2.7 ms step at 256 rows
    on the H200). The arithmetic after the loads is the same."""
    pid_g = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    ss = tl.arange(0, SP)
    cs = pid_c * BC + tl.arange(0, BC)
    cmask = cs < C
    m2 = (ss < S)[:, None] & cmask[None, :]
    if GATHER:
        if tl.load(live_ptr + pid_g) == 0:  # a group this step does not complete: 0, nothing read or computed
            tl.store(out_ptr + pid_g * so_g + cs, tl.zeros([BC], dtype=out_ptr.dtype.element_ty), mask=cmask)
            return
        nw = tl.load(new_ptr + pid_g * snew + ss, mask=ss < S, other=-1)  # [SP]
        rg = tl.load(ring_ptr + pid_g * sring + ss, mask=ss < S, other=0)
        col = (ss // R)[:, None] * C + cs[None, :]  # [SP, BC] channel of the W-wide row
        fresh = (nw >= 0)[:, None]
        mn = m2 & fresh
        mr = m2 & (nw < 0)[:, None]
        sc = tl.where(
            fresh,
            tl.load(sc_ptr + nw[:, None] * ssc_s + col, mask=mn, other=float("-inf")),
            tl.load(rsc_ptr + rg[:, None] * srsc + col, mask=mr, other=float("-inf")),
        )
        kv = tl.where(
            fresh,
            tl.load(kv_ptr + nw[:, None] * skv_s + col, mask=mn, other=0.0),
            tl.load(rkv_ptr + rg[:, None] * srkv + col, mask=mr, other=0.0),
        )
    else:
        sc = tl.load(sc_ptr + pid_g * ssc_g + ss[:, None] * ssc_s + cs[None, :], mask=m2, other=float("-inf"))
        kv = tl.load(kv_ptr + pid_g * skv_g + ss[:, None] * skv_s + cs[None, :], mask=m2, other=0.0)
    if F64:
        sc = sc.to(tl.float64)
        kv = kv.to(tl.float64)
    else:
        sc = sc.to(tl.float32)
        kv = kv.to(tl.float32)
    sc = tl.where(cmask[None, :], sc, 0.0)  # padded channels: finite, never stored
    mx = tl.max(sc, axis=0)  # [BC]
    z = sc - mx[None, :]
    if INTERP:
        p = tl.exp(z)
    else:
        p = libdevice.exp(z)
    if F64:
        w = p / tl.sum(p, axis=0)[None, :]  # [SP, BC] softmax weights
    else:
        w = tl.math.div_rn(p, tl.sum(p, axis=0)[None, :])  # (IEEE, not div.full)
    if BACKWARD:
        g = tl.load(g_ptr + pid_g * sg_g + cs, mask=cmask, other=0.0)
        if F64:
            g = g.to(tl.float64)
        else:
            g = g.to(tl.float32)
        dw = g[None, :] * kv  # d loss / d w
        dsc = w * (dw - tl.sum(dw * w, axis=0)[None, :])
        dkv = g[None, :] * w
        if RNE_BF16:
            u = dkv.to(tl.float32).to(tl.uint32, bitcast=True)
            dkv = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            u = dsc.to(tl.float32).to(tl.uint32, bitcast=True)
            dsc = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(
            dkv_ptr + pid_g * sdkv_g + ss[:, None] * sdkv_s + cs[None, :], dkv.to(dkv_ptr.dtype.element_ty), mask=m2
        )
        tl.store(
            dsc_ptr + pid_g * sdsc_g + ss[:, None] * sdsc_s + cs[None, :], dsc.to(dsc_ptr.dtype.element_ty), mask=m2
        )
    else:
        y = tl.sum(kv * w, axis=0)  # [BC]
        if RNE_BF16:
            u = y.to(tl.float32).to(tl.uint32, bitcast=True)
            y = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(out_ptr + pid_g * so_g + cs, y.to(out_ptr.dtype.element_ty), mask=cmask)


_rt_k = Kernel(_round_trip_kernel)
_had_k = Kernel(_hadamard_kernel)
_pool_k = Kernel(_pool_kernel)


def _launch_opts() -> dict:
    """Compiled kernels link libdevice without flush-to-zero, like nvcc's (and torch's) log2f / expf."""
    return {} if interpret_mode() or torch.version.hip else {"enable_reflect_ftz": False}


# ----------------------------------------------------------------------------- round trips
def _quant_launch(x: torch.Tensor, block: int, fp4: bool, pow2: bool, codes: bool, inplace: bool = False):
    """Launch the block quantizer over the rows of x: the round trip (out in x's dtype; inplace: out is x,
    whose rows view `_fp8_can_run` checked), or (codes) the E4M3 bytes [..., n] uint8 and the fp32 scales
    [..., ceil(n/block)]."""
    n = x.size(-1)
    nb = -(-n // block)
    if codes:
        out = _alloc(x.shape, dtype=torch.uint8, device=x.device)
        sc = _alloc(x.shape[:-1] + (nb,), dtype=torch.float32, device=x.device)
    else:
        out = x if inplace else _alloc(x.shape, dtype=x.dtype, device=x.device)
        sc = out
    if x.numel() == 0:
        return (out, sc) if codes else out
    x2 = _rows(x.detach())
    o2 = x2 if inplace else out.view(-1, n)  # (each program reads its blocks before it writes them)
    s2 = sc.view(-1, nb) if codes else o2
    blocks = x2.size(0) * nb
    bm = max(1, min(2048 // block, triton.next_power_of_2(blocks)))
    if fp4:
        floor, qmax, mbits, emin = FP4_E2M1_MAX * 2.0**-126, FP4_E2M1_MAX, 1, 0
    else:
        floor, qmax, mbits, emin = 1e-4, FP8_E4M3_MAX, 3, -6
    _rt_k[(triton.cdiv(blocks, bm),)](
        x2,
        o2,
        s2,
        blocks,
        nb,
        n,
        x2.stride(0),
        o2.stride(0),
        s2.stride(0),
        floor,
        qmax,
        1.0 / qmax,
        BLOCK=block,
        BM=bm,
        MBITS=mbits,
        EMIN=emin,
        POW2=pow2,
        CODES=codes,
        RNE_BF16=interpret_mode() and x.dtype == torch.bfloat16 and not codes,
        num_warps=4,
        **_launch_opts(),
    )
    return (out, sc) if codes else out


def _round_trip_forward(x: torch.Tensor, block: int, fp4: bool, pow2: bool = True) -> torch.Tensor:
    if fp4 and x.size(-1) % block:
        raise ValueError(f"fp4_round_trip: last dim {x.size(-1)} is not a multiple of block {block}")
    return _quant_launch(x, block, fp4, pow2, codes=False)


class _RoundTrip(torch.autograd.Function):
    """Forward: the quantized value. Backward: the identity (straight-through, as the reference)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, block: int, fp4: bool, pow2: bool) -> torch.Tensor:
        return _round_trip_forward(x, block, fp4, pow2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


def _round_trip(x: torch.Tensor, block: int, fp4: bool, pow2: bool = True) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _RoundTrip.apply(x, block, fp4, pow2)
    return _round_trip_forward(x, block, fp4, pow2)


def triton_fp8_round_trip(x: torch.Tensor, block: int = 64, pow2: bool = True, inplace: bool = False) -> torch.Tensor:
    if inplace:
        check_inplace(x, "fp8_round_trip")
        return _quant_launch(x, block, False, pow2, codes=False, inplace=True)
    return _round_trip(x, block, False, pow2)


def triton_fp4_round_trip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _round_trip(x, block, True)


def triton_act_quant(x: torch.Tensor, block: int = 128, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`act_quant` in one launch: E4M3 codes (as float8_e4m3fn) and fp32 block scales."""
    codes, scale = _quant_launch(x, block, False, pow2, codes=True)
    return codes.view(torch.float8_e4m3fn), scale


def _vector_reason(x: torch.Tensor) -> str | None:
    """Why a last-dim-wise kernel of this module cannot take x (None when it can)."""
    reason = device_reason(x)
    if reason:
        return reason
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} (need fp32, bf16 or fp16)"
    if x.dim() == 0:
        return "a 0-d tensor has no last dim"
    return None


def _round_trip_can_run(x: torch.Tensor, block: int = 32) -> str | None:
    reason = _vector_reason(x)
    if reason:
        return reason
    if block < 1 or block & (block - 1) or block > 4096:
        return f"block {block} is not a power of two in [1, 4096]"
    return None  # FP4: a last dim that is not a multiple of block raises the reference's ValueError


def _fp8_can_run(x: torch.Tensor, block: int = 64, pow2: bool = True, inplace: bool = False) -> str | None:
    if inplace and x.numel():  # written through its [rows, n] view: there must be one
        rows = x.reshape(-1, x.size(-1))
        if rows.stride(-1) != 1 or rows.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            return "inplace=True needs x's rows as one strided view with a contiguous last dim"
    return _round_trip_can_run(x, block)


def _act_quant_can_run(x: torch.Tensor, block: int = 128, pow2: bool = True) -> str | None:
    if not hasattr(torch, "float8_e4m3fn"):
        return "this torch has no float8_e4m3fn dtype"
    return _round_trip_can_run(x, block)


def _fp4_can_run(x: torch.Tensor, block: int = 32) -> str | None:
    return _round_trip_can_run(x, block)


# ----------------------------------------------------------------------------- hadamard
def _hadamard_forward(x: torch.Tensor) -> torch.Tensor:
    n = x.size(-1)
    out = _alloc(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2 = _rows(x)
    o2 = out.view(-1, n)
    rows = x2.size(0)
    f64 = acc_dtype() == torch.float64
    br = max(1, min(max(1, 2048 // n), triton.next_power_of_2(rows)))
    _had_k[(triton.cdiv(rows, br),)](
        x2,
        o2,
        rows,
        x2.stride(0),
        o2.stride(0),
        n**-0.5,
        N=n,
        LOGN=n.bit_length() - 1,
        BR=br,
        F64=f64,
        ROUND_ODD=f64 and x.dtype != torch.float32,
        RNE_BF16=interpret_mode() and x.dtype == torch.bfloat16,
        num_warps=4,
    )
    return out


class _Hadamard(torch.autograd.Function):
    """Linear and symmetric: the gradient is the transform of the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _hadamard_forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _hadamard_forward(grad)


def triton_hadamard(x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _Hadamard.apply(x)
    return _hadamard_forward(x)


def _hadamard_can_run(x: torch.Tensor) -> str | None:
    reason = _vector_reason(x)
    if reason:
        return reason
    n = x.size(-1)
    if n < 2 or n & (n - 1) or n > MAX_HADAMARD:
        return f"size {n} is not a power of two in [2, {MAX_HADAMARD}]"
    return None


# ----------------------------------------------------------------------------- compress_pool
def _pool_tiles(slots: int, c: int) -> tuple[int, int]:
    sp = triton.next_power_of_2(slots)
    bc = max(16, min(128, 4096 // sp, triton.next_power_of_2(c)))
    return sp, bc


def _no_gather(t: torch.Tensor) -> tuple:
    """pool_groups' kernel arguments, unused by compress_pool (any tensor stands for the pointers)."""
    return (t,) * 5 + (0,) * 4


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """[..., slots, c] as [groups, slots, c] with unit channel stride."""
    t3 = t.reshape(-1, t.size(-2), t.size(-1))
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def _pool_launch(kv: torch.Tensor, score: torch.Tensor, grad: torch.Tensor | None):
    slots, c = kv.shape[-2:]
    kv3, sc3 = _grouped(kv), _grouped(score)
    groups = kv3.size(0)
    sp, bc = _pool_tiles(slots, c)
    f64 = acc_dtype() == torch.float64
    grid = (groups, triton.cdiv(c, bc))
    interp = interpret_mode()
    if grad is None:
        out = _alloc(kv.shape[:-2] + (c,), dtype=kv.dtype, device=kv.device)
        if out.numel() == 0:
            return out
        o2 = out.view(-1, c)
        _pool_k[grid](
            kv3,
            sc3,
            o2,
            o2,
            o2,
            o2,
            c,
            kv3.stride(0),
            kv3.stride(1),
            sc3.stride(0),
            sc3.stride(1),
            0,
            o2.stride(0),
            0,
            0,
            0,
            0,
            *_no_gather(o2),
            S=slots,
            SP=sp,
            BC=bc,
            BACKWARD=False,
            F64=f64,
            INTERP=interp,
            RNE_BF16=interp and kv.dtype == torch.bfloat16,
            num_warps=4,
            **_launch_opts(),
        )
        return out
    dkv = _alloc(kv.shape, dtype=kv.dtype, device=kv.device)
    dsc = _alloc(score.shape, dtype=score.dtype, device=score.device)
    if dkv.numel() == 0:
        return dkv, dsc
    g2 = grad.reshape(-1, c)
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    dkv3, dsc3 = dkv.view(-1, slots, c), dsc.view(-1, slots, c)
    bf16 = interp and (kv.dtype == torch.bfloat16 or score.dtype == torch.bfloat16)
    if bf16 and kv.dtype != score.dtype:
        raise RuntimeError("compress_pool: mixed bf16 / non-bf16 inputs are not supported under the interpreter")
    _pool_k[grid](
        kv3,
        sc3,
        g2,
        g2,
        dkv3,
        dsc3,
        c,
        kv3.stride(0),
        kv3.stride(1),
        sc3.stride(0),
        sc3.stride(1),
        g2.stride(0),
        0,
        dkv3.stride(0),
        dkv3.stride(1),
        dsc3.stride(0),
        dsc3.stride(1),
        *_no_gather(g2),
        S=slots,
        SP=sp,
        BC=bc,
        BACKWARD=True,
        F64=f64,
        INTERP=interp,
        RNE_BF16=bf16,
        num_warps=4,
        **_launch_opts(),
    )
    return dkv, dsc


class _CompressPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(kv, score)
        return _pool_launch(kv, score, None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        kv, score = ctx.saved_tensors
        dkv, dsc = _pool_launch(kv, score, grad)
        return (dkv if ctx.needs_input_grad[0] else None), (dsc if ctx.needs_input_grad[1] else None)


def triton_compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (kv.requires_grad or score.requires_grad):
        return _CompressPool.apply(kv, score)
    return _pool_launch(kv.detach(), score.detach(), None)


def _pool_can_run(kv: torch.Tensor, score: torch.Tensor) -> str | None:
    reason = device_reason(kv, score)
    if reason:
        return reason
    if kv.dtype not in DTYPES or score.dtype not in DTYPES:
        return f"dtypes kv={kv.dtype} score={score.dtype} (need fp32, bf16 or fp16)"
    if kv.dim() < 2 or kv.shape != score.shape:
        return f"kv {tuple(kv.shape)} and score {tuple(score.shape)} must both be [..., slots, c]"
    if kv.size(-2) < 1 or kv.size(-2) > 1024:
        return f"{kv.size(-2)} slots (need 1..1024)"
    return None


# ----------------------------------------------------------------------------- pool_groups
def triton_pool_groups(
    kv: torch.Tensor,
    score: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_score: torch.Tensor,
    group_new: torch.Tensor,
    group_ring: torch.Tensor,
    live: torch.Tensor,
    coff: int,
) -> torch.Tensor:
    """`pool_groups` in one launch: the pooling kernel reading each slot's row where it lies (no gathered
    copies), with the tiles `compress_pool` takes for [G, n, c] groups, hence its bits. Groups that are not
    live read nothing."""
    g, n = group_new.shape
    c = kv.size(-1) // coff
    out = _alloc((g, c), dtype=kv.dtype, device=kv.device)
    if out.numel() == 0:
        return out
    sp, bc = _pool_tiles(n, c)
    new = group_new if group_new.stride(-1) == 1 else group_new.contiguous()
    ring = group_ring if group_ring.stride(-1) == 1 else group_ring.contiguous()
    live = live if live.stride(0) == 1 else live.contiguous()  # (read as live_ptr + group)
    interp = interpret_mode()
    _pool_k[(g, triton.cdiv(c, bc))](
        kv,
        score,
        out,
        out,
        out,
        out,
        c,
        0,
        kv.stride(0),
        0,
        score.stride(0),
        0,
        out.stride(0),
        0,
        0,
        0,
        0,
        new,
        ring,
        live.view(torch.uint8),
        ring_kv,
        ring_score,
        new.stride(0),
        ring.stride(0),
        ring_kv.stride(0),
        ring_score.stride(0),
        S=n,
        SP=sp,
        BC=bc,
        BACKWARD=False,
        F64=acc_dtype() == torch.float64,
        INTERP=interp,
        RNE_BF16=interp and kv.dtype == torch.bfloat16,
        GATHER=True,
        R=n // coff,
        num_warps=4,
        **_launch_opts(),
    )
    return out


def _pool_groups_can_run(
    kv: torch.Tensor,
    score: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_score: torch.Tensor,
    group_new: torch.Tensor,
    group_ring: torch.Tensor,
    live: torch.Tensor,
    coff: int,
) -> str | None:
    reason = device_reason(kv, score, ring_kv, ring_score, group_new, group_ring, live)
    if reason:
        return reason
    if torch.is_grad_enabled() and any(t.requires_grad for t in (kv, score, ring_kv, ring_score)):
        return "forward only: autograd records this call (pool_groups is the paged cache's inference path)"
    if kv.dtype not in DTYPES or any(t.dtype != kv.dtype for t in (score, ring_kv, ring_score)):
        kinds = f"kv={kv.dtype} score={score.dtype} rings={ring_kv.dtype}/{ring_score.dtype}"
        return f"dtypes {kinds} (need all fp32, all bf16 or all fp16)"
    if coff not in (1, 2):
        return f"coff {coff} (need 1 or 2)"
    if kv.dim() != 2 or score.shape != kv.shape or ring_kv.dim() != 2 or ring_score.shape != ring_kv.shape:
        return f"kv {tuple(kv.shape)}, score {tuple(score.shape)} and rings {tuple(ring_kv.shape)} must be [rows, W]"
    if ring_kv.size(1) != kv.size(1) or kv.size(1) % coff:
        return f"row widths {kv.size(1)} and {ring_kv.size(1)} must be equal and divisible by coff {coff}"
    if any(t.stride(-1) != 1 for t in (kv, score, ring_kv, ring_score)):
        return "rows must have unit channel stride"
    if group_new.dim() != 2 or group_ring.shape != group_new.shape or live.shape != group_new.shape[:1]:
        return f"group_new {tuple(group_new.shape)}, group_ring {tuple(group_ring.shape)}, live {tuple(live.shape)}"
    if group_new.dtype not in (torch.int32, torch.int64) or group_ring.dtype not in (torch.int32, torch.int64):
        return f"index dtypes {group_new.dtype} / {group_ring.dtype} (need int32 or int64)"
    if live.dtype != torch.bool:
        return f"live is {live.dtype} (need bool)"
    n = group_new.size(1)
    if n < 1 or n > 1024 or n % coff:
        return f"{n} slots (need 1..1024, divisible by coff {coff})"
    return None


# ----------------------------------------------------------------------------- registration
register("fp8_round_trip", "triton", triton_fp8_round_trip, can_run=_fp8_can_run, deterministic=True, priority=10)
register("fp4_round_trip", "triton", triton_fp4_round_trip, can_run=_fp4_can_run, deterministic=True, priority=10)
register("act_quant", "triton", triton_act_quant, can_run=_act_quant_can_run, deterministic=True, priority=10)
register("hadamard", "triton", triton_hadamard, can_run=_hadamard_can_run, deterministic=True, priority=10)
register("compress_pool", "triton", triton_compress_pool, can_run=_pool_can_run, deterministic=True, priority=10)
register("pool_groups", "triton", triton_pool_groups, can_run=_pool_groups_can_run, deterministic=True, priority=10)

__all__ = [
    "triton_fp8_round_trip",
    "triton_fp4_round_trip",
    "triton_hadamard",
    "triton_compress_pool",
    "triton_pool_groups",
]
