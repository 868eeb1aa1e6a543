"""Fused manifold-constrained hyper-connections (`hc_pre`, `hc_post`, `hc_head` backends "triton").

`hc_pre`: one program per block of BT tokens reads the token's hc residual copies once for the mix
projection (fp32-exact: the fp32 `fn` is split into three bf16 parts, each multiplied on tensor cores with
fp32 accumulation, and x is bf16 already; `mhc_fn` makes the parts, once for a serving model), applies
the RMS scale, the sigmoids and the 20 Sinkhorn iterations in registers, then re-reads its own tile
(L2-resident by then) for the weighted reduce.
With few row tiles (decode: one token per sequence) that leaves most SMs idle behind a serial K = hc * D
loop, so K is split instead: one program per (row tile, K slice) writes fp32 partial mixes and sums of
squares to a workspace, and a second kernel adds them in slice order (deterministic, no atomics) and runs
the same epilogue (`_hc_pre_epilogue`), its programs sharing out the columns of the weighted reduce.
`hc_post`: one pass over the residual copies, forward and backward (the backward also reduces the
gradients of post and comb per token, in registers, in a fixed order).

`hc_head` (the last block's reduce of the copies, no Sinkhorn) runs `hc_pre`'s kernels with HEAD set, forward
and backward. The `hc_pre` backward differentiates the Sinkhorn map per token in one kernel (replaying it once from the
saved mixes, [T, 24] numbers, its iterates kept in a scratch buffer and walked back); g_pre before it
and the projection gradients after it each take one pass over x (`mhc_bwd`; the projection's products run
on tensor cores over exact bf16 parts of their fp32 operands, as the forward's), the [T, 24]-sized steps
between them are torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import register
from ..precision import is_exact
from ._common import num_sms
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import device_reason, mma, round_to
from ._mm_utils import launch as _launch
from .mhc_bwd import GPRE_BD as _GPRE_BD
from .mhc_bwd import _hc_post_bwd_kernel, _hc_pre_gpre_kernel, _hc_split_bwd_kernel
from .mhc_bwd import head_grads as _head_grads
from .mhc_bwd import projection_grads as _projection_grads
from .mhc_fn import pp_width, split_fn


@triton.jit
def _hc_pre_mix(
    x_ptr,
    fpp_ptr,
    fcb_ptr,
    ts64,
    tmask,
    K,
    k_lo,
    k_hi,
    HC: tl.constexpr,
    P1: tl.constexpr,
    HEAD: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Raw mixes and sum of squares of rows `ts` over the reduction slice [k_lo, k_hi) of K = hc * D."""
    P2: tl.constexpr = HC * HC
    c1 = tl.arange(0, P1)
    c2 = tl.arange(0, P2)
    acc_pp = tl.zeros((BT, P1), dtype=tl.float32)  # pre | post mixes (zero-padded columns)
    acc_cb = tl.zeros((BT, P2), dtype=tl.float32)  # comb mixes, row-major hc x hc
    ss = tl.zeros((BT,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < k_hi
        xk = tl.load(x_ptr + ts64[:, None] * K + ks[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        xf = xk.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        # the weight parts are bf16, and an MMA takes one dtype: an fp16 x is the sum of two bf16 parts
        # (11 significant bits; its range lies inside bf16's), exactly
        SPLIT: tl.constexpr = xk.dtype == tl.float16
        xh = xf.to(tl.bfloat16) if SPLIT else xk
        xl = (xf - xh.to(tl.float32)).to(tl.bfloat16) if SPLIT else xk
        for part in tl.static_range(3):  # fn = hi + mid + lo, each exactly bf16
            w = tl.load(fpp_ptr + part * K * P1 + ks[:, None] * P1 + c1[None, :], mask=kmask[:, None], other=0.0)
            acc_pp = _mma_parts(xh, xl, w, acc_pp, SPLIT, UPCAST)
            if not HEAD:
                w2 = tl.load(fcb_ptr + part * K * P2 + ks[:, None] * P2 + c2[None, :], mask=kmask[:, None], other=0.0)
                acc_cb = _mma_parts(xh, xl, w2, acc_cb, SPLIT, UPCAST)
    return acc_pp, acc_cb, ss


@triton.jit
def _mma_parts(xh, xl, w, acc, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x @ w for x = xh (+ xl where SPLIT: an fp16 x as two bf16 parts)."""
    acc = mma(xh, w, acc, UPCAST)
    if SPLIT:
        acc = mma(xl, w, acc, UPCAST)
    return acc


@triton.jit
def _hc_pre_epilogue(
    acc_pp,
    acc_cb,
    ss,
    x_ptr,
    scale_ptr,
    base_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    mix_ptr,
    rs_ptr,
    ts64,
    tmask,
    smask,
    D,
    d_lo,
    d_hi,
    norm_eps,
    hc_eps,
    ITERS: tl.constexpr,
    HC: tl.constexpr,
    P1: tl.constexpr,
    HEAD: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Everything after the projection, from the full raw mixes and sum of squares of rows `ts`.

    RMS scale, sigmoids, Sinkhorn; post/comb/mix/rs are stored where `smask` (and computed only where some
    row stores them; with HEAD, mix [T, HC] and rs only); y is reduced over the columns [d_lo, d_hi) only
    (the split path spreads the columns of y over several programs).
    """
    K = HC * D
    P2: tl.constexpr = HC * HC
    c1 = tl.arange(0, P1)
    c2 = tl.arange(0, P2)
    r = 1.0 / tl.sqrt(ss / K + norm_eps)  # [BT]
    mpp = acc_pp * r[:, None]
    hcs = tl.arange(0, HC)
    pp3 = tl.reshape(mpp, (BT, P1 // HC, HC))
    which = tl.arange(0, P1 // HC)[None, :, None]
    pre_m = tl.sum(tl.where(which == 0, pp3, 0.0), axis=1)  # [BT, HC]
    pre = tl.sigmoid(pre_m * tl.load(scale_ptr) + tl.load(base_ptr + hcs)[None, :]) + hc_eps
    if HEAD:  # what the head's backward starts from: its HC mixes and the RMS scale
        if tl.max(smask.to(tl.int32), axis=0) > 0:
            tl.store(rs_ptr + ts64, r, mask=smask)
            tl.store(mix_ptr + ts64[:, None] * HC + hcs[None, :], pre_m, mask=smask[:, None])
    else:
        if tl.max(smask.to(tl.int32), axis=0) > 0:  # (a program that stores no row's mixes skips them)
            mcb = acc_cb * r[:, None]
            n_mix = (2 + HC) * HC
            tl.store(rs_ptr + ts64, r, mask=smask)
            tl.store(mix_ptr + ts64[:, None] * n_mix + c1[None, :], mpp, mask=smask[:, None] & (c1[None, :] < 2 * HC))
            tl.store(mix_ptr + ts64[:, None] * n_mix + 2 * HC + c2[None, :], mcb, mask=smask[:, None])
            post_m = tl.sum(tl.where(which == 1, pp3, 0.0), axis=1)
            post = 2.0 * tl.sigmoid(post_m * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + hcs)[None, :])
            tl.store(post_ptr + ts64[:, None] * HC + hcs[None, :], post, mask=smask[:, None])
            # Sinkhorn on [BT, hc, hc]: row softmax (+eps), column normalisation, then ITERS-1 (row, column)
            c = tl.reshape(mcb * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + c2)[None, :], (BT, HC, HC))
            c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
            c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
            c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
            for _ in range(ITERS - 1):
                c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
                c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
            tl.store(comb_ptr + ts64[:, None] * P2 + c2[None, :], tl.reshape(c, (BT, P2)), mask=smask[:, None])
    # weighted reduce of the copies (the tile was read for the projection: still in L2)
    for d0 in range(d_lo, d_hi, BD):
        ds = d0 + tl.arange(0, BD)
        dmask = ds < d_hi
        m3 = tmask[:, None, None] & dmask[None, None, :]
        x3 = tl.load(
            x_ptr + ts64[:, None, None] * K + hcs[None, :, None] * D + ds[None, None, :], mask=m3, other=0.0
        ).to(tl.float32)  # [BT, HC, BD]
        y = tl.sum(pre[:, :, None] * x3, axis=1)
        tl.store(
            y_ptr + ts64[:, None] * D + ds[None, :],
            round_to(y, y_ptr.dtype.element_ty, UPCAST),
            mask=tmask[:, None] & dmask[None, :],
        )


@triton.jit
def _hc_pre_fwd_kernel(
    x_ptr,
    fpp_ptr,
    fcb_ptr,
    scale_ptr,
    base_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    mix_ptr,
    rs_ptr,
    T,
    D,
    norm_eps,
    hc_eps,
    ITERS: tl.constexpr,
    HC: tl.constexpr,
    P1: tl.constexpr,
    HEAD: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per BT tokens: the whole K reduction, then the epilogue."""
    pid = tl.program_id(0)
    ts = pid * BT + tl.arange(0, BT)
    tmask = ts < T
    ts64 = ts.to(tl.int64)
    acc_pp, acc_cb, ss = _hc_pre_mix(
        x_ptr, fpp_ptr, fcb_ptr, ts64, tmask, HC * D, 0, HC * D, HC, P1, HEAD, BT, BK, UPCAST
    )
    _hc_pre_epilogue(
        acc_pp,
        acc_cb,
        ss,
        x_ptr,
        scale_ptr,
        base_ptr,
        y_ptr,
        post_ptr,
        comb_ptr,
        mix_ptr,
        rs_ptr,
        ts64,
        tmask,
        tmask,
        D,
        0,
        D,
        norm_eps,
        hc_eps,
        ITERS,
        HC,
        P1,
        HEAD,
        BT,
        BD,
        UPCAST,
    )


@triton.jit
def _hc_pre_part_kernel(
    x_ptr,
    fpp_ptr,
    fcb_ptr,
    wpp_ptr,
    wcb_ptr,
    wss_ptr,
    T,
    D,
    KS,
    HC: tl.constexpr,
    P1: tl.constexpr,
    HEAD: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Split K, step 1: program (i, s) reduces K slice s of row tile i into fp32 partials [SPLIT, T, ..]."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    ts = pid_t * BT + tl.arange(0, BT)
    tmask = ts < T
    ts64 = ts.to(tl.int64)
    K = HC * D
    k_lo = pid_s * KS
    k_hi = tl.minimum(k_lo + KS, K)
    acc_pp, acc_cb, ss = _hc_pre_mix(x_ptr, fpp_ptr, fcb_ptr, ts64, tmask, K, k_lo, k_hi, HC, P1, HEAD, BT, BK, UPCAST)
    P2: tl.constexpr = HC * HC
    row = pid_s.to(tl.int64) * T + ts64  # [BT]
    tl.store(wpp_ptr + row[:, None] * P1 + tl.arange(0, P1)[None, :], acc_pp, mask=tmask[:, None])
    if not HEAD:
        tl.store(wcb_ptr + row[:, None] * P2 + tl.arange(0, P2)[None, :], acc_cb, mask=tmask[:, None])
    tl.store(wss_ptr + row, ss, mask=tmask)


@triton.jit
def _hc_pre_finish_kernel(
    wpp_ptr,
    wcb_ptr,
    wss_ptr,
    x_ptr,
    scale_ptr,
    base_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    mix_ptr,
    rs_ptr,
    T,
    D,
    DS,
    norm_eps,
    hc_eps,
    SPLIT: tl.constexpr,
    ITERS: tl.constexpr,
    HC: tl.constexpr,
    P1: tl.constexpr,
    HEAD: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Split K, step 2: each program sums the partials of row tile i in slice order (fixed: deterministic).
    Without HEAD, program (i, 0) runs the rest of the epilogue (RMS scale, post, Sinkhorn) and stores it,
    and programs (i, j >= 1) reduce the columns [(j - 1) * DS, j * DS) of y from the pre weights alone, so
    the Sinkhorn iterations run beside the weighted reduce instead of before it (the same arithmetic as
    one program doing both: every program sums the same partials in the same order). With HEAD (no comb
    mixes) program (i, j) reduces the columns [j * DS, (j + 1) * DS), and (i, 0) also stores the mixes."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    ts = pid_t * BT + tl.arange(0, BT)
    tmask = ts < T
    ts64 = ts.to(tl.int64)
    P2: tl.constexpr = HC * HC
    c1 = tl.arange(0, P1)
    c2 = tl.arange(0, P2)
    acc_pp = tl.zeros((BT, P1), dtype=tl.float32)
    acc_cb = tl.zeros((BT, P2), dtype=tl.float32)
    ss = tl.zeros((BT,), dtype=tl.float32)
    mixes = pid_d < 1 - HEAD  # this program: the mixes and Sinkhorn (stored), no y columns
    # (with HEAD: the first y program stores the head's mixes and rs; a scalar condition joins a mask through
    # tl.where, not &: Triton 3.9's interpreter gives a splatted scalar comparison int32 values, no mask)
    stores = tl.where(pid_d == 0, tmask, False)
    for s in tl.static_range(SPLIT):  # unrolled: every partial's load issued up front
        row = s * T + ts64  # [BT]
        acc_pp += tl.load(wpp_ptr + row[:, None] * P1 + c1[None, :], mask=tmask[:, None], other=0.0)
        if not HEAD:
            acc_cb += tl.load(
                wcb_ptr + row[:, None] * P2 + c2[None, :], mask=tl.where(mixes, tmask[:, None], False), other=0.0
            )
        ss += tl.load(wss_ptr + row, mask=tmask, other=0.0)
    d_lo = (pid_d - 1 + HEAD) * DS  # (a y program's columns)
    d_hi = tl.where(mixes, d_lo, tl.minimum(d_lo + DS, D))  # (the mixes program reduces none)
    _hc_pre_epilogue(
        acc_pp,
        acc_cb,
        ss,
        x_ptr,
        scale_ptr,
        base_ptr,
        y_ptr,
        post_ptr,
        comb_ptr,
        mix_ptr,
        rs_ptr,
        ts64,
        tmask,
        stores,
        D,
        d_lo,
        d_hi,
        norm_eps,
        hc_eps,
        ITERS,
        HC,
        P1,
        HEAD,
        BT,
        BD,
        UPCAST,
    )


@triton.jit
def _hc_post_fwd_kernel(
    f_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    T,
    D,
    HC: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[t, j] = post[t, j] * f[t] + sum_i comb[t, i, j] * res[t, i]."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    ts = pid_t * BT + tl.arange(0, BT)
    tmask = ts < T
    ts64 = ts.to(tl.int64)
    hcs = tl.arange(0, HC)
    ds = pid_d * BD + tl.arange(0, BD)
    dmask = ds < D
    m2 = tmask[:, None] & dmask[None, :]
    post = tl.load(post_ptr + ts64[:, None] * HC + hcs[None, :], mask=tmask[:, None], other=0.0)  # [BT, HC]
    f = tl.load(f_ptr + ts64[:, None] * D + ds[None, :], mask=m2, other=0.0).to(tl.float32)
    out = post[:, :, None] * f[:, None, :]  # [BT, HC, BD]
    for i in tl.static_range(HC):
        ci = tl.load(
            comb_ptr + ts64[:, None] * HC * HC + i * HC + hcs[None, :], mask=tmask[:, None], other=0.0
        )  # [BT, HC]
        ri = tl.load(res_ptr + ts64[:, None] * HC * D + i * D + ds[None, :], mask=m2, other=0.0).to(
            tl.float32
        )  # [BT, BD]
        out += ci[:, :, None] * ri[:, None, :]
    o_ptrs = out_ptr + ts64[:, None, None] * HC * D + hcs[None, :, None] * D + ds[None, None, :]
    tl.store(o_ptrs, round_to(out, out_ptr.dtype.element_ty, UPCAST), mask=m2[:, None, :])


_PRE_CONFIGS = [
    triton.Config({"BT": bt, "BK": bk, "BD": bd}, num_warps=w)
    for bt, bk, bd, w in ((16, 128, 128, 4), (32, 128, 256, 4), (32, 256, 256, 8), (64, 128, 256, 8))
]
_POST_CONFIGS = [
    triton.Config({"BT": bt, "BD": bd}, num_warps=w)
    for bt, bd, w in ((2, 256, 4), (4, 256, 4), (8, 128, 4), (4, 512, 8), (8, 256, 8), (16, 128, 8), (1, 1024, 8))
]
_POST_BWD_CONFIGS = [
    triton.Config({"BT": bt, "BD": bd}, num_warps=w)
    for bt, bd, w in (
        (2, 128, 4),
        (4, 128, 4),
        (2, 256, 4),
        (8, 64, 4),
        (4, 256, 8),
        (8, 128, 8),
        (16, 64, 4),
        (1, 512, 4),
    )
]
_pre_tuned = triton.autotune(_PRE_CONFIGS, key=["D", "HC", "HEAD"])(_hc_pre_fwd_kernel)
_post_tuned = triton.autotune(_POST_CONFIGS, key=["D", "HC"])(_hc_post_fwd_kernel)
_post_bwd_tuned = triton.autotune(_POST_BWD_CONFIGS, key=["D", "HC"])(_hc_post_bwd_kernel)


def _rows_grid(t: int):
    return lambda meta: (triton.cdiv(t, meta["BT"]),)


# ----------------------------------------------------------------------------- launchers
# Split K (small T): below this many row tiles per SM the single kernel leaves most SMs idle while each
# program runs the whole K = hc * D reduction serially (decode: 1 token per sequence).
SPLIT_K: int | None = None  # None: automatic; 0 or 1: never split; n > 1: force about n K slices
# rows per program of the partial kernel: 64 read each K slice of the (3-part) weight a quarter as often as
# 16 (H200, dim 1024, hc 4: 21.6 vs 42.4 us at 1,341 tokens, 13.3 vs 17.0 at 257; scripts/bench_step_kernels.py)
_SPLIT_BT, _SPLIT_BK, _SPLIT_WARPS = 64, 32 if _INTERPRET else 128, 4
_MAX_SPLIT = 32  # K slices at most (the finishing kernel unrolls its sum over them)
# Under exact accumulation (`dsv4.ops.precision`: the engine's deterministic mode) every call splits K into
# this many slices: the automatic plan depends on the number of tokens, so a row's mix would round
# differently alone and in a batch. 8 keeps decode near its split speed; calls of 4k tokens and more take
# about 1.6x the single kernel (H200, `scripts/bench_hc_split.py`).
EXACT_SPLIT = 8
_FINISH_BD = 32 if _INTERPRET else 128
_SMS: dict[torch.device, int] = {}


def _sm_count(dev: torch.device) -> int:
    if dev not in _SMS:
        _SMS[dev] = num_sms(dev)
    return _SMS[dev]


def _split_plan(t: int, k: int, dev: torch.device) -> tuple[int, int]:
    """(number of K slices, slice length in elements): (1, k) keeps the single-kernel path."""
    rows = triton.cdiv(t, _SPLIT_BT)  # the partial kernel's row tiles
    if rows == 0:
        return 1, k
    if SPLIT_K is not None:
        want = SPLIT_K
    elif is_exact():  # deterministic mode: a plan that t does not change, so each row's sums run in one
        want = EXACT_SPLIT  # order whatever else is in the batch (a request's numbers alone = in a batch)
    else:
        sms = _sm_count(dev)
        if rows > sms:  # past one wave of the partial kernel's row tiles: the single kernel
            return 1, k
        # under half a wave: about one wave of programs; from half a wave to one, 4-8 slices. The single
        # kernel is latency-bound: one program walks all of K (about 61 us at every T from 256 to 2,176
        # tokens, 64 at 4,096; dim 1024, hc 4, H200), where 3-6 slices took 27.5-28.4 us at 2,176 tokens
        # and 2-4 slices 45 us at 4,096 (scripts/bench_hc_split.py)
        want = sms // rows if 2 * rows < sms else min(8, 4 * sms // rows)
    steps = triton.cdiv(k, _SPLIT_BK)
    want = max(1, min(want, steps, _MAX_SPLIT))
    if want == 1:
        return 1, k
    ks = triton.cdiv(steps, want) * _SPLIT_BK
    return triton.cdiv(k, ks), ks


def finish_grid(t: int, d: int, head: bool, dev: torch.device) -> tuple[tuple[int, int], int, int]:
    """The finishing kernel's grid, rows per program and y columns per program: about one wave of programs
    over row tiles x column slices of y, plus (without head) one program per row tile for the mixes."""
    bt = min(16, max(4, triton.next_power_of_2(t)))
    rows = triton.cdiv(t, bt)
    n_d = max(1, min(_sm_count(dev) // rows, triton.cdiv(d, _FINISH_BD)))
    ds = triton.cdiv(triton.cdiv(d, _FINISH_BD), n_d) * _FINISH_BD
    return (rows, triton.cdiv(d, ds) + (0 if head else 1)), bt, ds


def _launch_pre(
    x: torch.Tensor,
    parts: tuple[torch.Tensor, torch.Tensor],
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
    head: bool,
):
    b, s, hc, d = x.shape
    t = b * s
    x = x.contiguous()
    fpp, fcb = parts  # fn's bf16 parts (`mhc_fn.split_fn`)
    y = torch.empty(b, s, d, dtype=x.dtype, device=x.device)
    dev = x.device
    post = torch.empty(b, s, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(b, s, hc, hc, dtype=torch.float32, device=dev)
    mix = torch.empty(t, hc if head else (2 + hc) * hc, dtype=torch.float32, device=dev)
    rs = torch.empty(t, dtype=torch.float32, device=dev)
    sc, bs = scale.float().contiguous(), base.float().contiguous()
    p1 = pp_width(hc)
    meta = dict(ITERS=int(iters), HC=hc, P1=p1, HEAD=head, UPCAST=_INTERPRET)
    split, ks = _split_plan(t, hc * d, dev)
    if split > 1:
        # fp32 partials of every K slice, summed in slice order by the finishing kernel (no atomics)
        wpp = torch.empty(split, t, p1, dtype=torch.float32, device=dev)
        wcb = torch.empty(split, t, hc * hc, dtype=torch.float32, device=dev) if not head else wpp
        wss = torch.empty(split, t, dtype=torch.float32, device=dev)
        rows = triton.cdiv(t, _SPLIT_BT)
        _launch(
            _hc_pre_part_kernel,
            (rows, split),
            x,
            fpp,
            fcb,
            wpp,
            wcb,
            wss,
            t,
            d,
            ks,
            HC=hc,
            P1=p1,
            HEAD=head,
            BT=_SPLIT_BT,
            BK=_SPLIT_BK,
            UPCAST=_INTERPRET,
            num_warps=_SPLIT_WARPS,
        )
        grid, bt, ds = finish_grid(t, d, head, dev)
        _launch(
            _hc_pre_finish_kernel,
            grid,
            wpp,
            wcb,
            wss,
            x,
            sc,
            bs,
            y,
            post,
            comb,
            mix,
            rs,
            t,
            d,
            ds,
            float(norm_eps),
            float(hc_eps),
            SPLIT=split,
            **meta,
            BT=bt,
            BD=_FINISH_BD,
            num_warps=4,
        )
        return y, post, comb, mix, rs
    args = (x, fpp, fcb, sc, bs, y, post, comb, mix, rs, t, d, float(norm_eps), float(hc_eps))
    if _INTERPRET:
        _launch(_hc_pre_fwd_kernel, (triton.cdiv(t, 16),), *args, **meta, BT=16, BK=32, BD=32)
    else:
        _pre_tuned[_rows_grid(t)](*args, **meta)
    return y, post, comb, mix, rs


class _HcPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, scale, base, norm_eps, hc_eps, iters, parts):
        y, post, comb, mix, rs = _launch_pre(x, parts, scale, base, norm_eps, hc_eps, iters, head=False)
        ctx.save_for_backward(x, fn, scale, base, mix, rs)
        ctx.consts = (hc_eps, iters)
        return y, post, comb

    @staticmethod
    def backward(ctx, g_y, g_post, g_comb):
        x, fn, scale, base, mix, rs = ctx.saved_tensors
        hc_eps, iters = ctx.consts
        b, s, hc, d = x.shape
        t = b * s
        dev = x.device
        xk = x.reshape(t, hc * d).contiguous()  # [T, K], read in its own dtype by the kernels below
        gy = g_y.reshape(t, d).contiguous() if g_y is not None else None
        g_pre = torch.empty(t, hc, device=dev) if gy is not None else torch.zeros(t, hc, device=dev)
        if gy is not None and t > 0:  # (the kernel writes every row)
            _launch(_hc_pre_gpre_kernel, (triton.cdiv(t, 32),), xk, gy, g_pre, t, d, HC=hc, BT=32, BD=_GPRE_BD)
        g_post = g_post.reshape(t, hc).float().contiguous() if g_post is not None else torch.zeros(t, hc, device=dev)
        g_comb = (
            g_comb.reshape(t, hc, hc).float().contiguous() if g_comb is not None else torch.zeros(t, hc, hc, device=dev)
        )
        sc, bs = scale.detach().float().contiguous(), base.detach().float().contiguous()
        glogit = torch.empty_like(mix)  # [T, mix]
        pre = torch.empty(t, hc, device=dev)
        its = torch.empty(t, max(int(iters) - 1, 1), hc, hc, device=dev)  # the Sinkhorn's iterates (scratch)
        bt = 16
        _launch(
            _hc_split_bwd_kernel,
            (triton.cdiv(t, bt),),
            mix,
            sc,
            bs,
            g_pre,
            g_post,
            g_comb,
            glogit,
            pre,
            its,
            t,
            float(hc_eps),
            ITERS=int(iters),
            HC=hc,
            BT=bt,
            num_warps=4,
        )
        # logits = mixes * scale[segment] + base: per-parameter sums over tokens (fixed order)
        # scale per mix column: pre | post | comb (no host-built index tensor: graph-capturable)
        sc_vec = torch.cat([sc[0].expand(hc), sc[1].expand(hc), sc[2].expand(hc * hc)])  # [mix]
        g_m = glogit * sc_vec
        g_bs = glogit.sum(0)
        g_sc = torch.stack([part.sum() for part in (glogit * mix).split([hc, hc, hc * hc], dim=1)])
        r = rs.unsqueeze(-1)  # [T, 1]
        gmr = (g_m * r).contiguous()  # d loss / d raw mixes
        g_r = (g_m * mix).sum(-1, keepdim=True) / r  # d loss / d rsqrt
        c = (g_r * r.pow(3) / (hc * d)).reshape(t).contiguous()  # g_x's term in x (the rsqrt's gradient)
        g_x, g_fn = _projection_grads(xk, gy, fn, gmr, c, pre)
        return (
            g_x.reshape(x.shape).to(x.dtype),
            g_fn.to(fn.dtype),
            g_sc.to(scale.dtype),
            g_bs.to(base.dtype),
            None,
            None,
            None,
            None,
        )


class _HcPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, residual, post, comb):
        b, s, hc, d = residual.shape
        f_, res_ = f.contiguous(), residual.contiguous()
        post_, comb_ = post.float().contiguous(), comb.float().contiguous()
        out = torch.empty(b, s, hc, d, dtype=f.dtype, device=f.device)
        t = b * s
        if _INTERPRET:
            _launch(
                _hc_post_fwd_kernel,
                (triton.cdiv(t, 2), triton.cdiv(d, 32)),
                f_,
                res_,
                post_,
                comb_,
                out,
                t,
                d,
                HC=hc,
                BT=2,
                BD=32,
                UPCAST=True,
            )
        else:
            _post_tuned[lambda meta: (triton.cdiv(t, meta["BT"]), triton.cdiv(d, meta["BD"]))](
                f_, res_, post_, comb_, out, t, d, HC=hc, UPCAST=False
            )
        ctx.save_for_backward(f_, res_, post_, comb_)
        ctx.dtypes = (post.dtype, comb.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        f, res, post, comb = ctx.saved_tensors
        b, s, hc, d = res.shape
        g = g.contiguous()
        gf = torch.empty_like(f)
        gres = torch.empty_like(res)
        gpost = torch.empty(b, s, hc, dtype=torch.float32, device=f.device)
        gcomb = torch.empty(b, s, hc, hc, dtype=torch.float32, device=f.device)
        args = (g, f, res, post, comb, gf, gres, gpost, gcomb, b * s, d)
        if _INTERPRET:
            _launch(_hc_post_bwd_kernel, (triton.cdiv(b * s, 2),), *args, HC=hc, BT=2, BD=32, UPCAST=True)
        else:
            _post_bwd_tuned[_rows_grid(b * s)](*args, HC=hc, UPCAST=False)
        return gf, gres, gpost.to(ctx.dtypes[0]), gcomb.to(ctx.dtypes[1])


class _HcHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, scale, base, norm_eps, hc_eps, parts):
        y, _, _, mix, rs = _launch_pre(x, parts, scale, base, norm_eps, hc_eps, 1, head=True)
        ctx.save_for_backward(x, fn, scale, base, mix, rs)
        ctx.hc_eps = hc_eps
        return y

    @staticmethod
    def backward(ctx, g_y):
        return (*_head_grads(*ctx.saved_tensors, ctx.hc_eps, g_y), None, None, None)


def triton_hc_pre(x, fn, scale, base, norm_eps, hc_eps, iters):
    """`hc_pre`: fused mix projection, Sinkhorn and weighted reduce (see the module docstring)."""
    parts = split_fn(fn, x.size(2), head=False)  # (here: autograd's forward would hide whether fn is tracked)
    return _HcPre.apply(x, fn, scale, base, norm_eps, hc_eps, iters, parts)


def triton_hc_post(f, residual, post, comb):
    """`hc_post`: one pass over the residual copies."""
    return _HcPost.apply(f, residual, post, comb)


def triton_hc_head(x, fn, scale, base, norm_eps, hc_eps):
    """`hc_head`: `hc_pre`'s kernels without the Sinkhorn (the forward keeps the mixes for the backward)."""
    return _HcHead.apply(x, fn, scale, base, norm_eps, hc_eps, split_fn(fn, x.size(2), head=True))


def _x_reason(x: torch.Tensor) -> str | None:
    reason = device_reason(x)
    if reason:
        return reason
    if x.dim() != 4:
        return f"expects [b, s, hc, d] residual copies, got {tuple(x.shape)}"
    if x.size(2) not in (4, 8):
        return f"hc_mult must be 4 or 8, got {x.size(2)}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"expects bf16/fp16 residual copies (exact bf16 mix projection), got {x.dtype}"
    return None


def _pre_can_run(x, fn, scale, base, norm_eps, hc_eps, iters):
    return _x_reason(x)


def _head_can_run(x, fn, scale, base, norm_eps, hc_eps):
    return _x_reason(x)


def _post_can_run(f, residual, post, comb):
    reason = _x_reason(residual)
    if reason:
        return reason
    if f.dtype != residual.dtype:
        return f"f and residual dtypes differ ({f.dtype}, {residual.dtype})"
    return None


register("hc_pre", "triton", triton_hc_pre, can_run=_pre_can_run, deterministic=True, priority=10)
register("hc_post", "triton", triton_hc_post, can_run=_post_can_run, deterministic=True, priority=10)
register("hc_head", "triton", triton_hc_head, can_run=_head_can_run, deterministic=True, priority=10)
