"""`gumbel_argmax` (backend "triton"): a batch's token draw in two kernel launches instead of some thirty.

The reference draws each row with a chain of elementwise kernels over [B, V] float64 tensors (the counter
hash, two logarithms, the division by the temperature, the argmax, logsumexp): at batch 256 and a 129k
vocabulary that is about a millisecond of a 7 ms decode step. Here:

1. `_draw_split_kernel`, one program per (row, split of SPLIT columns): the same integer hash, the same
   float64 operations in the same order (libdevice `log`, which torch's CUDA kernels call too, and IEEE
   division), so every candidate value equals the reference's bit for bit on CUDA; it keeps the split's
   largest value with its lowest index (a NaN wins, as in torch.argmax) and an online logsumexp of the
   logits.
2. `_draw_combine_kernel`, one program per row: the splits in order (the first of equal maxima wins),
   and logsumexp from the splits' partial sums.

The token is therefore the reference's; the log-probability agrees to float64 rounding (its logsumexp
adds in another order) before both round it to float32. The splits are fixed columns, not a function of
the batch, so a row's numbers do not depend on which rows share its step.

`uniform` (backend "triton"): the counter-hash uniforms themselves, [B, n] float64, in one launch instead of
some forty integer kernels (speculative acceptance's tests). Integer arithmetic and a division by 2^32:
the reference's bits everywhere, the interpreter included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import register
from ..reference import _GOLDEN, _MASK32, _MIX, STREAM_SAMPLE
from ._common import Kernel, device_reason, interpret_mode

# columns per program of the first kernel (fixed: batch-invariant numbers). On an H200 (vocabulary 32,768,
# fp32 logits) 1,024 drew 64 rows in 34.7 us and 256 in 123.4 against 49.1 and 130.0 at 8,192
# (scripts/bench_step_kernels.py); 8 warps were no faster
SPLIT = 1024
BLOCK = 1024  # columns per loop iteration
MAX_SPLITS = 1024  # V up to 1M columns at SPLIT
NUM_WARPS = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # (float64: the speculative step's draws)


def _draw_split_kernel(
    logits_ptr,
    temp_ptr,
    greedy_ptr,
    seed_ptr,
    counter_ptr,
    val_ptr,
    idx_ptr,
    x_ptr,
    nan_ptr,
    m_ptr,
    s_ptr,
    V,
    stride_l,
    stride_t,
    stride_g,
    stride_seed,
    stride_c,
    n_splits,
    stream,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    MIX: tl.constexpr,
    MASK: tl.constexpr,
    GOLDEN: tl.constexpr,
    INTERP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    seed = tl.load(seed_ptr + row * stride_seed).to(tl.int64)
    counter = tl.load(counter_ptr + row * stride_c).to(tl.int64)
    temp = tl.load(temp_ptr + row * stride_t).to(tl.float64)
    greedy = tl.load(greedy_ptr + row * stride_g) != 0
    # the row key: hash(hash(hash(seed_lo ^ stream) ^ seed_hi) ^ counter_lo), int64 as in the reference
    key = (seed & MASK) ^ stream
    for i in tl.static_range(3):
        for _ in tl.static_range(2):
            key = ((key ^ (key >> 16)) * MIX) & MASK
        key = key ^ (key >> 16)
        if i == 0:
            key = key ^ ((seed >> 32) & MASK)
        if i == 1:
            key = key ^ (counter & MASK)
    NEG_INF: tl.constexpr = float("-inf")
    best_val = tl.full((), NEG_INF, tl.float64)
    best_idx = tl.full((), -1, tl.int64)
    best_x = tl.full((), 0.0, tl.float64)
    nan_idx = tl.full((), -1, tl.int64)
    m = tl.full((), NEG_INF, tl.float64)
    s = tl.full((), 0.0, tl.float64)
    lo = sp * SPLIT
    offs = tl.arange(0, BLOCK)
    for start in range(0, SPLIT, BLOCK):
        cols = (lo + start + offs).to(tl.int64)  # [BLOCK]
        inside = (cols < V) & (start + offs < SPLIT)
        x = tl.load(logits_ptr + row * stride_l + cols, mask=inside, other=NEG_INF).to(tl.float64)
        if greedy:  # (the whole program's row: no noise to compute, its two float64 logs per column skipped)
            val = x
        else:
            # the column's hash in uint32 arithmetic: products and sums wrap modulo 2^32, which is what the
            # reference's int64 operations masked to 32 bits keep (one instruction each instead of several)
            h = ((key + cols * GOLDEN) & MASK).to(tl.uint32)
            for _ in tl.static_range(2):
                h = (h ^ (h >> 16)) * MIX
            h = h ^ (h >> 16)
            u = (h.to(tl.float64) + 0.5) / 4294967296.0
            if INTERP:
                noise = -tl.log(-tl.log(u))
            else:  # torch's CUDA log of float64 is libdevice's
                noise = -libdevice.log(-libdevice.log(u))
            val = x / temp + noise
        val = tl.where(inside, val, NEG_INF)
        big = tl.full((BLOCK,), 2**62, tl.int64)
        is_nan = (val != val) & inside
        first_nan = tl.min(tl.where(is_nan, cols, big), axis=0)
        if (nan_idx < 0) & (first_nan < 2**62):
            nan_idx = first_nan
        clean = tl.where(is_nan, NEG_INF, val)
        vmax = tl.max(clean, axis=0)
        vidx = tl.min(tl.where(inside & (clean == vmax), cols, big), axis=0)
        if (best_idx < 0) | (vmax > best_val):
            best_val = vmax
            best_idx = vidx
            best_x = tl.sum(tl.where(cols == vidx, x, 0.0), axis=0)
        # online logsumexp of the logits (masked columns are -inf: they add nothing)
        bm = tl.max(tl.where(inside, x, NEG_INF), axis=0)
        m_new = tl.maximum(m, bm)
        if m_new > NEG_INF:  # (with a NaN logit the token is that NaN's and its log-probability NaN)
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(inside, tl.exp(x - m_new), 0.0), axis=0)
            m = m_new
    if nan_idx >= 0:
        best_idx = nan_idx
        best_x = tl.load(logits_ptr + row * stride_l + nan_idx).to(tl.float64)
    out = row * n_splits + sp
    tl.store(val_ptr + out, best_val)
    tl.store(idx_ptr + out, best_idx)
    tl.store(x_ptr + out, best_x)
    tl.store(nan_ptr + out, (nan_idx >= 0).to(tl.int32))
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)


def _draw_combine_kernel(
    val_ptr, idx_ptr, x_ptr, nan_ptr, m_ptr, s_ptr, tok_ptr, lp_ptr, n_splits, SPLITS: tl.constexpr
):
    row = tl.program_id(0)
    k = tl.arange(0, SPLITS)
    ok = k < n_splits
    at = row * n_splits + k
    NEG_INF: tl.constexpr = float("-inf")
    val = tl.load(val_ptr + at, mask=ok, other=NEG_INF)
    idx = tl.load(idx_ptr + at, mask=ok, other=2**62)
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    nan = tl.load(nan_ptr + at, mask=ok, other=0)
    m = tl.load(m_ptr + at, mask=ok, other=NEG_INF)
    s = tl.load(s_ptr + at, mask=ok, other=0.0)
    big = tl.full((SPLITS,), 2**62, tl.int64)
    first_nan = tl.min(tl.where(nan != 0, k, SPLITS), axis=0)
    vmax = tl.max(val, axis=0)
    # splits are in column order: the first split holding the maximum has its lowest index
    pick = tl.where(first_nan < SPLITS, first_nan, tl.min(tl.where(ok & (val == vmax), k, SPLITS), axis=0))
    tok = tl.min(tl.where(k == pick, idx, big), axis=0)
    xt = tl.sum(tl.where(k == pick, x, 0.0), axis=0)
    mm = tl.max(m, axis=0)
    lse = mm
    if mm > NEG_INF:
        lse = mm + tl.log(tl.sum(tl.where(ok, s * tl.exp(m - mm), 0.0), axis=0))
    tl.store(tok_ptr + row, tok)
    tl.store(lp_ptr + row, (xt - lse).to(tl.float32))


def _uniform_kernel(
    seed_ptr,
    counter_ptr,
    out_ptr,
    n,
    stride_seed,
    stride_c,
    stream,
    BLOCK: tl.constexpr,
    MIX: tl.constexpr,
    MASK: tl.constexpr,
    GOLDEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row * stride_seed).to(tl.int64)
    counter = tl.load(counter_ptr + row * stride_c).to(tl.int64)
    key = (seed & MASK) ^ stream  # the row key, as `_draw_split_kernel` computes it
    for i in tl.static_range(3):
        for _ in tl.static_range(2):
            key = ((key ^ (key >> 16)) * MIX) & MASK
        key = key ^ (key >> 16)
        if i == 0:
            key = key ^ ((seed >> 32) & MASK)
        if i == 1:
            key = key ^ (counter & MASK)
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    h = ((key + cols * GOLDEN) & MASK).to(tl.uint32)
    for _ in tl.static_range(2):
        h = (h ^ (h >> 16)) * MIX
    h = h ^ (h >> 16)
    tl.store(out_ptr + row * n + cols, (h.to(tl.float64) + 0.5) / 4294967296.0, mask=cols < n)


_split = Kernel(_draw_split_kernel)
_combine = Kernel(_draw_combine_kernel)
_uniform = Kernel(_uniform_kernel)
UNIFORM_BLOCK = 1024  # columns per program


def triton_gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    stream: int = STREAM_SAMPLE,
    split: int = SPLIT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference `gumbel_argmax`; `split` (columns per program) is for tests of the combining step
    at small vocabularies."""
    B, V = logits.shape
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    lp = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return tokens, lp
    block = min(BLOCK, triton.next_power_of_2(split))
    n = triton.cdiv(V, split)
    f64 = dict(dtype=torch.float64, device=dev)
    val, x, m, s = (torch.empty(B, n, **f64) for _ in range(4))
    idx = torch.empty(B, n, dtype=torch.int64, device=dev)
    nan = torch.empty(B, n, dtype=torch.int32, device=dev)
    g = greedy.view(torch.uint8) if greedy.dtype == torch.bool else greedy
    opts = {} if interpret_mode() else {"num_warps": NUM_WARPS}
    _split[(B, n)](
        logits,
        temperature,
        g,
        seeds,
        counters,
        val,
        idx,
        x,
        nan,
        m,
        s,
        V,
        logits.stride(0),
        temperature.stride(0),
        g.stride(0),
        seeds.stride(0),
        counters.stride(0),
        n,
        stream,
        SPLIT=split,
        BLOCK=block,
        MIX=_MIX,
        MASK=_MASK32,
        GOLDEN=_GOLDEN,
        INTERP=interpret_mode(),
        **opts,
    )
    _combine[(B,)](val, idx, x, nan, m, s, tokens, lp, n, SPLITS=max(2, triton.next_power_of_2(n)), **opts)
    return tokens, lp


def _can_run(
    logits, temperature, greedy, seeds, counters, stream: int = STREAM_SAMPLE, split: int = SPLIT
) -> str | None:
    reason = device_reason(logits, temperature, greedy, seeds, counters)
    if reason:
        return reason
    if logits.dim() != 2 or logits.stride(1) != 1:
        return f"logits {tuple(logits.shape)} must be a [B, V] matrix with contiguous rows"
    if logits.dtype not in DTYPES:
        return f"logits dtype {logits.dtype} (need fp32, bf16, fp16 or fp64)"
    B, V = logits.shape
    for name, t, dtypes in (
        ("temperature", temperature, (torch.float64,)),
        ("greedy", greedy, (torch.bool,)),
        ("seeds", seeds, (torch.int64,)),
        ("counters", counters, (torch.int64,)),
    ):
        if t.dim() != 1 or t.size(0) != B or t.dtype not in dtypes:
            return f"{name} must be [{B}] {dtypes[0]}, got {tuple(t.shape)} {t.dtype}"
    if V < 1 or triton.cdiv(V, split) > MAX_SPLITS:
        return f"vocabulary of {V} (need 1..{MAX_SPLITS * split})"
    return None


register("gumbel_argmax", "triton", triton_gumbel_argmax, can_run=_can_run, deterministic=True, priority=10)


def triton_uniform(seed: torch.Tensor, counter: torch.Tensor, n: int, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """As the reference `uniform`: [B, n] float64 uniforms in (0, 1) of (seed [B], counter [B], column, stream)."""
    B = seed.size(0)
    out = torch.empty(B, n, dtype=torch.float64, device=seed.device)
    if B == 0 or n == 0:
        return out
    block = min(UNIFORM_BLOCK, triton.next_power_of_2(n))
    opts = {} if interpret_mode() else {"num_warps": 1 if block <= 128 else 4}
    _uniform[(B, triton.cdiv(n, block))](
        seed,
        counter,
        out,
        n,
        seed.stride(0),
        counter.stride(0),
        stream,
        BLOCK=block,
        MIX=_MIX,
        MASK=_MASK32,
        GOLDEN=_GOLDEN,
        **opts,
    )
    return out


def _can_run_uniform(seed, counter, n, stream: int = STREAM_SAMPLE) -> str | None:
    reason = device_reason(seed, counter)
    if reason:
        return reason
    for name, t in (("seed", seed), ("counter", counter)):
        if t.dim() != 1 or t.dtype != torch.int64:
            return f"{name} must be a 1-d int64 tensor, got {tuple(t.shape)} {t.dtype}"
    if counter.size(0) != seed.size(0):
        return f"seed [{seed.size(0)}] and counter [{counter.size(0)}] must have one entry per row"
    if not 0 <= int(stream) < 2**32 or int(n) < 0:
        return f"stream {stream} must be in [0, 2^32) and n {n} >= 0"
    return None


register("uniform", "triton", triton_uniform, can_run=_can_run_uniform, deterministic=True, priority=10)

__all__ = ["triton_gumbel_argmax", "triton_uniform"]
