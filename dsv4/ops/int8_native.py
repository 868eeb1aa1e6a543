"""INT8 W8A8 backends written with torch ops only (no Triton): backend "int_mm" of `int8_gemm` and of
`int8_moe_experts`, through `torch._int_mm` (INT8 x INT8 -> INT32; oneDNN / VNNI on CPU, cuBLASLt IMMA on
CUDA), and backend "parts" of `int8_linear`: `ops.int8_quant` then `ops.int8_gemm`, each on its own best
backend (what runs wherever the fused kernel does not: the CPU, prompt-sized calls).

The INT32 result is exact, and the dequantization afterwards is the reference's (`fp32(acc) * s_token *
s_row`, in that order), so these backends agree with `dsv4.ops.reference` bit for bit.

Where `torch._int_mm` cannot run, the backend says why: a torch without it, a device other than CPU and
CUDA, and on CUDA cuBLASLt's shape rules (more than 16 rows, K and N multiples of 8, an sm75+ GPU). The
experts backend loops over the local experts (their row counts are read to the host once per call); on
CUDA it pads an expert's rows to 17 with zero rows, whose results are dropped.
"""

from __future__ import annotations

import torch

from . import clamped_swiglu, int8_gemm, int8_quant, register
from .moe_shared import build_plan, combine_rows

INT32_MAX = 2**31 - 1
CUDA_MIN_ROWS = 17  # cuBLASLt's INT8 GEMM behind torch._int_mm wants more than 16 rows
INT_MM_MIN_TOKENS_CUDA = 256  # default selection on CUDA from this many token rows (fewer: the Triton kernel)


def swiglu_fp32(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The INT8 experts' activation: the clamped SwiGLU [x weight [..., 1]] in fp32 through `ops.clamped_swiglu`
    (one kernel on a GPU, the reference's bits there); on the CPU, the Triton interpreter included, the
    reference itself (the interpreter's `exp` is numpy's, a few ulp from torch's, and the INT8 kernels'
    exactness tests run there)."""
    return clamped_swiglu(gate, up, limit, torch.float32, weight, backend=None if gate.is_cuda else "reference")


def int_mm_reason(m: int | None, k: int, n: int, device: torch.device) -> str | None:
    """Why `torch._int_mm` cannot multiply [m, k] x [k, n] INT8 on `device` (None: it can). m None: any
    row count (the caller pads)."""
    if not hasattr(torch, "_int_mm"):
        return f"torch {torch.__version__} has no torch._int_mm"
    if k * 127 * 127 > INT32_MAX:
        return f"K = {k} can overflow the INT32 sums (K * 127^2 > 2^31 - 1)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (7, 5):
            return f"INT8 tensor cores need an sm75+ GPU, this one is sm{major}{minor}"
        if m is not None and m < CUDA_MIN_ROWS:
            return f"torch._int_mm on CUDA needs more than 16 rows, got {m}"
        if k % 8 or n % 8:
            return f"torch._int_mm on CUDA needs K and N multiples of 8, got K={k}, N={n}"
        return None
    if device.type != "cpu":
        return f"torch._int_mm runs on CPU and CUDA, not {device.type}"
    return None


def _int_mm(a: torch.Tensor, w: torch.Tensor, pad: bool = False) -> torch.Tensor:
    """a [M, K] int8 @ w [N, K]^T int8 -> [M, N] int32 (w passed as its transposed view: column-major, as
    cuBLASLt wants it). pad: on CUDA, fewer than 17 rows are padded with zero rows and cut off again."""
    m = a.size(0)
    if pad and a.is_cuda and 0 < m < CUDA_MIN_ROWS:
        a = torch.cat([a, a.new_zeros(CUDA_MIN_ROWS - m, a.size(1))])
    return torch._int_mm(a.contiguous(), w.t())[:m]


# ----------------------------------------------------------------------------- linear
def parts_int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    q, s = int8_quant(x)
    return int8_gemm(q, s, weight, scale, out_dtype or x.dtype)


# below a fused kernel (priority 10), above the reference: the two ops then each pick their own backend
register("int8_linear", "parts", parts_int8_linear, deterministic=True, priority=5)


# ----------------------------------------------------------------------------- dense
def int_mm_int8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    k, n = q.size(-1), weight.size(0)
    acc = _int_mm(q.reshape(-1, k), weight)  # [M, N] int32
    y = acc.float() * s.reshape(-1, 1).float() * scale.float()
    return y.to(out_dtype).view(*q.shape[:-1], n)


def _operands_reason(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> str | None:
    if q.dtype != torch.int8 or weight.dtype != torch.int8:
        return f"q and weight must be int8, got {q.dtype} and {weight.dtype}"
    if weight.dim() != 2 or weight.size(1) != q.size(-1):
        return f"weight must be [N, K={q.size(-1)}], got {tuple(weight.shape)}"
    if tuple(s.shape) != (*q.shape[:-1], 1) or tuple(scale.shape) != (weight.size(0),):
        return (
            f"scales must be one per token {(*q.shape[:-1], 1)} and one per weight row ({weight.size(0)},), "
            f"got {tuple(s.shape)} and {tuple(scale.shape)}"
        )
    if len({q.device, s.device, weight.device, scale.device}) != 1:
        return "operands on several devices"
    return None


def _dense_can_run(q, s, weight, scale, out_dtype=torch.float32) -> str | None:
    reason = _operands_reason(q, s, weight, scale)
    if reason:
        return reason
    m = q.numel() // max(q.size(-1), 1)
    return int_mm_reason(m, q.size(-1), weight.size(0), q.device)


def _dense_prefer(q, s, weight, scale, out_dtype=torch.float32) -> bool:
    """The default on a CPU; on CUDA from INT_MM_MIN_TOKENS_CUDA token rows (fewer: the Triton GEMV-shaped
    kernel, which cuBLASLt's INT8 path does not cover below 17 rows anyway)."""
    return not q.is_cuda or q.numel() // max(q.size(-1), 1) >= INT_MM_MIN_TOKENS_CUDA


register(
    "int8_gemm",
    "int_mm",
    int_mm_int8_gemm,
    can_run=_dense_can_run,
    deterministic=True,
    priority=5,
    prefer=_dense_prefer,
)


# ----------------------------------------------------------------------------- routed experts
def int_mm_int8_moe_experts(
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
    """`int8_moe_experts` with the slots sorted by expert (the routing plan) and one `torch._int_mm` per
    local expert and projection; a token's k slot outputs are summed in slot order."""
    plan = build_plan(weights, indices, w1.size(0), expert_offset)
    xq, xs = int8_quant(x)  # once per token
    rows_q, rows_s = xq[plan.token], xs[plan.token]  # [T*k, D], [T*k, 1]
    out = torch.zeros(plan.token.numel(), x.size(1), dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(plan.ends.tolist()):  # one host read
        if end > start:
            q, s = rows_q[start:end], rows_s[start:end]
            gate = _int_mm(q, w1[e], pad=True).float() * s * s1[e]  # fp32 [n, I]
            up = _int_mm(q, w3[e], pad=True).float() * s * s3[e]
            h = swiglu_fp32(gate, up, swiglu_limit, plan.weight[start:end].unsqueeze(-1))
            hq, hs = int8_quant(h)
            out[start:end] = _int_mm(hq, w2[e], pad=True).float() * hs * s2[e]
        start = end
    return combine_rows(out, plan)


def _experts_can_run(x, weights, indices, w1, s1, w2, s2, w3, s3, swiglu_limit, expert_offset=0) -> str | None:
    if x.dim() != 2 or not x.dtype.is_floating_point:
        return f"x must be [T, D] floating point, got {x.dtype} {tuple(x.shape)}"
    if any(w.dtype != torch.int8 or w.dim() != 3 for w in (w1, w2, w3)):
        return "expert weights must be stacked int8 [E, out, in]"
    if torch.is_grad_enabled() and x.requires_grad:
        return "INT8 experts are inference-only (gradient requested)"
    d, i = x.size(1), w1.size(1)
    return int_mm_reason(None, d, i, x.device) or int_mm_reason(None, i, d, x.device)


register(
    "int8_moe_experts", "int_mm", int_mm_int8_moe_experts, can_run=_experts_can_run, deterministic=True, priority=5
)
