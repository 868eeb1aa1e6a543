"""`route` (backend "triton"): a MoE router after its projection in one launch instead of about ten.

The reference (`dsv4.ops.reference.route`) runs softplus, sqrt, the rounding to fp32, the bias add, topk,
the gather, the normalizing sum, the division and the scale as separate torch kernels: some ten launches
per MoE layer in every decode step, each a few microseconds of a step that is bound by its launch count.
Here one program per token does all of it:

- scores: sqrt(softplus(x)) in the accumulation dtype (fp32, or float64 under exact accumulation) with the
  reference's operations - libdevice `exp` and `log1p`, which torch's CUDA softplus calls too, x itself
  above 20, a correctly rounded square root - then rounded to fp32;
- indices: the table's row for a hash layer, else k rounds of "the largest remaining scores + bias" (NaN
  first and the lowest index among equals; torch.topk leaves the order of exact ties unspecified);
- weights: the picked scores in the accumulation dtype, their sum left to right in that order (the
  reference's fixed order), one correctly rounded division each, times route_scale.

So the scores, the choice and the weights are the reference's bits on CUDA, except two edges named here:
exact ties between experts (torch's order is not defined) and logits below about -87, whose fp32 exp
is subnormal (Triton's libdevice flushes subnormals to zero: the score is 0 where torch's is ~1e-20).
The interpreter (CPU tests) has no libdevice: log1p is computed from log there, a few ulp apart.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import register
from ..precision import acc_dtype, is_exact
from ._common import Kernel, device_reason, interpret_mode

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 4096  # one program holds a token's scores in registers
MAX_K = 16
_alloc = torch.empty  # (the tests poison it: every output element must be written)


def _route_kernel(
    logit_ptr,
    bias_ptr,
    table_ptr,
    tok_ptr,
    scores_ptr,
    w_ptr,
    idx_ptr,
    E,
    s_l,
    s_tab,
    s_tok,
    route_scale,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HASH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC64: tl.constexpr,
    INTERP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    inside = offs < E
    x = tl.load(logit_ptr + row * s_l + offs, mask=inside, other=0.0)
    if ACC64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    # softplus (torch's: x above the threshold 20, else log1p(exp(x))), then the square root
    if INTERP:
        e = tl.exp(x)
        u = 1.0 + e
        tiny = u == 1.0
        l1 = tl.where(tiny, e, tl.log(u) * (e / tl.where(tiny, 1.0, u - 1.0)))
    else:
        l1 = libdevice.log1p(libdevice.exp(x))
    sp = tl.where(x > 20.0, x, l1)
    if ACC64:
        s32 = tl.sqrt(sp).to(tl.float32)  # (float64: sqrt.rn; fp32's tl.sqrt would be the approximate one)
    else:
        s32 = tl.sqrt_rn(sp)
    tl.store(scores_ptr + row * E + offs, s32, mask=inside)
    if ACC64:
        s_acc = s32.to(tl.float64)
    else:
        s_acc = s32
    if not HASH:
        b = s32
        if HAS_BIAS:
            b = s32 + tl.load(bias_ptr + offs, mask=inside, other=0.0)
        avail = inside
    kk = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_K,), s_acc.dtype)
    chosen = tl.zeros((BLOCK_K,), tl.int64)
    total = tl.sum(tl.zeros((BLOCK_K,), s_acc.dtype), axis=0)
    if HASH:
        tok = tl.load(tok_ptr + row * s_tok).to(tl.int64)
    for j in tl.static_range(K):
        if HASH:
            i = tl.load(table_ptr + tok * s_tab + j).to(tl.int64)
        else:
            nan = (b != b) & avail
            has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
            mx = tl.max(tl.where(avail & ~nan, b, float("-inf")), axis=0)
            cand = tl.where(has_nan, nan, avail & (b == mx))
            i = tl.min(tl.where(cand, offs, BLOCK_E), axis=0).to(tl.int64)
            avail = avail & (offs != i)
        p = tl.sum(tl.where(offs == i, s_acc, 0.0), axis=0)  # (one term: exact)
        if j == 0:
            total = p
        else:
            total = total + p
        picked = tl.where(kk == j, p, picked)
        chosen = tl.where(kk == j, i, chosen)
    if ACC64:
        w = picked / total * route_scale  # (an fp32 number: `_can_run`)
    else:
        w = tl.div_rn(picked, tl.zeros((BLOCK_K,), tl.float32) + total) * route_scale
    k_in = kk < K
    tl.store(w_ptr + row * K + kk, w.to(tl.float32), mask=k_in)
    tl.store(idx_ptr + row * K + kk, chosen, mask=k_in)


_kernel = Kernel(_route_kernel)


def triton_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    score_func: str = "sqrtsoftplus",
    route_scale: float = 1.0,
    table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As the reference `route` (sqrtsoftplus), one program per token."""
    T, E = logits.shape
    dev = logits.device
    scores = _alloc((T, E), dtype=torch.float32, device=dev)
    weights = _alloc((T, k), dtype=torch.float32, device=dev)
    indices = _alloc((T, k), dtype=torch.int64, device=dev)
    if T == 0:
        return weights, indices, scores
    hashed = table is not None
    _kernel[(T,)](
        logits,
        bias if bias is not None else scores,
        table if hashed else indices,
        token_ids if hashed else indices,
        scores,
        weights,
        indices,
        E,
        logits.stride(0),
        table.stride(0) if hashed else 0,
        token_ids.stride(0) if hashed else 0,
        float(route_scale),
        K=k,
        BLOCK_E=max(16, triton.next_power_of_2(E)),
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        HASH=hashed,
        HAS_BIAS=bias is not None,
        ACC64=acc_dtype() == torch.float64,
        INTERP=interpret_mode(),
    )
    return weights, indices, scores


def _can_run(logits, bias, k, score_func="sqrtsoftplus", route_scale=1.0, table=None, token_ids=None) -> str | None:
    tensors = [t for t in (logits, bias, table, token_ids if table is not None else None) if t is not None]
    reason = device_reason(*tensors)
    if reason:
        return reason
    if score_func != "sqrtsoftplus":
        return f"score_func {score_func!r}: only sqrtsoftplus (V4's) has a kernel"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd: the kernel has no backward (training runs the reference)"
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES or logits.stride(1) != 1:
        return f"logits must be [T, E] float with contiguous rows, got {tuple(logits.shape)} {logits.dtype}"
    T, E = logits.shape
    if not 1 <= E <= MAX_EXPERTS or not 1 <= k <= min(E, MAX_K):
        return f"{E} experts, top-{k} (the kernel takes 1 <= k <= min(E, {MAX_K}), E <= {MAX_EXPERTS})"
    if bias is not None and (tuple(bias.shape) != (E,) or bias.dtype != torch.float32 or bias.stride(0) != 1):
        return f"bias must be [{E}] fp32 contiguous, got {tuple(bias.shape)} {bias.dtype}"
    if table is not None and token_ids is None:
        return "a hash layer's table needs the token ids"
    if table is not None:
        if (
            table.dim() != 2
            or table.size(1) != k
            or table.stride(1) != 1
            or table.dtype not in (torch.int32, torch.int64)
        ):
            return (
                f"table must be [vocab, {k}] int32/int64 with contiguous rows, got {tuple(table.shape)} {table.dtype}"
            )
        if tuple(token_ids.shape) != (T,) or token_ids.dtype not in (torch.int32, torch.int64):
            return f"token_ids must be [{T}] int32/int64, got {tuple(token_ids.shape)} {token_ids.dtype}"
    if is_exact() and float(np.float32(route_scale)) != route_scale:
        return f"route_scale {route_scale} is not an fp32 number (the kernel takes it as one; exact accumulation)"
    return None


register("route", "triton", triton_route, can_run=_can_run, deterministic=True, priority=10)

__all__ = ["triton_route"]
