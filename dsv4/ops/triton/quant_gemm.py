"""GEMMs on quantized weights, dequantized inside the kernel (`fp8_linear`, `fp4_linear` backends "triton").

`fp8_linear(x, weight, scale)`: weight FP8 E4M3 [N, K] with one scale per 128x128 block
([ceil(N/128), ceil(K/128)], E8M0 bytes or fp32). `fp4_linear(x, weight, scale)`: weight MXFP4, two E2M1
codes per byte ([N, K/2] int8, low nibble = element 2i) with one E8M0 scale per 32 elements of a row
([N, K/32]). Activations stay bf16: each weight tile is decoded in registers, multiplied by its scale in
fp32 and rounded to bf16 (exactly what "dequantize to bf16, then matmul" does), then fed to the tensor
cores with fp32 accumulation. The weights are read from memory in their stored width (1 or 0.5 bytes per
element), so a released checkpoint runs without first expanding to bf16.

Backend "dequant_mm" instead dequantizes the weight in row chunks (at most 128 MiB of bf16 scratch) with a
Triton kernel and multiplies each chunk with `torch.nn.functional.linear`: bit-identical to the reference
definition, and the better choice when the token batch is large enough to amortise the chunk writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import register
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import device_reason, grouped_tile, mma, round_to
from ._mm_utils import launch as _launch


@triton.jit
def _e8m0(b):
    """E8M0 bytes (int32 0..254) -> fp32 2^(b-127) (b == 0, i.e. 2^-127, reads as 0)."""
    return (b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(c):
    """E2M1 codes (int32 0..15) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives (codes 8..15)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where(c >= 8, -mag, mag)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    s_cols,
    SCALE_E8M0: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + ks[:, None]  # [BK, BN] view
    s_row = (rn // 128) * s_cols
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        if SCALE_E8M0:
            s = _e8m0(tl.load(s_ptr + s_row + k0 // 128, mask=nmask, other=127).to(tl.int32))
        else:
            s = tl.load(s_ptr + s_row + k0 // 128, mask=nmask, other=1.0)
        wq = round_to(w * s[None, :], x_ptr.dtype.element_ty, UPCAST)
        acc = mma(x, wq, acc, UPCAST)
        x_ptrs += BK
        w_ptrs += BK
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty, UPCAST), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _fp4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    kb = tl.arange(0, BK // 2)
    kss = tl.arange(0, BK // 32)
    mmask = rm < M
    nmask = rn < N
    rn64 = rn.to(tl.int64)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + rn64[:, None] * (K // 2) + kb[None, :]  # [BN, BK/2]
    s_ptrs = s_ptr + rn64[:, None] * (K // 32) + kss[None, :]  # [BN, BK/32]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        pmask = nmask[:, None] & ((k0 // 2 + kb) < K // 2)[None, :]
        p = tl.load(w_ptrs, mask=pmask, other=0).to(tl.int32) & 0xFF
        w = tl.reshape(tl.join(_e2m1(p & 0xF), _e2m1(p >> 4)), (BN, BK))  # element 2i = low nibble
        sb = tl.load(s_ptrs, mask=nmask[:, None] & ((k0 // 32 + kss) < K // 32)[None, :], other=127)
        s = _e8m0(sb.to(tl.int32) & 0xFF)  # [BN, BK/32]
        w = tl.reshape(tl.reshape(w, (BN, BK // 32, 32)) * s[:, :, None], (BN, BK))
        wq = round_to(w, x_ptr.dtype.element_ty, UPCAST)
        acc = mma(x, tl.trans(wq), acc, UPCAST)
        x_ptrs += BK
        w_ptrs += BK // 2
        s_ptrs += BK // 32
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty, UPCAST), mask=mmask[:, None] & nmask[None, :])


_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in (
        (128, 128, 128, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (64, 64, 128, 4, 3),
    )
]
_FP4_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in (
        (128, 128, 128, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (64, 64, 128, 4, 3),
    )
]
_fp8_tuned = triton.autotune(_CONFIGS, key=["M", "N", "K", "SCALE_E8M0"])(_fp8_gemm_kernel)
_fp4_tuned = triton.autotune(_FP4_CONFIGS, key=["M", "N", "K"])(_fp4_gemm_kernel)


def _grid(m: int, n: int):
    return lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)


def _is_e8m0(scale: torch.Tensor) -> bool:
    return scale.dtype in (torch.uint8, torch.int8) or "e8m0" in str(scale.dtype)


def triton_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K] E4M3, 128x128 block scales)^T -> [..., N] in x.dtype."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.size(0)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    e8m0 = _is_e8m0(scale)
    s = scale.view(torch.uint8) if e8m0 else scale.float()
    s = s.contiguous()
    w = weight if weight.dtype == torch.float8_e4m3fn else weight.view(torch.float8_e4m3fn)
    args = (x2, w, s, y, m, n, k, x2.stride(0), y.stride(0), s.size(1))
    if _INTERPRET:
        _launch(
            _fp8_gemm_kernel,
            (triton.cdiv(m, 32) * triton.cdiv(n, 32),),
            *args,
            SCALE_E8M0=e8m0,
            BM=32,
            BN=32,
            BK=32,
            GROUP=4,
            UPCAST=True,
        )
    else:
        _fp8_tuned[_grid(m, n)](*args, SCALE_E8M0=e8m0, UPCAST=False)
    return y.view(*x.shape[:-1], n)


def triton_fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K/2] packed E2M1, per-32 E8M0 scales [N, K/32])^T -> [..., N]."""
    n, k = weight.size(0), weight.size(1) * 2
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.size(0)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    w = weight.view(torch.uint8).contiguous()
    s = scale.view(torch.uint8).contiguous()
    args = (x2, w, s, y, m, n, k, x2.stride(0), y.stride(0))
    if _INTERPRET:
        _launch(
            _fp4_gemm_kernel,
            (triton.cdiv(m, 32) * triton.cdiv(n, 32),),
            *args,
            BM=32,
            BN=32,
            BK=64,
            GROUP=4,
            UPCAST=True,
        )
    else:
        _fp4_tuned[_grid(m, n)](*args, UPCAST=False)
    return y.view(*x.shape[:-1], n)


# ----------------------------------------------------------------------------- dequantize-then-matmul
@triton.jit
def _fp8_dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    K,
    row0,
    s_cols,
    SCALE_E8M0: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[n - row0, k] = w[n, k] * scale[n // 128, k // 128] rounded to out's dtype."""
    rn = row0 + tl.program_id(0) * BN + tl.arange(0, BN)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (rn < row0 + n_rows)[:, None] & (ks < K)[None, :]
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + ks[None, :], mask=m, other=0.0).to(tl.float32)
    s_off = (rn // 128)[:, None] * s_cols + (ks // 128)[None, :]
    if SCALE_E8M0:
        s = _e8m0(tl.load(s_ptr + s_off, mask=m, other=127).to(tl.int32))
    else:
        s = tl.load(s_ptr + s_off, mask=m, other=1.0)
    o_ptrs = out_ptr + (rn - row0)[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(o_ptrs, round_to(w * s, out_ptr.dtype.element_ty, UPCAST), mask=m)


@triton.jit
def _fp4_dequant_kernel(
    w_ptr, s_ptr, out_ptr, n_rows, K, row0, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr
):
    """out[n - row0, :] = E2M1 codes of row n (low nibble first) times their per-32 E8M0 scales."""
    rn = row0 + tl.program_id(0) * BN + tl.arange(0, BN)
    kb = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    kss = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    nmask = rn < row0 + n_rows
    rn64 = rn.to(tl.int64)
    p = (
        tl.load(
            w_ptr + rn64[:, None] * (K // 2) + kb[None, :], mask=nmask[:, None] & (kb < K // 2)[None, :], other=0
        ).to(tl.int32)
        & 0xFF
    )
    w = tl.reshape(tl.join(_e2m1(p & 0xF), _e2m1(p >> 4)), (BN, BK))
    smask = nmask[:, None] & (kss < K // 32)[None, :]
    sb = tl.load(s_ptr + rn64[:, None] * (K // 32) + kss[None, :], mask=smask, other=127)
    w = tl.reshape(tl.reshape(w, (BN, BK // 32, 32)) * _e8m0(sb.to(tl.int32) & 0xFF)[:, :, None], (BN, BK))
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    o_ptrs = out_ptr + (rn - row0)[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(o_ptrs, round_to(w, out_ptr.dtype.element_ty, UPCAST), mask=nmask[:, None] & (ks < K)[None, :])


_CHUNK_ELEMENTS = 1 << 26  # bf16 weight rows dequantized at a time (128 MiB)


def _chunked_linear(x: torch.Tensor, n: int, k: int, dequant_rows) -> torch.Tensor:
    """x @ W^T where W is materialised in bf16 one row chunk at a time by dequant_rows(row0, rows, out)."""
    x2 = x.reshape(-1, k)
    rows = max(128, (_CHUNK_ELEMENTS // max(k, 1)) // 128 * 128)
    outs = []
    buf = torch.empty(min(rows, n), k, dtype=x.dtype, device=x.device)
    for row0 in range(0, n, rows):
        r = min(rows, n - row0)
        dequant_rows(row0, r, buf[:r])
        outs.append(torch.nn.functional.linear(x2, buf[:r]))
    y = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
    return y.view(*x.shape[:-1], n)


def dequant_mm_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear` as a Triton dequantization of row chunks to bf16, each followed by a bf16 matmul."""
    n, k = weight.shape
    e8m0 = _is_e8m0(scale)
    s = (scale.view(torch.uint8) if e8m0 else scale.float()).contiguous()
    w = weight if weight.dtype == torch.float8_e4m3fn else weight.view(torch.float8_e4m3fn)
    bn, bk = (32, 32) if _INTERPRET else (64, 128)

    def rows(row0: int, r: int, out: torch.Tensor) -> None:
        _launch(
            _fp8_dequant_kernel,
            (triton.cdiv(r, bn), triton.cdiv(k, bk)),
            w,
            s,
            out,
            r,
            k,
            row0,
            s.size(1),
            SCALE_E8M0=e8m0,
            BN=bn,
            BK=bk,
            UPCAST=_INTERPRET,
        )

    return _chunked_linear(x, n, k, rows)


def dequant_mm_fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp4_linear` as a Triton dequantization of row chunks to bf16, each followed by a bf16 matmul."""
    n, k = weight.size(0), weight.size(1) * 2
    w = weight.view(torch.uint8).contiguous()
    s = scale.view(torch.uint8).contiguous()
    bn, bk = (32, 64) if _INTERPRET else (64, 128)

    def rows(row0: int, r: int, out: torch.Tensor) -> None:
        _launch(
            _fp4_dequant_kernel,
            (triton.cdiv(r, bn), triton.cdiv(k, bk)),
            w,
            s,
            out,
            r,
            k,
            row0,
            BN=bn,
            BK=bk,
            UPCAST=_INTERPRET,
        )

    return _chunked_linear(x, n, k, rows)


def _common_reason(x: torch.Tensor) -> str | None:
    reason = device_reason(x)
    if reason:
        return reason
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"activations must be bf16/fp16, got {x.dtype}"
    if torch.is_grad_enabled() and x.requires_grad:
        return "quantized-weight GEMMs are inference-only (gradient requested)"
    return None


def _fp8_can_run(x, weight, scale) -> str | None:
    reason = _common_reason(x)
    if reason:
        return reason
    if weight.dim() != 2 or weight.element_size() != 1:
        return f"weight must be FP8 E4M3 [N, K] (1 byte each), got {weight.dtype} {tuple(weight.shape)}"
    n, k = weight.shape
    if tuple(scale.shape) != (triton.cdiv(n, 128), triton.cdiv(k, 128)):
        return f"scale shape {tuple(scale.shape)} is not [ceil(N/128), ceil(K/128)] for weight {(n, k)}"
    return None


def _fp4_can_run(x, weight, scale) -> str | None:
    reason = _common_reason(x)
    if reason:
        return reason
    n, kh = weight.shape
    if weight.element_size() != 1 or (2 * kh) % 64:
        return f"weight must be packed E2M1 [N, K/2] bytes with K a multiple of 64, got {tuple(weight.shape)}"
    if tuple(scale.shape) != (n, 2 * kh // 32) or scale.element_size() != 1:
        return f"scale must be E8M0 [N, K/32] = {(n, 2 * kh // 32)}, got {scale.dtype} {tuple(scale.shape)}"
    return None


register("fp8_linear", "triton", triton_fp8_linear, can_run=_fp8_can_run, deterministic=True, priority=10)
register("fp4_linear", "triton", triton_fp4_linear, can_run=_fp4_can_run, deterministic=True, priority=10)
# Dequantize-then-matmul (bounded bf16 scratch) is the default for large token batches, where the fused
# kernel decodes each weight tile once per M tile. Measured on an H200 at M=4096 (BENCHMARKS.md): 54-69% of
# the bf16 matmul rate against the fused kernels' 37-43% (FP8) and 17-19% (MXFP4). Below the threshold the
# fused kernels read the weight once in its compact form.
DEQUANT_MM_MIN_TOKENS = 1024


def _large_batch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return x.numel() // max(x.size(-1), 1) >= DEQUANT_MM_MIN_TOKENS


register(
    "fp8_linear",
    "dequant_mm",
    dequant_mm_fp8_linear,
    can_run=_fp8_can_run,
    deterministic=True,
    priority=15,
    prefer=_large_batch,
)
register(
    "fp4_linear",
    "dequant_mm",
    dequant_mm_fp4_linear,
    can_run=_fp4_can_run,
    deterministic=True,
    priority=15,
    prefer=_large_batch,
)
