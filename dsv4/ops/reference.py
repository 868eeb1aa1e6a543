"""Plain-torch references: the definition of every DeepSeek-V4 primitive.

Written for clarity, not speed. Every function here is differentiable where the model trains through it
(the quantization round trips use a straight-through gradient). Fast backends are tested against these.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .precision import acc_dtype

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
# E2M1 magnitudes by code 0..7 (codes 8..15 are the negatives)
FP4_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------- quantization round trips
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0): the UE8M0 scale rounding."""
    return torch.exp2(torch.ceil(torch.log2(x)))


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized value. Backward: the identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float8_e4m3fn).float()


@functools.cache   # constants a captured CUDA graph may hold: never evicted
def _e2m1_grid(device: str) -> torch.Tensor:
    return torch.tensor(FP4_E2M1_GRID, dtype=torch.float32, device=device)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the nearest E2M1 value, ties to the even code."""
    grid = _e2m1_grid(str(v.device))
    a = v.abs().unsqueeze(-1)                                   # [..., 1]
    dist = (a - grid).abs()                                     # [..., 8]
    tied = dist == dist.amin(-1, keepdim=True)
    odd = torch.arange(8, device=v.device) % 2                  # prefer even codes on ties
    code = torch.where(tied, odd, 2).argmin(-1)                 # [...]
    return torch.copysign(grid[code], v)


def fp8_round_trip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """FP8 E4M3 quantize -> dequantize along the last dim in blocks, power-of-two (UE8M0) scales.

    Simulates the FP8 storage the model was trained with (QAT). Gradient: straight-through.
    """
    n = x.size(-1)
    if n % block:
        raise ValueError(f"fp8_round_trip: last dim {n} is not a multiple of block {block}")
    xb = x.detach().float().unflatten(-1, (n // block, block))         # [..., nb, block]
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = pow2_ceil(amax / FP8_E4M3_MAX)
    q = _round_to_e4m3((xb / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)) * scale
    return _StraightThrough.apply(x, q.flatten(-2).to(x.dtype))


def fp4_round_trip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4 (E2M1) quantize -> dequantize along the last dim in blocks, power-of-two scales.

    Used by the Lightning Indexer's QAT simulation. Gradient: straight-through.
    """
    n = x.size(-1)
    if n % block:
        raise ValueError(f"fp4_round_trip: last dim {n} is not a multiple of block {block}")
    xb = x.detach().float().unflatten(-1, (n // block, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_E2M1_MAX * 2.0**-126)
    scale = pow2_ceil(amax / FP4_E2M1_MAX)
    q = round_to_e2m1((xb / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)) * scale
    return _StraightThrough.apply(x, q.flatten(-2).to(x.dtype))


@functools.cache   # constants a captured CUDA graph may hold: never evicted
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


# ----------------------------------------------------------------------------- fp32 projections
def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` in fp32 (router, compressor and head projections, kept in fp32 by the spec).

    x [..., K] any float dtype, weight [N, K] fp32 -> [..., N] fp32. Differentiable in both.
    """
    return F.linear(x.float(), weight.float())


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


def rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
              ) -> torch.Tensor:
    """Rotary embedding of the last `r = 2 * inv_freq.numel()` dims of x, the first `d - r` unchanged.

    x [b, s, d] or [b, s, h, d]; positions [s] integer (or [1] for every row: decode, s == 1); inv_freq
    [r/2] fp32. Interleaved pairs: x0 = even, x1 = odd dims of the tail, angle = position * inv_freq:
    `y0 = x0 cos - x1 sin`, `y1 = x0 sin + x1 cos` in fp32 (`inverse`: sin negated, the inverse rotation),
    cast to x's dtype. Differentiable in x (the gradient is the inverse rotation; the rest passes through).
    """
    r = 2 * inv_freq.numel()
    nope, pe = x[..., :-r], x[..., -r:]
    angles = torch.outer(positions.float(), inv_freq)                       # [s, r/2]
    cos, sin = angles.cos(), angles.sin()
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                        # [s, 1, r/2]
    if inverse:
        sin = -sin
    pf = pe.float()
    x0, x1 = pf[..., 0::2], pf[..., 1::2]
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([nope, y.to(x.dtype)], dim=-1)


# ----------------------------------------------------------------------------- sparse attention
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over index-gathered keys with a per-head sink.

    q [b, s, h, d]; kv [b, n, d] (one shared head, used as key and value); sink [h] (fp32);
    idx [b, s, k] int (positions into kv, -1 = no key). Returns (o [b, s, h, d] in q.dtype,
    lse [b, s, h] fp32), where lse = log(sum_j exp(score_j) + exp(sink_h)) over valid keys: the sink
    joins the denominator only. A query with no valid key gets o = 0, lse = sink. lse is returned
    detached: it is not differentiable (backward through it is undefined by contract).
    """
    b, s, h, d = q.shape
    valid = idx >= 0                                                      # [b, s, k]
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    acc = acc_dtype()
    # cast before the gather: its backward then accumulates dkv in fp32, not in kv's dtype
    kv_sel = kv.to(acc)[batch, idx.clamp_min(0).long()]                   # [b, s, k, d]
    scores = torch.einsum("bshd,bskd->bshk", q.to(acc), kv_sel) * scale   # [b, s, h, k]
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink_col = sink.to(acc).view(1, 1, h, 1).expand(b, s, h, 1)
    lse = torch.logsumexp(torch.cat([scores, sink_col], -1), -1)          # [b, s, h]
    p = torch.exp(scores - lse.unsqueeze(-1))                              # [b, s, h, k]
    o = torch.einsum("bshk,bskd->bshd", p, kv_sel)
    return o.to(q.dtype), lse.float().detach()


# ----------------------------------------------------------------------------- lightning indexer
def compressed_visible(positions: torch.Tensor, n: int, ratio: int) -> torch.Tensor:
    """[s, n] (positions [s]) or [b, s, n] (positions [b, s]) bool: compressed entry j is visible to the
    query at position t iff j < (t+1) // ratio (a position of -1 sees nothing)."""
    j = torch.arange(n, device=positions.device)
    return j < torch.div(positions + 1, ratio, rounding_mode="floor").unsqueeze(-1)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                   ratio: int) -> torch.Tensor:
    """Lightning Indexer scores: `score[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])`.

    q [b, s, h, d]; k [b, n, d]; weights [b, s, h]; positions [s] (shared by the rows) or [b, s] absolute
    query positions. Returns [b, s, n] fp32 with invisible entries (j >= (t+1)//ratio) set to -inf.
    """
    acc = acc_dtype()
    dots = torch.einsum("bshd,bnd->bshn", q.to(acc), k.to(acc)).relu()    # [b, s, h, n]
    score = (dots * weights.to(acc).unsqueeze(-1)).sum(2).float()          # [b, s, n]
    vis = compressed_visible(positions, k.size(1), ratio)                  # [s, n]
    return score.masked_fill(~vis, float("-inf"))


def select_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, ties broken towards the lower index;
    entries with score -inf (invisible) become -1. Deterministic: ReLU scores tie at 0 often."""
    k = min(k, score.size(-1))
    values, order = score.sort(dim=-1, descending=True, stable=True)
    return torch.where(torch.isfinite(values[..., :k]), order[..., :k], -1)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                 ratio: int, topk: int) -> torch.Tensor:
    """Top-`min(topk, n)` visible compressed entries per query by indexer score (ties: lower index
    first); -1 pads the rest. Returns [b, s, min(topk, n)] int64."""
    return select_topk(indexer_scores(q, k, weights, positions, ratio), topk)


# ----------------------------------------------------------------------------- mHC
def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                      iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre.to(out_dtype), post.to(out_dtype), comb.to(out_dtype)


def _hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_dtype()
    xf = x.flatten(-2).to(acc)                                             # [b, s, hc*d]
    rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    with torch.autocast(device_type=x.device.type, enabled=False):
        mixes = F.linear(xf, fn.to(acc)) * rsqrt                           # [b, s, mix]
    return xf, mixes.float()


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a sublayer: x [b, s, hc, d] -> (sublayer input [b, s, d], post [b, s, hc], comb)."""
    hc = x.size(-2)
    _, mixes = _hc_mixes(x, fn, norm_eps)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)                            # [b, s, d]
    return y.to(x.dtype), post, comb


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a sublayer: copy j = post_j * f + sum_i comb[i, j] * residual_i.

    f [b, s, d]; residual [b, s, hc, d]; post [b, s, hc]; comb [b, s, hc, hc]. Returns [b, s, hc, d].
    """
    acc = acc_dtype()
    mixed = torch.einsum("bsij,bsid->bsjd", comb.to(acc), residual.to(acc))
    y = post.to(acc).unsqueeze(-1) * f.to(acc).unsqueeze(-2) + mixed
    return y.to(f.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """Final mHC reduce (no Sinkhorn): x [b, s, hc, d] -> [b, s, d]."""
    _, mixes = _hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mixes * scale + base) + hc_eps                     # [b, s, hc]
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


# ----------------------------------------------------------------------------- compressor
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Gated pooling of one compression group: per-channel softmax of score over the slots.

    kv, score [..., slots, c] (fp32; -inf scores mark empty slots) -> [..., c].
    """
    acc = acc_dtype()
    return (kv.to(acc) * score.to(acc).softmax(-2)).sum(-2).to(kv.dtype)


# ----------------------------------------------------------------------------- MoE
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in x's dtype (accumulated in float64 under exact accumulation)."""
    if acc_dtype() == torch.float64:
        return F.linear(x.double(), w.double()).to(x.dtype)
    return F.linear(x, w)


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, swiglu_limit: float,
               weight: torch.Tensor | None = None) -> torch.Tensor:
    """Clamped SwiGLU: gate = w1 x, up = w3 x in fp32, clamp, silu(gate) * up (* routing weight), w2."""
    gate = linear(x, w1).float()
    up = linear(x, w3).float()
    if swiglu_limit > 0:
        up = up.clamp(-swiglu_limit, swiglu_limit)
        gate = gate.clamp(max=swiglu_limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = h * weight
    return linear(h.to(x.dtype), w2)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, w3: torch.Tensor, swiglu_limit: float, expert_offset: int = 0) -> torch.Tensor:
    """Routed experts: y[t] = sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) over the local experts.

    x [T, D]; weights [T, k] fp32; indices [T, k] global expert ids; w1, w3 [E, I, D], w2 [E, D, I] hold
    experts expert_offset .. expert_offset+E-1 (ids outside that range belong to other ranks and are
    skipped). Returns [T, D] fp32.
    """
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = indices - expert_offset
    for e in range(w1.size(0)):
        tok, slot = torch.where(local == e)
        if tok.numel() == 0:
            continue
        out = expert_ffn(x[tok], w1[e], w2[e], w3[e], swiglu_limit, weights[tok, slot].unsqueeze(-1))
        y = y.index_add(0, tok, out.float())
    return y

