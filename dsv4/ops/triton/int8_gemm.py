"""INT8 W8A8 GEMMs on INT8 tensor cores: backend "triton" of `int8_gemm` and `int8_moe_experts`.

Weights are INT8 [N, K] with one fp32 scale per row, activations INT8 with one fp32 scale per token
(`int8_quant`). Each program accumulates INT8 x INT8 products in INT32 (exact), then converts the sum to
fp32 once and multiplies it by the token's scale and then the row's scale, the reference's operations in
the reference's order, so results equal `dsv4.ops.reference` bit for bit (the output is rounded to its
dtype to nearest even).

Decode-sized calls (a few token rows) are bound by reading the weight: row tiles of 16 (the smallest
`tl.dot` tile) with narrow column tiles give every SM a share of it, at half the bytes of a bf16 weight.

Grouped experts (`int8_moe_experts`): the routing plan and tile table of `dsv4.ops.triton.moe` (built on
the device, no host sync); x is quantized once per token and each tile gathers its rows; gate and up come
out of one grouped launch (two INT32 accumulators over the same A tiles) in fp32, then the clamped SwiGLU
times the routing weight in fp32 (`ops.clamped_swiglu`: one kernel), quantized per row by `int8_quant`,
then the down projection scattered back to slot order; a token's k slots are summed in fp32. Rows of other
ranks' experts are written as zeros (docs/bugzoo.md Z09).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import int8_quant, register
from ..int8_native import INT_MM_MIN_TOKENS_CUDA, swiglu_fp32
from ..precision import is_exact
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import device_reason, grouped_tile, round_to
from ._mm_utils import launch as _launch
from .moe import _plan_and_tiles

INT32_MAX = 2**31 - 1
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _int8_mm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    M_BUCKET,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """C [M, N] = fp32(A . B^T as INT32) * a_scale[m] * b_scale[n]; A [M, K], B [N, K] int8."""
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + ks)[None, :], mask=mmask[:, None] & kmask[None, :], other=0)
        b = tl.load(
            b_ptr + rn[None, :] * stride_bn + (k0 + ks)[:, None], mask=kmask[:, None] & nmask[None, :], other=0
        )  # [BK, BN]
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    sa = tl.load(as_ptr + rm, mask=mmask, other=0.0)
    sb = tl.load(bs_ptr + rn, mask=nmask, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :],
        round_to(y, c_ptr.dtype.element_ty, UPCAST),
        mask=mmask[:, None] & nmask[None, :],
    )


@triton.jit
def _int8_gmm_kernel(
    a_ptr,
    as_ptr,
    a_idx_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    b2_ptr,
    bs2_ptr,
    c2_ptr,
    c_idx_ptr,
    tile_group_ptr,
    tile_row_ptr,
    tile_end_ptr,
    N,
    K,
    n_groups,
    stride_am,
    stride_be,
    stride_bn,
    stride_bse,
    stride_cm,
    GATHER_A: tl.constexpr,
    SCATTER_C: tl.constexpr,
    DUAL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """C[r] = fp32(A[r] . W[g]^T as INT32) * a_scale[r] * w_scale[g, n] for the rows r of group g (fp32
    output); rows of the foreign bucket (g >= n_groups) are written as zeros. DUAL: also C2 from W2 (same
    shape, strides and A tiles: the gate and up projections in one pass over A)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.load(tile_group_ptr + pid_m)
    row0 = tl.load(tile_row_ptr + pid_m)
    rend = tl.load(tile_end_ptr + pid_m)
    if row0 >= rend:
        return
    rows = row0 + tl.arange(0, BM)
    rmask = rows < rend
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    nmask = rn < N
    if SCATTER_C:
        out_rows = tl.load(c_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    c_off = out_rows[:, None] * stride_cm + rn[None, :]
    smask = rmask[:, None] & nmask[None, :]
    if g >= n_groups:  # slots of other ranks' experts: defined zeros
        tl.store(c_ptr + c_off, tl.zeros((BM, BN), dtype=tl.float32), mask=smask)
        if DUAL:
            tl.store(c2_ptr + c_off, tl.zeros((BM, BN), dtype=tl.float32), mask=smask)
        return
    if GATHER_A:
        a_rows = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    b_off = g.to(tl.int64) * stride_be
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    acc2 = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :], mask=rmask[:, None] & kmask[None, :], other=0
        )
        bk = b_off + rn[None, :] * stride_bn + (k0 + ks)[:, None]
        bmask = kmask[:, None] & nmask[None, :]
        acc = tl.dot(a, tl.load(b_ptr + bk, mask=bmask, other=0), acc, out_dtype=tl.int32)
        if DUAL:
            acc2 = tl.dot(a, tl.load(b2_ptr + bk, mask=bmask, other=0), acc2, out_dtype=tl.int32)
    sa = tl.load(as_ptr + a_rows, mask=rmask, other=0.0)
    s_off = g.to(tl.int64) * stride_bse + rn
    sb = tl.load(bs_ptr + s_off, mask=nmask, other=0.0)
    tl.store(c_ptr + c_off, acc.to(tl.float32) * sa[:, None] * sb[None, :], mask=smask)
    if DUAL:
        sb2 = tl.load(bs2_ptr + s_off, mask=nmask, other=0.0)
        tl.store(c2_ptr + c_off, acc2.to(tl.float32) * sa[:, None] * sb2[None, :], mask=smask)


_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_warps=w, num_stages=s)
    # row tiles of 16 for decode (weight-bound: narrow column tiles spread the weight over the SMs), larger
    # tiles for prefill
    for bm, bn, bk, w, s in (
        (16, 32, 256, 4, 4),
        (16, 64, 256, 4, 4),
        (16, 128, 128, 4, 4),
        (32, 64, 256, 4, 4),
        (64, 64, 128, 4, 4),
        (64, 128, 128, 4, 4),
        (128, 128, 128, 8, 3),
        (128, 256, 128, 8, 3),
    )
]
_GMM_CONFIGS = [
    triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in ((32, 256, 4, 4), (64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3))
]
# tuned per token-count bucket (an argument the kernel does not read), not per M
_mm_tuned = triton.autotune(_CONFIGS, key=["M_BUCKET", "N", "K"])(_int8_mm_kernel)
_gmm_tuned = triton.autotune(_GMM_CONFIGS, key=["N", "K", "BM", "GATHER_A", "SCATTER_C", "DUAL"])(_int8_gmm_kernel)


def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 4096)


# ----------------------------------------------------------------------------- dense
def operands(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor):
    """The dense kernels' operands: q [M, K] int8, its token scales [M] and the weight's row scales [N]
    (fp32) -> (a, sa, w, sb)."""
    a = q.reshape(-1, q.size(-1)).contiguous()
    return a, s.reshape(-1).float().contiguous(), weight.contiguous(), scale.float().contiguous()


def triton_int8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    n = weight.size(0)
    a, sa, w, sb = operands(q, s, weight, scale)
    m, k = a.shape
    c = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m == 0:
        return c.view(*q.shape[:-1], n)
    args = (a, sa, w, sb, c, m, n, k, a.stride(0), w.stride(0), c.stride(0), _m_bucket(m))
    if _INTERPRET:
        _launch(
            _int8_mm_kernel,
            (triton.cdiv(m, 16) * triton.cdiv(n, 32),),
            *args,
            BM=16,
            BN=32,
            BK=64,
            GROUP=4,
            UPCAST=True,
        )
    else:
        _mm_tuned[lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)](*args, UPCAST=False)
    return c.view(*q.shape[:-1], n)


def _int8_cores_reason(t: torch.Tensor) -> str | None:
    if t.is_cuda:
        major, minor = torch.cuda.get_device_capability(t.device)
        if (major, minor) < (8, 0):
            return f"Triton's INT8 tensor-core dot needs an sm80+ GPU, this one is sm{major}{minor}"
    return None


def _dense_can_run(q, s, weight, scale, out_dtype=torch.float32) -> str | None:
    reason = device_reason(q) or _int8_cores_reason(q)
    if reason:
        return reason
    if q.dtype != torch.int8 or weight.dtype != torch.int8:
        return f"q and weight must be int8, got {q.dtype} and {weight.dtype}"
    if weight.dim() != 2 or weight.size(1) != q.size(-1):
        return f"weight must be [N, K={q.size(-1)}], got {tuple(weight.shape)}"
    if tuple(s.shape) != (*q.shape[:-1], 1) or tuple(scale.shape) != (weight.size(0),):
        return f"scales must be one per token and one per weight row, got {tuple(s.shape)} and {tuple(scale.shape)}"
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype must be one of fp32, bf16, fp16, got {out_dtype}"
    if q.size(-1) * 127 * 127 > INT32_MAX:
        return f"K = {q.size(-1)} can overflow the INT32 sums"
    return None


def _dense_prefer(q, s, weight, scale, out_dtype=torch.float32) -> bool:
    """On CUDA below INT_MM_MIN_TOKENS_CUDA token rows (decode); from there torch._int_mm (cuBLASLt)."""
    return not q.is_cuda or q.numel() // max(q.size(-1), 1) < INT_MM_MIN_TOKENS_CUDA


register(
    "int8_gemm",
    "triton",
    triton_int8_gemm,
    can_run=_dense_can_run,
    deterministic=True,
    priority=10,
    prefer=_dense_prefer,
)


# ----------------------------------------------------------------------------- grouped experts
def _block_m(n_rows: int, n_groups: int) -> int:
    """Row tile of the grouped GEMM: 16 while an expert gets a few rows on average (decode), more for
    prefill-sized batches; under exact accumulation (deterministic mode) 16 whatever the batch."""
    if _INTERPRET or n_rows <= 8 * n_groups or is_exact():
        return 16
    return 64 if n_rows < 128 * n_groups else 128


def _launch_gmm(a, sa, b, bs, out, tiles, *, a_idx=None, c_idx=None, second=None) -> None:
    """out[rows of g] = int8 GEMM(a[rows], b[g]) in fp32; b [E, N, K] int8, bs [E, N] fp32. second: (b2, bs2,
    out2) of b's shape and strides, multiplied in the same pass over a."""
    n, k = b.size(1), a.size(1)
    dummy = tiles.group
    if second is not None:
        b2, bs2, out2 = second
        assert b2.shape == b.shape and b2.stride() == b.stride() and bs2.stride() == bs.stride()
        assert out2.shape == out.shape and out2.stride() == out.stride()
    args = (
        a,
        sa,
        a_idx if a_idx is not None else dummy,
        b,
        bs,
        out,
        *(second if second is not None else (b, bs, out)),
        c_idx if c_idx is not None else dummy,
        tiles.group,
        tiles.row,
        tiles.end,
        n,
        k,
        tiles.n_groups,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        bs.stride(0),
        out.stride(0),
    )
    flags = dict(GATHER_A=a_idx is not None, SCATTER_C=c_idx is not None, DUAL=second is not None, BM=tiles.bm)
    if _INTERPRET:
        _launch(_int8_gmm_kernel, (triton.cdiv(n, 32), tiles.n_tiles), *args, **flags, BN=32, BK=64)
        return
    _gmm_tuned[lambda meta: (triton.cdiv(n, meta["BN"]), tiles.n_tiles)](*args, **flags)


def triton_int8_moe_experts(
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
) -> torch.Tensor:
    """`int8_moe_experts` as grouped INT8 GEMMs over all local experts (see the module docstring)."""
    n_local = w1.size(0)
    m = indices.numel()
    plan, tiles = _plan_and_tiles(weights, indices, n_local, expert_offset, _block_m(m, n_local))
    xq, xs = int8_quant(x)  # once per token
    xq, xs = xq.contiguous(), xs.reshape(-1).contiguous()
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()
    s1, s2, s3 = (t.float().contiguous() for t in (s1, s2, s3))
    inter = w1.size(1)
    gate = torch.empty(m, inter, dtype=torch.float32, device=x.device)  # [M, I], sorted slots
    up = torch.empty_like(gate)
    _launch_gmm(xq, xs, w1, s1, gate, tiles, a_idx=plan.token, second=(w3, s3, up))  # gate and up, one launch
    h = swiglu_fp32(gate, up, swiglu_limit, plan.weight.unsqueeze(-1))  # fp32 [M, I]
    hq, hs = int8_quant(h)
    out = torch.empty(m, x.size(1), dtype=torch.float32, device=x.device)  # [T*k, D] slot order
    _launch_gmm(hq.contiguous(), hs.reshape(-1).contiguous(), w2, s2, out, tiles, c_idx=plan.order)
    return out.view(plan.n_tokens, plan.topk, -1).sum(1)


def _experts_can_run(x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset=0) -> str | None:
    reason = device_reason(x) or _int8_cores_reason(x)
    if reason:
        return reason
    if x.dim() != 2 or not x.dtype.is_floating_point:
        return f"x must be [T, D] floating point, got {x.dtype} {tuple(x.shape)}"
    if any(w.dtype != torch.int8 or w.dim() != 3 for w in (w1, w2, w3)):
        return "expert weights must be stacked int8 [E, out, in]"
    if torch.is_grad_enabled() and x.requires_grad:
        return "INT8 experts are inference-only (gradient requested)"
    if max(x.size(1), w1.size(1)) * 127 * 127 > INT32_MAX:
        return "the inner dimension can overflow the INT32 sums"
    return None


register(
    "int8_moe_experts", "triton", triton_int8_moe_experts, can_run=_experts_can_run, deterministic=True, priority=10
)
