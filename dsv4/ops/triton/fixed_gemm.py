"""Dense projections whose numbers do not depend on the batch (backend "triton" of `linear`, `linear_fp32`).

Deterministic mode (`dsv4.ops.precision.exact_accumulation`) needs every row of a step computed the same
way whatever else the step holds. The reference gets there by multiplying in float64 and rounding once;
on a GPU that means a float64 copy of every weight at every call and float64 GEMMs, which cost the
engine a quarter of its throughput. torch's own half-precision GEMM is not an option: cuBLAS chooses its
kernel, and with it the order of each row's sum, by the shape of the call.

Here the plan is fixed: one program per [BLOCK_M, BLOCK_N] tile of the output and split of K, each split's
K range walked in BLOCK_K steps in order, products of the storage-dtype operands summed in fp32 on tensor
cores; where K is split, a second launch adds the splits' fp32 partial sums in split order; the sum is
rounded once to x's dtype. Tiles, warps, stages and the splits are constants or follow the weight's shape
(`k_splits`: N and K), never the row count, so a row's output is the same alone and in a batch of any
size, and at any place in its tile (rows never mix: an MMA computes each output from its own row of x).
The splits keep a narrow projection's call from running on a handful of programs: at 64 rows a 512 x 1024
weight is 8 tiles of 64 x 64, walked 16 steps each on 8 of the GPU's SMs. Against the reference's float64
sum the result is within fp32 accumulation error (at most 2K * 2^-24 of the sum of |x_k w_k|) before the final rounding:
without heavy cancellation, the same value or one unit in the last place of the output dtype.

`linear_fp32` (router, compressor, head: bf16 activations, fp32 weights, fp32 out) uses the same plan on
the exact three-way bf16 split of each weight tile (hi + mid + lo = w, split in registers), three
tensor-core products per K step, smallest part first: the same fp32 accuracy, no float64.

The default backend under exact accumulation on CUDA (`prefer`); otherwise torch's GEMM (and "bf16x3")
stay the default. Forward only: refused where autograd records the call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import register
from ..precision import is_exact
from ._common import Kernel, device_reason, dot_type, interpret_mode

DTYPES = (torch.bfloat16, torch.float16)
# the plan: constants, so that no row's order of summation follows the shape of the call
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3
SPLIT_TARGET = 128  # column tiles x K splits a weight's calls aim for (a constant: no GPU's size in the plan)
MIN_SPLIT_K = 256  # the fewest K values in a split (four BLOCK_K steps)
_alloc = torch.empty


def k_splits(n: int, k: int) -> tuple[int, int]:
    """(splits, K values per split, a multiple of BLOCK_K) for a weight of n x k: from the weight's shape
    alone, so every call with the weight sums each output's K products in the same order."""
    most = max(1, k // MIN_SPLIT_K)
    want = max(1, min(most, triton.cdiv(SPLIT_TARGET, triton.cdiv(n, BLOCK_N))))
    per = triton.cdiv(triton.cdiv(k, want), BLOCK_K) * BLOCK_K
    return triton.cdiv(k, per), per


def _fixed_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    sxm,
    swn,
    sym,
    k_per,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_T: tl.constexpr,
    RNE_BF16: tl.constexpr,
    SPLIT3: tl.constexpr,
    ROWWISE: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """y[M, N] = x[M, K] @ w[N, K]^T (unit inner strides), fp32 sums over K in BLOCK_K steps, in order.
    SPLIT3: w is fp32, multiplied as its three bf16 parts (x bf16). ROWWISE (the CPU interpreter): each
    K step's products summed per output as an fp32 reduction of its own row, instead of `tl.dot`, which the
    interpreter hands to numpy's matmul: its BLAS may order a row's sum by the other rows of the tile.
    Program axis 2 is the split of K (k_per values each); PARTIAL: the split's fp32 sum goes to y as plane
    pid_s of a [splits, M, N] fp32 workspace (y's rows sym apart), unrounded."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    k_lo = pid_s * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = k0 + rk < k_hi
        a = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[:, None] * swn + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SPLIT3:
            hi = b.to(tl.bfloat16)
            rest = b - hi.to(tl.float32)  # exact in fp32
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            a = a.to(DOT_T)
            if ROWWISE:
                af = a.to(tl.float32)[:, None, :]
                acc += tl.sum(af * lo.to(tl.float32)[None, :, :], axis=2)
                acc += tl.sum(af * mid.to(tl.float32)[None, :, :], axis=2)
                acc += tl.sum(af * hi.to(tl.float32)[None, :, :], axis=2)
            else:
                acc += tl.dot(a, tl.trans(lo.to(DOT_T)), out_dtype=tl.float32)
                acc += tl.dot(a, tl.trans(mid.to(DOT_T)), out_dtype=tl.float32)
                acc += tl.dot(a, tl.trans(hi.to(DOT_T)), out_dtype=tl.float32)
        elif ROWWISE:
            prod = a.to(DOT_T).to(tl.float32)[:, None, :] * b.to(DOT_T).to(tl.float32)[None, :, :]  # exact
            acc += tl.sum(prod, axis=2)
        else:
            acc += tl.dot(a.to(DOT_T), tl.trans(b.to(DOT_T)), out_dtype=tl.float32)
    if PARTIAL:
        y_ptr += pid_s * M * sym
    elif RNE_BF16:  # the interpreter's fp32 -> bf16 cast truncates: round to nearest even by hand
        u = acc.to(tl.uint32, bitcast=True)
        acc = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(
        y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :]
    )


def _sum_splits_kernel(p_ptr, y_ptr, MN, S, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr):
    """y[i] = ((p[0, i] + p[1, i]) + p[2, i]) + ... over the S planes of MN fp32 partial sums, in split order,
    rounded once to y's dtype."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(p_ptr + i, mask=ok, other=0.0)
    for s in range(1, S):
        acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
    if RNE_BF16:
        u = acc.to(tl.uint32, bitcast=True)
        acc = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


_fixed_mm = Kernel(_fixed_mm_kernel)
_sum_splits = Kernel(_sum_splits_kernel)
SUM_BLOCK = 1024


def _launch(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] in out_dtype by the fixed plan; an fp32 w is split three ways."""
    k, n = x.size(-1), w.size(0)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w2 = w if w.stride(-1) == 1 else w.contiguous()
    m = x2.size(0)
    y = _alloc((m, n), dtype=out_dtype, device=x.device)
    if m and n:
        if k == 0:
            y.zero_()
        else:
            splits, per = k_splits(n, k)
            rne = interpret_mode() and out_dtype == torch.bfloat16
            part = _alloc((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
            _fixed_mm[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)](
                x2,
                w2,
                part,
                m,
                n,
                k,
                x2.stride(0),
                w2.stride(0),
                part.stride(-2),
                per,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K,
                DOT_T=dot_type(x.dtype),
                RNE_BF16=rne,
                SPLIT3=w.dtype == torch.float32,
                ROWWISE=interpret_mode(),
                PARTIAL=splits > 1,
                **({} if interpret_mode() else {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}),
            )
            if splits > 1:
                mn = m * n
                _sum_splits[(triton.cdiv(mn, SUM_BLOCK),)](
                    part, y, mn, splits, BLOCK=SUM_BLOCK, RNE_BF16=rne, **({} if interpret_mode() else {"num_warps": 4})
                )
    return y.view(*x.shape[:-1], n)


def fixed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`linear`: x [..., K] @ w [N, K]^T -> [..., N] in x's dtype, by the fixed plan."""
    return _launch(x, w, x.dtype)


def fixed_linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`linear_fp32`: x [..., K] @ w [N, K]^T -> fp32 [..., N], by the fixed plan: bf16 x with an fp32 w
    split three ways (the same products as the fp32 matmul), or x and w of one half dtype."""
    return _launch(x, w, torch.float32)


def _common_refusal(x: torch.Tensor, w: torch.Tensor) -> str | None:
    if w.dim() != 2 or x.dim() < 1 or x.size(-1) != w.size(1):
        return f"shapes x {tuple(x.shape)}, w {tuple(w.shape)}: need x [..., K] and w [N, K]"
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return "forward only: autograd records this call (the fixed-plan GEMM is for deterministic inference)"
    return None


def _can_run(x: torch.Tensor, w: torch.Tensor) -> str | None:
    reason = device_reason(x, w)
    if reason:
        return reason
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"x {x.dtype} and w {w.dtype}: the fixed-plan GEMM takes bf16 or fp16, both the same"
    return _common_refusal(x, w)


def _can_run_fp32(x: torch.Tensor, w: torch.Tensor) -> str | None:
    reason = device_reason(x, w)
    if reason:
        return reason
    if not (x.dtype in DTYPES and w.dtype == x.dtype) and not (x.dtype == torch.bfloat16 and w.dtype == torch.float32):
        return f"x {x.dtype}, w {w.dtype}: needs bf16 x with fp32 w (split exactly), or x and w both bf16 or fp16"
    return _common_refusal(x, w)


def _prefer(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The default only under exact accumulation (deterministic mode); torch's GEMM otherwise."""
    return is_exact()


register("linear", "triton", fixed_linear, can_run=_can_run, deterministic=True, priority=10, prefer=_prefer)
register(
    "linear_fp32", "triton", fixed_linear_fp32, can_run=_can_run_fp32, deterministic=True, priority=10, prefer=_prefer
)

__all__ = ["fixed_linear", "fixed_linear_fp32"]
