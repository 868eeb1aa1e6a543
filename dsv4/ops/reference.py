"""Plain-torch references: the definition of every DeepSeek-V4 primitive.

Written for clarity, not speed. Every function here is differentiable where the model trains through it
(the quantization round trips use a straight-through gradient). Fast backends are tested against these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import formats as fm
from ..config_schema import SCORE_FUNCS
from ..formats.fp4 import FP4_MAX as FP4_E2M1_MAX
from ..formats.fp4 import FP4_VALUES
from ..formats.fp8 import FP8_MAX as FP8_E4M3_MAX
from .precision import acc_dtype
from .reference_linear import linear, linear_bf16_fp32, linear_fp32  # noqa: F401  (re-exported: their own module)
from .reference_loss import cross_entropy  # noqa: F401  (re-exported: its own module)

FP4_E2M1_GRID = FP4_VALUES[:8]  # E2M1 magnitudes by code 0..7 (codes 8..15 are the negatives)


# ----------------------------------------------------------------------------- activation quantization
ACT_BLOCK = 128  # activations feeding an FP8 / FP4 weight are quantized per token in blocks of 128


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x for fp32 x > 0, exactly (from the bit fields: exponent + 1 when any
    mantissa bit is set): the UE8M0 scale rounding. NaN and inf pass through."""
    xf = x.float().contiguous()
    bits = xf.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    e = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.where(torch.isfinite(xf), (e << 23).view(torch.float32), xf)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., n] -> fp32 [..., ceil(n/block), block], the last block zero-padded when n is ragged."""
    n = x.size(-1)
    nb = -(-n // block)
    xf = x.detach().float()
    if nb * block != n:
        xf = F.pad(xf, (0, nb * block - n))
    return xf.unflatten(-1, (nb, block))


def _block_scale(amax: torch.Tensor, qmax: float, pow2: bool) -> torch.Tensor:
    """amax times the fp32 reciprocal of qmax (as the official kernels compute it), rounded up to a power
    of two when pow2 (UE8M0 scales)."""
    s = amax * (1.0 / qmax)
    return pow2_ceil(s) if pow2 else s


def act_quant(x: torch.Tensor, block: int = ACT_BLOCK, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 quantization of the last dim in blocks (per token): the official `act_quant`.

    For each block: amax = max(|x|, 1e-4), scale s = amax * fp32(1/448), rounded up to a power of two
    when pow2 (UE8M0, `scale_fmt == "ue8m0"`), else kept as that fp32 value; q = E4M3(clamp(x / s, +-448))
    rounded to nearest, ties to even. When n is not a multiple of block the last block holds the rest.
    x [..., n] any float dtype -> (q [..., n] float8_e4m3fn (uint8 bytes where torch lacks the dtype),
    s [..., ceil(n/block)] fp32). x is read as its value: no gradient."""
    n = x.size(-1)
    xb = _blocks(x, block)  # [..., nb, block]
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _block_scale(amax, FP8_E4M3_MAX, pow2)  # [..., nb, 1]
    codes = fm.e4m3_encode((xb / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    return fm.fp8_from_bytes(codes.flatten(-2)[..., :n]), s.squeeze(-1)


def act_dequant(q: torch.Tensor, s: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """(q [..., n] E4M3, s [..., ceil(n/block)]) -> fp32 [..., n]: each code times its block's scale."""
    n = q.size(-1)
    return fm.e4m3_decode(q) * s.float().repeat_interleave(block, -1)[..., :n]


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized value. Backward: the identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the nearest E2M1 value, ties to the even code.

    The grid is uniform in three ranges - step 0.5 below 2, 1 from 2 to 4, 2 from 4 to 6 - and an even code
    is an even multiple of its range's step, so rounding |v| / step to the nearest integer, ties to even
    (`torch.round`), is the rule; the power-of-two scalings are exact. (A NaN stays NaN.)"""
    a = v.abs()
    per_step = torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))  # 1 / step
    return torch.copysign(torch.round(a * per_step) / per_step, v)


def fp8_round_trip(x: torch.Tensor, block: int = 64, pow2: bool = True, inplace: bool = False) -> torch.Tensor:
    """FP8 E4M3 quantize -> dequantize along the last dim in blocks: `act_dequant(act_quant(x))` in x's dtype
    (the official `act_quant(..., inplace=True)`).

    Used for the FP8 storage the KV was trained with (QAT, block 64) and for the activations of W8A8
    linears whose weights were dequantized at load (block 128). pow2: power-of-two (UE8M0) scales
    (`scale_fmt == "ue8m0"`), else amax/448 fp32 scales. A ragged last block holds the rest of the dim.
    Gradient: straight-through. `inplace=True` writes the result into x (a view, e.g. a row's first dims)
    and returns x (inference: refused where autograd records x)."""
    if inplace:
        check_inplace(x, "fp8_round_trip")
        return x.copy_(fp8_round_trip(x, block, pow2))
    q, s = act_quant(x, block, pow2)
    return _StraightThrough.apply(x, act_dequant(q, s, block).to(x.dtype))


def fp4_round_trip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4 (E2M1) quantize -> dequantize along the last dim in blocks, power-of-two scales
    (amax * fp32(1/6), rounded up).

    Used by the Lightning Indexer's QAT simulation. Gradient: straight-through."""
    n = x.size(-1)
    if n % block:
        raise ValueError(f"fp4_round_trip: last dim {n} is not a multiple of block {block}")
    xb = x.detach().float().unflatten(-1, (n // block, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_E2M1_MAX * 2.0**-126)
    scale = _block_scale(amax, FP4_E2M1_MAX, True)
    q = round_to_e2m1((xb / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)) * scale
    return _StraightThrough.apply(x, q.flatten(-2).to(x.dtype))


# ----------------------------------------------------------------------------- W8A8 GEMMs
def fp8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """FP8 activations x FP8 weight (the official `fp8_gemm`): y[..., N] = sum over k of
    act_dequant(q, s)[..., k] * dequant(weight)[N, k], in fp32 (float64 under exact accumulation),
    returned in out_dtype.

    q [..., K] E4M3 with s [..., ceil(K/128)] fp32 (from `act_quant`); weight [N, K] E4M3 with 128x128
    block scales [ceil(N/128), ceil(K/128)] (E8M0 bytes or fp32). Not differentiable."""
    a = act_dequant(q, s, ACT_BLOCK)
    w = fm.dequantize_fp8(weight, scale, torch.float32)
    return linear(a, w).to(out_dtype)


def fp4_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """FP8 activations x MXFP4 weight (the official `fp4_gemm`): as `fp8_gemm` with weight [N, K/2] packed
    E2M1 (low nibble = element 2i) and one E8M0 scale per 32 elements of a row [N, K/32]."""
    a = act_dequant(q, s, ACT_BLOCK)
    w = fm.dequantize_mxfp4(weight, scale, torch.float32)
    return linear(a, w).to(out_dtype)


# ----------------------------------------------------------------------------- INT8 W8A8
# Weights quantized per output row, activations per token, both symmetric INT8 in [-127, 127]; the INT8 x
# INT8 products are summed exactly (as INT32) and dequantized with the two scales.
INT8_MAX = 127
INT8_AMAX_FLOOR = 2.0**-100  # a zero row gets a normal fp32 scale (and codes 0), never a division by 0


def int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 quantization of the last dim with one scale per row (per token for activations,
    per output row for a weight [N, K]).

    In fp32: amax = max(|x|, INT8_AMAX_FLOOR) over the row, s = amax / 127 (one correctly rounded
    division), q = clamp(round(x / s), -127, 127), rounded to nearest, ties to even. x [..., K] any float
    dtype -> (q [..., K] int8, s [..., 1] fp32). x is read as its value: no gradient.
    """
    xf = x.detach().float()
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(INT8_AMAX_FLOOR)
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal (not always
    # the correctly rounded quotient, so a CUDA scale could differ from the CPU's in its last bit)
    s = amax / torch.full_like(amax, INT8_MAX)
    q = torch.round(xf / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def int8_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(q [..., K] int8, s [..., 1] or [...] fp32) -> fp32 [..., K]: each code times its row's scale."""
    return q.float() * (s.float() if s.dim() == q.dim() else s.float().unsqueeze(-1))


def int8_gemm(
    q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """INT8 activations x INT8 weight: y[..., n] = fp32(sum_k q[..., k] * weight[n, k]) * s[...] * scale[n].

    The products are summed exactly (an INT32 result: |sum| <= K * 127^2; here in float64, exact for any K
    below 2^39), converted to fp32 once (round to nearest even), then multiplied by the token's scale and
    then by the row's scale, in fp32, in that order; returned in out_dtype. Every backend computes these
    same operations, so they agree bit for bit.

    q [..., K] int8 with s [..., 1] fp32 (`int8_quant` of the activations); weight [N, K] int8 with scale
    [N] fp32 (`int8_quant` of the weight rows). Not differentiable.
    """
    acc = F.linear(q.double(), weight.double())  # [..., N], exact integers
    return (acc.float() * s.float() * scale.float()).to(out_dtype)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An INT8 linear: x quantized per token (`int8_quant`), times the INT8 weight (`int8_gemm`).

    x [..., K] float; weight [N, K] int8 with scale [N] fp32 -> [..., N] in out_dtype (default x.dtype). What
    the INT8 linears and shared experts run; a backend may fuse the two steps (one launch at decode
    sizes), never change their numbers."""
    q, s = int8_quant(x)
    return int8_gemm(q, s, weight, scale, out_dtype or x.dtype)


@functools.cache  # constants a captured CUDA graph may hold: never evicted
def _hadamard_matrix(n: int, device: str) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"hadamard: size {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.size(0) < n:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform of the last dim: `x @ H / sqrt(n)` (computed in fp32)."""
    n = x.size(-1)
    h = _hadamard_matrix(n, str(x.device))
    return (x.to(acc_dtype()) @ h.to(acc_dtype()) * n**-0.5).to(x.dtype)


# ----------------------------------------------------------------------------- quantized-weight linears
# The definition: dequantize the weight, round it to x's dtype, a dense matmul. The Triton backends
# (`dsv4.ops.triton.quant_gemm`) dequantize inside the GEMM instead and are tested against these.
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with W = dequant(FP8 block-scaled weight) rounded to x.dtype. x [..., K] -> [..., N]."""
    w = fm.dequantize_fp8(weight, scale, dtype=torch.float32).to(x.dtype)
    return F.linear(x, w)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with W = dequant(MXFP4 weight) rounded to x.dtype. x [..., K] -> [..., N]."""
    w = fm.dequantize_mxfp4(weight, scale, dtype=torch.float32).to(x.dtype)
    return F.linear(x, w)


# ----------------------------------------------------------------------------- norm and rotary embedding
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS normalization of the last dim: x [..., n] (any float dtype), weight [n] fp32 or None.

    In fp32: `y = x * rsqrt(mean(x^2) + eps)`, times `weight` when given; returned in x's dtype.
    Differentiable in x and weight.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, inplace: bool = False
) -> torch.Tensor:
    """Rotary embedding of the last `r = 2 * inv_freq.numel()` dims of x, the first `d - r` unchanged.

    x [b, s, d] or [b, s, h, d]; positions [s] integer (or [1] for every row: decode, s == 1); inv_freq
    [r/2] fp32. Interleaved pairs: x0 = even, x1 = odd dims of the tail, angle = position * inv_freq:
    `y0 = x0 cos - x1 sin`, `y1 = x0 sin + x1 cos` in fp32 (`inverse`: sin negated, the inverse rotation),
    cast to x's dtype. Differentiable in x (the gradient is the inverse rotation; the rest passes through).
    `inplace=True` writes the rotated tail into x and returns x (inference: refused where autograd records).
    """
    r = 2 * inv_freq.numel()
    if inplace:
        check_inplace(x)
        x[..., -r:] = rope_tail(x[..., -r:], positions, inv_freq, inverse)
        return x
    nope, pe = x[..., :-r], x[..., -r:]
    angles = torch.outer(positions.float(), inv_freq)  # [s, r/2]
    cos, sin = angles.cos(), angles.sin()
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [s, 1, r/2]
    if inverse:
        sin = -sin
    pf = pe.float()
    x0, x1 = pf[..., 0::2], pf[..., 1::2]
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([nope, y.to(x.dtype)], dim=-1)


def check_inplace(x: torch.Tensor, op: str = "rope_tail") -> None:
    """An op with `inplace=True` rewrites x: only where autograd does not record x."""
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(f"{op}(inplace=True) on a tensor that requires grad: use inplace=False in training")


# ----------------------------------------------------------------------------- sparse attention
def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over index-gathered keys with a per-head sink.

    q [b, s, h, d]; kv [b, n, d] (one shared head, used as key and value); sink [h] (fp32);
    idx [b, s, k] int (positions into kv, -1 = no key). Returns (o [b, s, h, d] in q.dtype,
    lse [b, s, h] fp32), where lse = log(sum_j exp(score_j) + exp(sink_h)) over valid keys: the sink
    joins the denominator only. A query with no valid key gets o = 0, lse = sink. lse is returned
    detached: it is not differentiable (backward through it is undefined by contract).
    """
    b, s, h, d = q.shape
    valid = idx >= 0  # [b, s, k]
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    acc = acc_dtype()
    # cast before the gather: its backward then accumulates dkv in fp32, not in kv's dtype
    kv_sel = kv.to(acc)[batch, idx.clamp_min(0).long()]  # [b, s, k, d]
    scores = torch.einsum("bshd,bskd->bshk", q.to(acc), kv_sel) * scale  # [b, s, h, k]
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink_col = sink.to(acc).view(1, 1, h, 1).expand(b, s, h, 1)
    lse = torch.logsumexp(torch.cat([scores, sink_col], -1), -1)  # [b, s, h]
    p = torch.exp(scores - lse.unsqueeze(-1))  # [b, s, h, k]
    o = torch.einsum("bshk,bskd->bshd", p, kv_sel)
    return o.to(q.dtype), lse.float().detach()


# ----------------------------------------------------------------------------- lightning indexer
def compressed_visible(positions: torch.Tensor, n: int, ratio: int) -> torch.Tensor:
    """[s, n] (positions [s]) or [b, s, n] (positions [b, s]) bool: compressed entry j is visible to the
    query at position t iff j < (t+1) // ratio (a position of -1 sees nothing)."""
    j = torch.arange(n, device=positions.device)
    return j < torch.div(positions + 1, ratio, rounding_mode="floor").unsqueeze(-1)


def indexer_scores(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, ratio: int
) -> torch.Tensor:
    """Lightning Indexer scores: `score[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])`.

    q [b, s, h, d]; k [b, n, d]; weights [b, s, h]; positions [s] (shared by the rows) or [b, s] absolute
    query positions. Returns [b, s, n] fp32 with invisible entries (j >= (t+1)//ratio) set to -inf.
    """
    acc = acc_dtype()
    dots = torch.einsum("bshd,bnd->bshn", q.to(acc), k.to(acc)).relu()  # [b, s, h, n]
    score = (dots * weights.to(acc).unsqueeze(-1)).sum(2).float()  # [b, s, n]
    vis = compressed_visible(positions, k.size(1), ratio)  # [s, n]
    return score.masked_fill(~vis, float("-inf"))


def select_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, ties broken towards the lower index;
    entries with score -inf (invisible) become -1. Deterministic: ReLU scores tie at 0 often."""
    k = min(k, score.size(-1))
    values, order = score.sort(dim=-1, descending=True, stable=True)
    return torch.where(torch.isfinite(values[..., :k]), order[..., :k], -1)


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    topk: int,
    cand: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-`min(topk, n)` visible compressed entries per query by indexer score (ties: lower index
    first); -1 pads the rest. Returns [b, s, min(topk, n)] int64.

    cand [b, n] int64 (a paged cache): k is then the pool [rows, d] and row b's keys are k[cand[b]] (here
    gathered; a kernel may read the pool through cand instead of a gathered copy)."""
    if cand is not None:
        k = k[cand]
    return select_topk(indexer_scores(q, k, weights, positions, ratio), topk)


# ----------------------------------------------------------------------------- mHC
def hc_split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split mixes [..., (2+hc)*hc] into pre [..., hc], post [..., hc], comb [..., hc, hc].

    comb starts as a row softmax (+eps), then one column normalization and iters-1 (row, column)
    normalizations, each dividing by (sum + eps): doubly stochastic in the limit. Computed in the
    accumulation dtype (float64 under exact accumulation: then a token's values do not depend on how many
    tokens share the call, which fp32 elementwise kernels do not promise for strided slices).
    """
    out_dtype = mixes.dtype
    acc = acc_dtype()
    mixes, scale, base = mixes.to(acc), scale.to(acc), base.to(acc)
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre.to(out_dtype), post.to(out_dtype), comb.to(out_dtype)


def _hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_dtype()
    xf = x.flatten(-2).to(acc)  # [b, s, hc*d]
    rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    with torch.autocast(device_type=x.device.type, enabled=False):
        mixes = F.linear(xf, fn.to(acc)) * rsqrt  # [b, s, mix]
    return xf, mixes.float()


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a sublayer: x [b, s, hc, d] -> (sublayer input [b, s, d], post [b, s, hc], comb)."""
    hc = x.size(-2)
    _, mixes = _hc_mixes(x, fn, norm_eps)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)  # [b, s, d]
    return y.to(x.dtype), post, comb


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a sublayer: copy j = post_j * f + sum_i comb[i, j] * residual_i.

    f [b, s, d]; residual [b, s, hc, d]; post [b, s, hc]; comb [b, s, hc, hc]. Returns [b, s, hc, d].
    """
    acc = acc_dtype()
    mixed = torch.einsum("bsij,bsid->bsjd", comb.to(acc), residual.to(acc))
    y = post.to(acc).unsqueeze(-1) * f.to(acc).unsqueeze(-2) + mixed
    return y.to(f.dtype)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    """Final mHC reduce (no Sinkhorn): x [b, s, hc, d] -> [b, s, d]."""
    _, mixes = _hc_mixes(x, fn, norm_eps)
    # (in the accumulation dtype, rounded to fp32, as `hc_split_sinkhorn`'s pre: under exact accumulation a
    # token's value then does not depend on how many tokens share the call - fp32's vectorized sigmoid and
    # its scalar tail differ in the last bit)
    acc = acc_dtype()
    pre = (torch.sigmoid(mixes.to(acc) * scale.to(acc) + base.to(acc)) + hc_eps).float()  # [b, s, hc]
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


# ----------------------------------------------------------------------------- compressor
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Gated pooling of one compression group: per-channel softmax of score over the slots.

    kv, score [..., slots, c] (fp32; -inf scores mark empty slots) -> [..., c].
    """
    acc = acc_dtype()
    return (kv.to(acc) * score.to(acc).softmax(-2)).sum(-2).to(kv.dtype)


def pool_groups(
    kv: torch.Tensor,
    score: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_score: torch.Tensor,
    group_new: torch.Tensor,
    group_ring: torch.Tensor,
    live: torch.Tensor,
    coff: int,
) -> torch.Tensor:
    """A step's compression groups pooled (`compress_pool`) from rows gathered out of this step's raw rows
    or the ring of earlier steps' rows; groups that are not live give 0.

    kv, score [T, W] this step's raw rows, ring_kv, ring_score [R, W] kept rows (W = coff * c channels);
    group_new [G, n] (n = coff * r slots): the row of kv / score that each slot reads, or -1 for the ring
    row group_ring [G, n]; slot i reads channel block i // r (coff 2, overlap: the previous group's r
    rows their first c channels, the group's own rows their last c); live [G] bool. -> [G, c], kv's dtype.
    Indices must be in range.
    """
    n = group_new.size(-1)
    r, c = n // coff, kv.size(-1) // coff
    fresh = (group_new >= 0).unsqueeze(-1)  # [G, n, 1]
    block = torch.arange(n, device=group_new.device) // r  # [n] the channel block each slot reads

    def rows(src: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:  # -> [G, n, c]
        new = src.reshape(-1, c)[group_new.clamp_min(0) * coff + block]  # rows as [T * coff, c] blocks
        old = kept.reshape(-1, c)[group_ring * coff + block]
        return torch.where(fresh, new, old)

    pooled = compress_pool(rows(kv, ring_kv), rows(score, ring_score))
    return torch.where(live.unsqueeze(-1), pooled, 0).to(kv.dtype)


def write_rows(
    srcs: tuple[torch.Tensor, ...], pick: torch.Tensor | None, dsts: tuple[torch.Tensor, ...], index: torch.Tensor
) -> None:
    """The paged cache's row writes, in place: for each pair, dst[index[i]] = src[pick[i]] (pick None:
    src[i]) for every i. srcs [T, W] and dsts [N, W] pairwise of one dtype and width; index [K] rows of the
    dsts, pick [K] rows of the srcs (None: K = T). Indices must be in range; a dst row listed twice gets one
    of its writes (which one is not specified: the cache lists its trash row only so)."""
    index = index.long()  # (int32 indices too)
    for src, dst in zip(srcs, dsts, strict=True):
        dst.index_copy_(0, index, src if pick is None else src[pick.long()])


# ----------------------------------------------------------------------------- MoE
def router_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """[T, E] fp32 router scores of [T, E] logits: computed in the accumulation dtype (float64 under exact
    accumulation), rounded to fp32. sqrtsoftplus is sqrt(softplus(x)), softplus being x above 20 and
    log1p(exp(x)) elsewhere (torch's threshold)."""
    x = logits.to(acc_dtype())
    if score_func == "softmax":
        return x.softmax(-1).float()
    if score_func == "sigmoid":
        return x.sigmoid().float()
    if score_func != "sqrtsoftplus":
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    return F.softplus(x).sqrt().float()


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    score_func: str = "sqrtsoftplus",
    route_scale: float = 1.0,
    table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE router after its projection: logits [T, E] -> (weights [T, k] fp32, indices [T, k] int64,
    scores [T, E] fp32).

    scores: `router_scores`. indices: a hash layer's `table[token_ids]` (table [vocab, k]), else the k
    largest of scores + bias (bias [E] fp32 or None; it selects, it does not weigh), largest first (ties:
    torch.topk's order). weights: the picked scores in the accumulation dtype, divided by their sum (not for
    softmax) added left to right in `indices` order - a fixed order, so that a one-program kernel gives the
    same bits - times route_scale, rounded to fp32."""
    scores = router_scores(logits, score_func)
    if table is not None:
        indices = table[token_ids].long()
    else:
        biased = scores.detach() if bias is None else scores.detach() + bias
        indices = biased.topk(k, dim=-1).indices
    picked = scores.gather(1, indices).to(acc_dtype())
    if score_func != "softmax":
        total = picked[:, :1]
        for i in range(1, picked.size(1)):
            total = total + picked[:, i : i + 1]
        picked = picked / total
    return (picked * route_scale).float(), indices, scores


ACT_FORMATS = (None, "ue8m0", "fp32")


def act_pow2(act: str | None) -> bool:
    """The activation quantization of W8A8 by name: "ue8m0" = power-of-two scales, "fp32" = amax/448."""
    if act not in ACT_FORMATS or act is None:
        raise ValueError(f"activation quantization must be 'ue8m0' or 'fp32', got {act!r}")
    return act == "ue8m0"


def clamped_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    swiglu_limit: float,
    out_dtype: torch.dtype,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """An expert's activation: gate, up [..., I] (any float dtype) -> silu(min(gate, L)) * clamp(up, -L, L)
    [* weight [..., 1]] in fp32, rounded once to out_dtype [..., I]. L = swiglu_limit (<= 0: no clamp)."""
    gate = gate.float()
    up = up.float()
    if swiglu_limit > 0:
        up = up.clamp(-swiglu_limit, swiglu_limit)
        gate = gate.clamp(max=swiglu_limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = h * weight
    return h.to(out_dtype)


def swiglu_ffn(
    x: torch.Tensor,
    project: Callable[[torch.Tensor, int], torch.Tensor],
    swiglu_limit: float,
    weight: torch.Tensor | None,
) -> torch.Tensor:
    """Clamped SwiGLU around three projections: project(t, i) = t @ W_i^T in t's dtype (i = 1, 2, 3)."""
    return project(clamped_swiglu(project(x, 1), project(x, 3), swiglu_limit, x.dtype, weight), 2)


def expert_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu_limit: float,
    weight: torch.Tensor | None = None,
    quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Clamped SwiGLU: gate = w1 x, up = w3 x in fp32, clamp, silu(gate) * up (* routing weight), rounded to
    x's dtype, w2. gate and up are rounded to x's dtype first, except for fp16 x: then they leave their
    matmul in fp32 (`dsv4.ops.moe_shared.gate_dtype` says why). quant: applied to the input of every
    projection (W8A8: the FP8 round trip of the activations, after the routing weight and the rounding),
    None = the activations as they are."""
    ws = {1: w1, 2: w2, 3: w3}

    def project(t: torch.Tensor, i: int) -> torch.Tensor:
        t = t if quant is None else quant(t)
        if i != 2 and t.dtype == torch.float16:  # gate / up of fp16 inputs in fp32 (`fp16_gate_up`)
            return linear(t.float(), ws[i].float())
        return linear(t, ws[i])

    return swiglu_ffn(x, project, swiglu_limit, weight)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int = 0,
    act: str | None = None,
) -> torch.Tensor:
    """Routed experts: y[t] = sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) over the local experts.

    x [T, D]; weights [T, k] fp32; indices [T, k] global expert ids; w1, w3 [E, I, D], w2 [E, D, I] hold
    experts expert_offset .. expert_offset+E-1 (ids outside that range belong to other ranks and are
    skipped). act: None, or "ue8m0" / "fp32": W8A8, the input of every projection goes through
    `fp8_round_trip` in blocks of ACT_BLOCK with those scales (the weights hold dequantized FP8/FP4
    values). Returns [T, D] fp32.
    """
    quant = None
    if act is not None:
        quant = functools.partial(fp8_round_trip, block=ACT_BLOCK, pow2=act_pow2(act))

    def expert(e: int, xe: torch.Tensor, we: torch.Tensor) -> torch.Tensor:
        return expert_ffn(xe, w1[e], w2[e], w3[e], swiglu_limit, we, quant)

    return _sum_over_experts(x, weights, indices, w1.size(0), expert_offset, expert)


def _sum_over_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    n_experts: int,
    expert_offset: int,
    expert: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """fp32 [T, D]: for each local expert e, expert(e, its tokens' rows of x, their routing weights [n, 1])
    added into the rows of its tokens; ids outside [expert_offset, expert_offset + n_experts) are skipped."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = indices - expert_offset
    for e in range(n_experts):
        tok, slot = torch.where(local == e)
        if tok.numel() == 0:
            continue
        y = y.index_add(0, tok, expert(e, x[tok], weights[tok, slot].unsqueeze(-1)).float())
    return y


def quantized_moe_experts(
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
    """Routed experts on weights kept quantized, with W8A8 numerics (the official MoE on an FP8 / FP4
    checkpoint): the input of every projection is quantized by `act_quant` (blocks of ACT_BLOCK, act =
    "ue8m0" or "fp32" scales) and multiplied by `fp8_gemm` (fmt "fp8": w [E, O, I] E4M3 + s [E, ceil(O/128),
    ceil(I/128)]) or `fp4_gemm` (fmt "fp4": w [E, O, I/2] packed E2M1 + s [E, O, I/32] E8M0), each projection
    returned in x's dtype. Otherwise as `moe_experts`; returns [T, D] fp32. Not differentiable.
    """
    if fmt not in ("fp8", "fp4"):
        raise ValueError(f"quantized experts are 'fp8' or 'fp4', got {fmt!r}")
    gemm = fp8_gemm if fmt == "fp8" else fp4_gemm
    pow2 = act_pow2(act)

    def expert(e: int, xe: torch.Tensor, we: torch.Tensor) -> torch.Tensor:
        wq = {1: (w1[e], s1[e]), 2: (w2[e], s2[e]), 3: (w3[e], s3[e])}

        def project(t: torch.Tensor, i: int) -> torch.Tensor:
            q, s = act_quant(t, ACT_BLOCK, pow2)
            wide = i != 2 and t.dtype == torch.float16  # gate / up of fp16 inputs in fp32
            return gemm(q, s, *wq[i], torch.float32 if wide else t.dtype)

        return swiglu_ffn(xe, project, swiglu_limit, we)

    return _sum_over_experts(x, weights, indices, w1.size(0), expert_offset, expert)


def int8_moe_experts(
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
    """Routed experts with INT8 weights (per output row) and INT8 activations (per token): each token's
    input is quantized by `int8_quant`; gate = w1 x and up = w3 x by `int8_gemm` straight to fp32; the
    clamped SwiGLU times the routing weight in fp32; that result quantized per token again and multiplied
    by w2 (`int8_gemm`, fp32). w1, w3 [E, I, D] int8 with s1, s3 [E, I] fp32; w2 [E, D, I] int8 with s2
    [E, D] fp32; otherwise as `moe_experts` (ids outside [expert_offset, expert_offset + E) are skipped).
    Returns [T, D] fp32. Not differentiable.
    """

    def expert(e: int, xe: torch.Tensor, we: torch.Tensor) -> torch.Tensor:
        q, s = int8_quant(xe)
        gate = int8_gemm(q, s, w1[e], s1[e])  # fp32 [n, I]
        up = int8_gemm(q, s, w3[e], s3[e])
        if swiglu_limit > 0:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        h = F.silu(gate) * up * we  # fp32 [n, I]
        hq, hs = int8_quant(h)
        return int8_gemm(hq, hs, w2[e], s2[e])

    return _sum_over_experts(x, weights, indices, w1.size(0), expert_offset, expert)


# ----------------------------------------------------------------------------- sampling
from .reference_plan import (  # noqa: E402, F401  (the paged step's plan, in its own module)
    attend_rows,
    entry_slot,
    lookup_page,
    plan_entries,
    plan_groups,
    plan_keep,
    plan_window,
    select_rows,
    window_slot,
)
from .reference_sampling import (  # noqa: E402, F401  (the sampling references, in their own module)
    _GOLDEN,
    _MASK32,
    _MIX,
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    gumbel_argmax,
    gumbel_noise,
    read_carry,
    rejection_sample,
    row_keys,
    spec_advance,
    speculative_accept,
    temperature_distribution,
    token_logprobs,
    uniform,
    write_carry,
)


# ----------------------------------------------------------------------------- optimizer
def muon_momentum(
    buf: torch.Tensor, grad: torch.Tensor, momentum: float, nesterov: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Muon's momentum on one weight, `torch.optim.Muon`'s arithmetic: buf <- buf.lerp(grad, 1 - momentum) in
    place, then the update (nesterov: grad.lerp(buf, momentum); else buf) rounded to bf16 -> out (a new
    tensor when None): the input of Newton-Schulz. buf and grad: one shape and dtype; out: that shape, bf16."""
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    return update.bfloat16() if out is None else out.copy_(update)


def muon_apply(w: torch.Tensor, ortho: torch.Tensor, decay: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Muon's weight update, in place: w <- w * decay + ortho * scale, each product taken in fp32 and rounded
    to w's dtype, then their sum (torch.optim.Muon's arithmetic with its Python-float factors; decay = 1 - lr
    * weight_decay and scale = -lr * the adjusted rate are 0-dim fp32 tensors on w's device, so a captured
    step replays any learning rate, and are never rounded to a bf16 w's dtype first). Returns w."""
    kept = (w.float() * decay).to(w.dtype)
    step = (ortho.float() * scale).to(w.dtype)
    return w.copy_(kept.float() + step.float())
