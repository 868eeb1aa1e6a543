"""W8A8 GEMMs on FP8 tensor cores: FP8 activations x FP8 / MXFP4 weights (the official numerics).

Backends "triton" of `fp8_gemm`, `fp4_gemm` and `quantized_moe_experts`, and backend "scaled_mm" of
`fp8_gemm` (torch's block-scaled matmul, cuBLAS, where this torch and GPU support 1x128 / 128x128 scales).

The activations arrive quantized by `act_quant` (E4M3 codes, one fp32 scale per token and 128 columns).
Each program walks K in blocks of 128 (one activation scale per block): the block's FP8 x FP8 product is
accumulated in fp32 by the tensor cores, then added into the result times (activation scale x weight
scale), as the official `fp8_gemm` kernel does. Weights:
- FP8 E4M3 [N, K] with 128x128 block scales (E8M0 bytes or fp32): the column scale of a K block is the
  scale of the column's 128-row block.
- MXFP4 [N, K/2] (two E2M1 codes per byte, low nibble first) with one E8M0 scale per 32 elements: the tile
  is dequantized to FP8 inside the kernel. For each column, the K block's four 32-group exponents e_g are
  taken relative to their largest r: the FP8 value is code * 2^(e_g - r + 6) (at most 6 * 64 = 384 < 448)
  and the column scale 2^(r - 127 - 6). This is exact while the four exponents of a column's K block lie
  within 2^14 of each other (E4M3 subnormals reach 2^-9); `fp4_tiles_exact` checks that, and the backend
  refuses weights for which it does not hold.

Results agree with the reference (dequantize both operands, fp32 matmul) to fp32 rounding of the block
sums; on Hopper the FP8 products of one 128-block are accumulated by the tensor cores with their own
(reduced) precision before each fp32 promotion, as in the official kernel.

Grouped experts (`quantized_moe_experts`): the routing plan and tile table of `dsv4.ops.triton.moe` (no
host sync); x is quantized once per token and each tile gathers its rows; gate and up are two grouped
GEMMs (rows gathered, output in the activation dtype, as the official linears round their output), then
the clamped SwiGLU with the routing weight, rounded to the activation dtype and quantized by
`act_quant`, then the down projection, scattered back to slot order; a token's k slots are summed in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from .. import register
from ..moe_shared import clamped_swiglu, gate_dtype
from ..reference import ACT_BLOCK, act_pow2
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import device_reason, grouped_tile, round_to
from ._mm_utils import launch as _launch
from .moe import _block_m, _plan_and_tiles, sum_slots
from .quant_gemm import _e2m1, _e8m0


@triton.jit
def _b_tile(
    b_ptr,
    bs_ptr,
    rn,
    nmask,
    k0,
    K,
    stride_bn,
    stride_bsn,
    bs_cols,
    FP4: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The weight tile of K block k0 as FP8 values [BN, BK] (fp32 under UPCAST) and its column scale [BN]."""
    if FP4:
        kb = k0 // 2 + tl.arange(0, BK // 2)
        p = (
            tl.load(
                b_ptr + rn[:, None] * stride_bn + kb[None, :], mask=nmask[:, None] & (kb < K // 2)[None, :], other=0
            ).to(tl.int32)
            & 0xFF
        )
        v = tl.reshape(tl.join(_e2m1(p & 0xF), _e2m1(p >> 4)), (BN, BK))  # element 2i = low nibble
        gs = k0 // 32 + tl.arange(0, BK // 32)
        eg = (
            tl.load(
                bs_ptr + rn[:, None] * stride_bsn + gs[None, :], mask=nmask[:, None] & (gs < K // 32)[None, :], other=0
            ).to(tl.int32)
            & 0xFF
        )  # [BN, BK/32]
        r = tl.max(eg, axis=1)  # [BN]
        f = (tl.maximum(eg - r[:, None] + 133, 0) << 23).to(tl.float32, bitcast=True)  # 2^(e_g - r + 6)
        w = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * f[:, :, None], (BN, BK))
        col = _e8m0(r) * 0.015625  # 2^(r - 127 - 6)
        if not UPCAST:
            w = w.to(tl.float8e4nv)  # exact (see the docstring)
        return w, col
    else:
        ks = k0 + tl.arange(0, BK)
        w = tl.load(b_ptr + rn[:, None] * stride_bn + ks[None, :], mask=nmask[:, None] & (ks < K)[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
        s_off = (rn // 128) * bs_cols + k0 // 128
        if SCALE_E8M0:
            col = _e8m0(tl.load(bs_ptr + s_off, mask=nmask, other=127).to(tl.int32) & 0xFF)
        else:
            col = tl.load(bs_ptr + s_off, mask=nmask, other=1.0)
        return w, col


@triton.jit
def _block_dot(a, w, UPCAST: tl.constexpr):
    """a [BM, BK] @ w[BN, BK]^T with fp32 accumulation (FP8 tensor cores when compiled)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


@triton.jit
def _w8a8_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_cm,
    stride_bn,
    stride_bsn,
    bs_cols,
    M_BUCKET,
    FP4: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """C [M, N] = sum over 128-blocks kb of (A_kb . W_kb^T) * (a_scale[:, kb] x w_scale[kb])."""
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(
            a_ptr + rm64[:, None] * stride_am + (k0 + ks)[None, :],
            mask=mmask[:, None] & ((k0 + ks) < K)[None, :],
            other=0.0,
        )
        sa = tl.load(as_ptr + rm64 * stride_asm + k0 // BK, mask=mmask, other=0.0)
        w, sw = _b_tile(
            b_ptr, bs_ptr, rn64, nmask, k0, K, stride_bn, stride_bsn, bs_cols, FP4, SCALE_E8M0, BN, BK, UPCAST
        )
        acc += _block_dot(a, w, UPCAST) * (sa[:, None] * sw[None, :])
    c_ptrs = c_ptr + rm64[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty, UPCAST), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _w8a8_gmm_kernel(
    a_ptr,
    as_ptr,
    a_idx_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    c_idx_ptr,
    tile_group_ptr,
    tile_row_ptr,
    tile_end_ptr,
    N,
    K,
    n_groups,
    stride_am,
    stride_asm,
    stride_be,
    stride_bse,
    stride_bn,
    stride_bsn,
    stride_cm,
    bs_cols,
    GATHER_A: tl.constexpr,
    SCATTER_C: tl.constexpr,
    FP4: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """C[r] = A[r] @ W[g]^T (W8A8) for the rows r of group g; rows of foreign groups are written as zeros."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.load(tile_group_ptr + pid_m)
    row0 = tl.load(tile_row_ptr + pid_m)
    rend = tl.load(tile_end_ptr + pid_m)
    if row0 >= rend:
        return
    rows = row0 + tl.arange(0, BM)
    rmask = rows < rend
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    if SCATTER_C:
        out_rows = tl.load(c_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    c_ptrs = c_ptr + out_rows[:, None] * stride_cm + rn[None, :]
    smask = rmask[:, None] & nmask[None, :]
    if g >= n_groups:  # slots of other ranks' experts: defined zeros
        tl.store(c_ptrs, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=smask)
        return
    if GATHER_A:
        a_rows = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    rn64 = rn.to(tl.int64)
    b_base = b_ptr + g.to(tl.int64) * stride_be
    bs_base = bs_ptr + g.to(tl.int64) * stride_bse
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :],
            mask=rmask[:, None] & ((k0 + ks) < K)[None, :],
            other=0.0,
        )
        sa = tl.load(as_ptr + a_rows * stride_asm + k0 // BK, mask=rmask, other=0.0)
        w, sw = _b_tile(
            b_base, bs_base, rn64, nmask, k0, K, stride_bn, stride_bsn, bs_cols, FP4, SCALE_E8M0, BN, BK, UPCAST
        )
        acc += _block_dot(a, w, UPCAST) * (sa[:, None] * sw[None, :])
    tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty, UPCAST), mask=smask)


_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "GROUP": 8}, num_warps=w, num_stages=s)
    # row tiles of 64 at least (one Hopper warpgroup MMA); few-token calls are bound by the weight read, for
    # which narrow column tiles give every SM a share
    for bm, bn, w, s in (
        (128, 128, 8, 4),
        (128, 256, 8, 3),
        (64, 128, 4, 4),
        (128, 64, 4, 4),
        (64, 64, 4, 4),
        (64, 32, 4, 5),
        (64, 16, 4, 6),
    )
]
_GMM_CONFIGS = [
    triton.Config({"BN": bn}, num_warps=w, num_stages=s)
    for bn, w, s in ((128, 8, 4), (128, 4, 4), (64, 4, 4), (256, 8, 3))
]
# the dense kernel is tuned per token-count bucket (an argument the kernel does not read), not per M
_w8a8_tuned = triton.autotune(_CONFIGS, key=["M_BUCKET", "N", "K", "FP4", "SCALE_E8M0"])(_w8a8_kernel)


def _m_bucket(m: int) -> int:
    """Token counts are tuned per power of two (up to 4096)."""
    return min(triton.next_power_of_2(max(m, 1)), 4096)


_gmm_tuned = triton.autotune(_GMM_CONFIGS, key=["N", "K", "BM", "FP4", "GATHER_A", "SCATTER_C"])(_w8a8_gmm_kernel)


# ----------------------------------------------------------------------------- host side
def _is_e8m0(scale: torch.Tensor) -> bool:
    return scale.dtype in (torch.uint8, torch.int8) or "e8m0" in str(scale.dtype)


def _scale_arg(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    e8m0 = _is_e8m0(scale)
    return (scale.view(torch.uint8) if e8m0 else scale.float()).contiguous(), e8m0


def _fp8_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float8_e4m3fn else t.view(torch.uint8).view(torch.float8_e4m3fn)


def operands(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp4: bool):
    """The dense kernels' operands: activations [M, K] as E4M3 and their scales [M, K/128] (fp32), the
    weight's bytes (E4M3, or packed E2M1) and its scales (E8M0 bytes or fp32) -> (a, sa, w, bs, e8m0)."""
    a = _fp8_view(q).reshape(-1, q.size(-1)).contiguous()
    sa = s.reshape(-1, s.size(-1)).float().contiguous()
    w = weight.view(torch.uint8).contiguous() if fp4 else _fp8_view(weight).contiguous()
    return (a, sa, w, *_scale_arg(scale))


def _dense(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, fp4: bool
) -> torch.Tensor:
    n = weight.size(0)
    a, sa, w, bs, e8m0 = operands(q, s, weight, scale, fp4)
    m, k = a.shape
    c = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m == 0:
        return c.view(*q.shape[:-1], n)
    args = (
        a,
        sa,
        w,
        bs,
        c,
        m,
        n,
        k,
        a.stride(0),
        sa.stride(0),
        c.stride(0),
        w.stride(0),
        bs.stride(0),
        bs.size(-1),
        _m_bucket(m),
    )
    if _INTERPRET:
        _launch(
            _w8a8_kernel,
            (triton.cdiv(m, 16) * triton.cdiv(n, 32),),
            *args,
            FP4=fp4,
            SCALE_E8M0=e8m0,
            BM=16,
            BN=32,
            BK=ACT_BLOCK,
            GROUP=4,
            UPCAST=True,
        )
    else:
        _w8a8_tuned[lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)](
            *args, FP4=fp4, SCALE_E8M0=e8m0, BK=ACT_BLOCK, UPCAST=False
        )
    return c.view(*q.shape[:-1], n)


def triton_fp8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return _dense(q, s, weight, scale, out_dtype, fp4=False)


def triton_fp4_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return _dense(q, s, weight, scale, out_dtype, fp4=True)


# ----------------------------------------------------------------------------- MXFP4 tiles as FP8
FP4_SPAN_MAX = 14  # E8M0 exponent spread within a column's 128-block that the FP8 tile holds exactly
_SPAN_OK: WeakIdKeyDictionary = WeakIdKeyDictionary()  # scale tensor -> (its version, answer)


def fp4_tiles_exact(scale: torch.Tensor) -> bool:
    """True when every row's four per-32 exponents of each 128-column block lie within 2^FP4_SPAN_MAX of
    their maximum, so the in-kernel FP8 tiles hold the MXFP4 weight exactly. scale [..., N, K/32] E8M0.
    Cached per scale tensor (one reduction and one host read the first time)."""
    hit = _SPAN_OK.get(scale)
    if hit is not None and hit[0] == scale._version:
        return hit[1]
    b = scale.view(torch.uint8).to(torch.int16)
    g = b.size(-1)
    pad = (-g) % 4
    if pad:
        b = torch.nn.functional.pad(b, (0, pad), value=-1)  # padding never the max, never the min
    blocks = b.unflatten(-1, (-1, 4))
    top = blocks.amax(-1, keepdim=True)
    low = torch.where(blocks < 0, top, blocks).amin(-1, keepdim=True)
    ok = bool(((top - low) <= FP4_SPAN_MAX).all())
    _SPAN_OK[scale] = (scale._version, ok)
    return ok


# ----------------------------------------------------------------------------- grouped experts
def _launch_gmm(a, sa, b, bs, out, tiles, *, fp4: bool, a_idx=None, c_idx=None) -> None:
    """out[rows of g] = W8A8(a[rows], b[g]); b [E, N, K] (or [E, N, K/2] packed), bs its block scales."""
    n = b.size(1)
    k = a.size(1)
    bsv, e8m0 = _scale_arg(bs)
    dummy = tiles.group
    args = (
        a,
        sa,
        a_idx if a_idx is not None else dummy,
        b,
        bsv,
        out,
        c_idx if c_idx is not None else dummy,
        tiles.group,
        tiles.row,
        tiles.end,
        n,
        k,
        tiles.n_groups,
        a.stride(0),
        sa.stride(0),
        b.stride(0),
        bsv.stride(0),
        b.stride(1),
        bsv.stride(1),
        out.stride(0),
        bsv.size(-1),
    )
    flags = dict(
        GATHER_A=a_idx is not None, SCATTER_C=c_idx is not None, FP4=fp4, SCALE_E8M0=e8m0, BM=tiles.bm, BK=ACT_BLOCK
    )
    if _INTERPRET:
        _launch(_w8a8_gmm_kernel, (triton.cdiv(n, 32), tiles.n_tiles), *args, **flags, BN=32, UPCAST=True)
        return
    _gmm_tuned[lambda meta: (triton.cdiv(n, meta["BN"]), tiles.n_tiles)](*args, **flags, UPCAST=False)


def triton_quantized_moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    w3: torch.Tensor,
    s3: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int = 0,
    fmt: str = "fp8",
    act: str = "ue8m0",
) -> torch.Tensor:
    """`quantized_moe_experts` as W8A8 grouped GEMMs over all local experts (see the module docstring)."""
    args = (x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset, fmt, act)
    return grouped_experts(*args, launch=_launch_gmm)


def grouped_experts(
    x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset, fmt, act, *, launch, bm=None
) -> torch.Tensor:
    """The grouped W8A8 experts with `launch(a, sa, b, bs, out, tiles, fp4=, a_idx=, c_idx=)` as each of
    their three grouped GEMMs (`_launch_gmm`, or a split-K one: `w8a8_decode`); bm: the row tile (default
    the grouped GEMM's)."""
    from .. import act_quant

    fp4 = fmt == "fp4"
    pow2 = act_pow2(act)
    n_local = w1.size(0)
    m = indices.numel()
    plan, tiles = _plan_and_tiles(weights, indices, n_local, expert_offset, bm or _block_m(m, n_local))
    xq, xs = act_quant(x, ACT_BLOCK, pow2)  # once per token
    xq, xs = _fp8_view(xq).contiguous(), xs.contiguous()
    inter = w1.size(1)
    gate = torch.empty(m, inter, dtype=gate_dtype(x.dtype), device=x.device)  # [M, I], sorted slots
    up = torch.empty_like(gate)
    wv = (lambda w: w.view(torch.uint8)) if fp4 else _fp8_view
    launch(xq, xs, wv(w1), s1, gate, tiles, fp4=fp4, a_idx=plan.token)
    launch(xq, xs, wv(w3), s3, up, tiles, fp4=fp4, a_idx=plan.token)
    h = (clamped_swiglu(gate, up, swiglu_limit) * plan.weight.unsqueeze(-1)).to(x.dtype)
    hq, hs = act_quant(h, ACT_BLOCK, pow2)
    out = torch.empty(m, x.size(1), dtype=x.dtype, device=x.device)  # [T*k, D] slot order
    launch(_fp8_view(hq).contiguous(), hs.contiguous(), wv(w2), s2, out, tiles, fp4=fp4, c_idx=plan.order)
    return sum_slots(out, plan.n_tokens, plan.topk)  # a token's k slots added in slot order, fp32


# ----------------------------------------------------------------------------- can_run
def _fp8_cores_reason(t: torch.Tensor) -> str | None:
    """FP8 tensor-core dots need an sm89+ GPU (Ada, Hopper and later); elsewhere the reference runs."""
    if t.is_cuda:
        major, minor = torch.cuda.get_device_capability(t.device)
        if (major, minor) < (8, 9):
            return f"FP8 tensor cores need an sm89+ GPU, this one is sm{major}{minor}"
    return None


def _common_reason(q: torch.Tensor, s: torch.Tensor) -> str | None:
    reason = device_reason(q) or _fp8_cores_reason(q)
    if reason:
        return reason
    if q.element_size() != 1:
        return f"activations must be E4M3 codes (1 byte each), got {q.dtype}"
    if torch.is_grad_enabled() and s.requires_grad:
        return "W8A8 GEMMs are inference-only (gradient requested)"
    if tuple(s.shape) != (*q.shape[:-1], -(-q.size(-1) // ACT_BLOCK)):
        return f"activation scales {tuple(s.shape)} are not one per {ACT_BLOCK} columns of {tuple(q.shape)}"
    return None


def _fp8_can_run(q, s, weight, scale, out_dtype=torch.bfloat16) -> str | None:
    reason = _common_reason(q, s)
    if reason:
        return reason
    if weight.dim() != 2 or weight.element_size() != 1 or weight.size(1) != q.size(-1):
        return f"weight must be FP8 E4M3 [N, K={q.size(-1)}], got {weight.dtype} {tuple(weight.shape)}"
    n, k = weight.shape
    if tuple(scale.shape) != (triton.cdiv(n, 128), triton.cdiv(k, 128)):
        return f"scale shape {tuple(scale.shape)} is not [ceil(N/128), ceil(K/128)] for weight {(n, k)}"
    return None


def _fp4_can_run(q, s, weight, scale, out_dtype=torch.bfloat16) -> str | None:
    reason = _common_reason(q, s)
    if reason:
        return reason
    n, kh = weight.shape
    k = 2 * kh
    if weight.element_size() != 1 or k != q.size(-1) or k % 32:
        return f"weight must be packed E2M1 [N, K/2] with K={q.size(-1)} a multiple of 32, got {tuple(weight.shape)}"
    if tuple(scale.shape) != (n, k // 32) or scale.element_size() != 1:
        return f"scale must be E8M0 [N, K/32] = {(n, k // 32)}, got {scale.dtype} {tuple(scale.shape)}"
    if not _capture_safe_span(scale):
        return (
            f"the MXFP4 block exponents of a 128-column block span more than 2^{FP4_SPAN_MAX}: an FP8 tile "
            "would round them"
        )
    return None


def _capture_safe_span(scale: torch.Tensor) -> bool:
    """The span check reads one bool to the host, which a CUDA graph capture forbids: inside a capture only
    an earlier (cached) answer counts."""
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        hit = _SPAN_OK.get(scale)
        return hit is not None and hit[0] == scale._version and hit[1]
    return fp4_tiles_exact(scale)


def _moe_can_run(
    x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset=0, fmt="fp8", act="ue8m0"
) -> str | None:
    reason = device_reason(x) or _fp8_cores_reason(x)
    if reason:
        return reason
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.dim() != 2:
        return f"x must be [T, D] in a float dtype, got {x.dtype} {tuple(x.shape)}"
    if torch.is_grad_enabled() and x.requires_grad:
        return "W8A8 experts are inference-only (gradient requested)"
    if fmt not in ("fp8", "fp4") or act not in ("ue8m0", "fp32"):
        return f"fmt {fmt!r} / act {act!r} (need fp8 or fp4 and ue8m0 or fp32)"
    if fmt == "fp4":
        if x.size(1) % 32 or w1.size(1) % 32:
            return "MXFP4 experts need dim and inter dim multiples of 32"
        if not all(_capture_safe_span(s) for s in (s1, s2, s3)):
            return (
                f"the MXFP4 block exponents of a 128-column block span more than 2^{FP4_SPAN_MAX}: an FP8 "
                "tile would round them"
            )
    return None


register("fp8_gemm", "triton", triton_fp8_gemm, can_run=_fp8_can_run, deterministic=True, priority=10)
register("fp4_gemm", "triton", triton_fp4_gemm, can_run=_fp4_can_run, deterministic=True, priority=10)
register(
    "quantized_moe_experts",
    "triton",
    triton_quantized_moe_experts,
    can_run=_moe_can_run,
    deterministic=True,
    priority=10,
)


# ----------------------------------------------------------------------------- torch's block-scaled matmul
SCALED_MM_MIN_TOKENS = 256  # default selection from this many token rows (decode sizes: the Triton kernel)
_PROBED: dict[int, str | None] = {}


def _scaled_mm_call(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`torch.nn.functional.scaled_mm` with BlockWise1x128 activation scales (outer-dim-major, rows padded
    to a multiple of 4) and BlockWise128x128 weight scales (K blocks padded to a multiple of 4), as cuBLAS
    wants them."""
    import torch.nn.functional as F

    k = q.size(-1)
    n = weight.size(0)
    a = _fp8_view(q).reshape(-1, k)
    sa = s.reshape(-1, s.size(-1)).float()
    m = a.size(0)
    pad_m = -m % 4
    if pad_m:
        a = F.pad(a.view(torch.uint8), (0, 0, 0, pad_m)).view(torch.float8_e4m3fn)
        sa = F.pad(sa, (0, 0, 0, pad_m), value=1.0)
    sa = sa.t().contiguous().t()
    sb = scale.float() if not _is_e8m0(scale) else _e8m0_values(scale)
    kb = sb.size(1)
    if kb % 4:
        sb = F.pad(sb, (0, -kb % 4), value=1.0)
    b = _fp8_view(weight).t()
    if hasattr(F, "scaled_mm"):
        y = F.scaled_mm(
            a.contiguous(),
            b,
            sa,
            F.ScalingType.BlockWise1x128,
            sb.t(),
            F.ScalingType.BlockWise128x128,
            output_dtype=out_dtype,
        )
    else:  # older torch: the block scaling is inferred from the scale shapes
        y = torch._scaled_mm(a.contiguous(), b, scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)
    return y[:m].view(*q.shape[:-1], n)


def _e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    from ...formats import e8m0_decode

    return e8m0_decode(scale).contiguous()


def _scaled_mm_device_reason(device: torch.device) -> str | None:
    """Why torch's blockwise scaled matmul cannot run on this device (None when a probe matched the
    reference): it needs torch's `scaled_mm` (or `_scaled_mm`) with 1x128 / 128x128 block scaling, CUDA >=
    12.9 and a Hopper GPU. Probed once per device: a torch without the block scaling fails the probe."""
    import torch.nn.functional as F

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _PROBED:
        return _PROBED[idx]
    if torch.cuda.is_current_stream_capturing():
        return "not probed yet on this device (the probe cannot run inside a CUDA graph capture)"
    reason = None
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if not hasattr(F, "scaled_mm") and not hasattr(torch, "_scaled_mm"):
        reason = f"torch {torch.__version__} has no scaled_mm"
    elif cuda < (12, 9):
        reason = f"blockwise scaled_mm needs CUDA >= 12.9 (this torch: {torch.version.cuda})"
    elif torch.cuda.get_device_capability(idx) != (9, 0):
        reason = "blockwise scaled_mm is used on Hopper (sm90) GPUs only"
    else:
        from .. import reference as R

        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(70, 512, device=f"cuda:{idx}", generator=g)
        w = torch.randn(256, 512, device=f"cuda:{idx}", generator=g) * 0.05
        from ...formats import quantize_fp8

        wq, ws = quantize_fp8(w)
        q, s = R.act_quant(x, ACT_BLOCK, True)
        try:
            got = _scaled_mm_call(q, s, wq, ws, torch.bfloat16).float()
            want = R.fp8_gemm(q, s, wq, ws, torch.float32)
            err = float((got - want).norm() / want.norm())
            if not err < 1e-2:
                reason = f"a probe of blockwise scaled_mm disagreed with the reference (relative L2 {err:.2e})"
        except RuntimeError as e:
            reason = f"a probe of blockwise scaled_mm failed: {str(e).splitlines()[0][:160]}"
    _PROBED[idx] = reason
    return reason


def scaled_mm_fp8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return _scaled_mm_call(q, s, weight, scale, out_dtype)


def _scaled_mm_can_run(q, s, weight, scale, out_dtype=torch.bfloat16) -> str | None:
    if not q.is_cuda:
        return f"tensors are on {q.device.type}; blockwise scaled_mm needs CUDA"
    reason = _fp8_can_run(q, s, weight, scale, out_dtype)
    if reason:
        return reason
    n, k = weight.shape
    if k % 128 or n % 128:
        return f"blockwise scaled_mm wants N and K multiples of 128, got {(n, k)}"
    if out_dtype != torch.bfloat16:
        return f"blockwise scaled_mm is used with a bf16 output, got {out_dtype}"
    return _scaled_mm_device_reason(q.device)


def _many_tokens(q, s, weight, scale, out_dtype=torch.bfloat16) -> bool:
    return q.numel() // max(q.size(-1), 1) >= SCALED_MM_MIN_TOKENS


register(
    "fp8_gemm",
    "scaled_mm",
    scaled_mm_fp8_gemm,
    can_run=_scaled_mm_can_run,
    deterministic=True,
    priority=12,
    prefer=_many_tokens,
)
