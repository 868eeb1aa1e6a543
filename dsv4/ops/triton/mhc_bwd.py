"""The backward kernels of the fused hyper-connections (`dsv4.ops.triton.mhc`, whose docstring describes
them): `hc_post`'s (the gradients of the residual copies and of post and comb, reduced per token in registers
in a fixed order), the Sinkhorn map's of `hc_pre` (replayed per token from the saved mixes), and `hc_pre`'s
projection gradients (g_x and g_fn in one pass over x, after g_pre in another: x is read in its own dtype
twice instead of being copied to fp32 and passed over by a dozen full-size torch ops)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import num_sms
from ._mm_utils import INTERPRET, mma, round_to, split3
from ._mm_utils import launch as _launch


@triton.jit
def _hc_post_bwd_kernel(
    g_ptr,
    f_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    gf_ptr,
    gres_ptr,
    gpost_ptr,
    gcomb_ptr,
    T,
    D,
    HC: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One pass over g, f, res: gf, gres per element; gpost, gcomb reduced over d in registers.

    Copy i of the residual is loaded on its own as [BT, BD] (no [BT, HC, BD] tile filtered by a select per
    copy: that cost HC times the arithmetic of the useful work)."""
    pid = tl.program_id(0)
    ts = pid * BT + tl.arange(0, BT)
    tmask = ts < T
    ts64 = ts.to(tl.int64)
    hcs = tl.arange(0, HC)
    post = tl.load(post_ptr + ts64[:, None] * HC + hcs[None, :], mask=tmask[:, None], other=0.0)  # [BT, HC]
    comb = tl.load(
        comb_ptr + ts64[:, None, None] * HC * HC + hcs[None, :, None] * HC + hcs[None, None, :],
        mask=tmask[:, None, None],
        other=0.0,
    )  # [BT, HC(i), HC(j)]
    gpost = tl.zeros((BT, HC), dtype=tl.float32)
    gcomb = tl.zeros((BT, HC, HC), dtype=tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        dmask = ds < D
        m2 = tmask[:, None] & dmask[None, :]
        m3 = m2[:, None, :]
        off3 = ts64[:, None, None] * HC * D + hcs[None, :, None] * D + ds[None, None, :]
        g = tl.load(g_ptr + off3, mask=m3, other=0.0).to(tl.float32)  # [BT, HC(j), BD]
        f = tl.load(f_ptr + ts64[:, None] * D + ds[None, :], mask=m2, other=0.0).to(tl.float32)
        gf = tl.sum(post[:, :, None] * g, axis=1)
        tl.store(gf_ptr + ts64[:, None] * D + ds[None, :], round_to(gf, gf_ptr.dtype.element_ty, UPCAST), mask=m2)
        gpost += tl.sum(g * f[:, None, :], axis=2)
        for i in tl.static_range(HC):
            sel = (hcs == i)[None, :, None]
            ci = tl.sum(tl.where(sel, comb, 0.0), axis=1)  # [BT, HC(j)]
            ri = tl.load(res_ptr + ts64[:, None] * HC * D + i * D + ds[None, :], mask=m2, other=0.0).to(
                tl.float32
            )  # [BT, BD]
            gri = tl.sum(ci[:, :, None] * g, axis=1)  # [BT, BD]
            tl.store(
                gres_ptr + ts64[:, None] * HC * D + i * D + ds[None, :],
                round_to(gri, gres_ptr.dtype.element_ty, UPCAST),
                mask=m2,
            )
            gci = tl.sum(g * ri[:, None, :], axis=2)  # [BT, HC(j)]
            gcomb += tl.where(sel, gci[:, None, :], 0.0)
    tl.store(gpost_ptr + ts64[:, None] * HC + hcs[None, :], gpost, mask=tmask[:, None])
    tl.store(
        gcomb_ptr + ts64[:, None, None] * HC * HC + hcs[None, :, None] * HC + hcs[None, None, :],
        gcomb,
        mask=tmask[:, None, None],
    )


@triton.jit
def _colnorm(c, eps):
    return c / (tl.sum(c, axis=1)[:, None, :] + eps)


@triton.jit
def _rownorm(c, eps):
    return c / (tl.sum(c, axis=2)[:, :, None] + eps)


@triton.jit
def _colnorm_bwd(dy, x, eps):
    """y = x / (colsum(x) + eps) -> dx = (dy - colsum(dy * y)) / (colsum(x) + eps)."""
    d = tl.sum(x, axis=1)[:, None, :] + eps
    return (dy - tl.sum(dy * (x / d), axis=1)[:, None, :]) / d


@triton.jit
def _rownorm_bwd(dy, x, eps):
    d = tl.sum(x, axis=2)[:, :, None] + eps
    return (dy - tl.sum(dy * (x / d), axis=2)[:, :, None]) / d


@triton.jit
def _hc_split_bwd_kernel(
    mix_ptr,
    scale_ptr,
    base_ptr,
    gpre_ptr,
    gpost_ptr,
    gcomb_ptr,
    glogit_ptr,
    pre_ptr,
    its_ptr,
    T,
    hc_eps,
    ITERS: tl.constexpr,
    HC: tl.constexpr,
    BT: tl.constexpr,
):
    """Gradient of hc_split_sinkhorn w.r.t. its logits (mixes * scale + base), per token.

    The Sinkhorn is replayed once from the saved mixes, its ITERS - 1 intermediate matrices written to
    `its_ptr` ([T, ITERS - 1, HC, HC] fp32 scratch, read back by the same program), then the backward walks
    them in reverse: O(iters) [hc, hc] normalisations per token (replaying it from the start for every step
    back cost O(iters^2): 171 row-and-column pairs at 20 iterations against 19). Also writes pre (needed by
    the x gradient).
    """
    pid = tl.program_id(0)
    ts = pid * BT + tl.arange(0, BT)
    tmask = ts < T
    ts64 = ts.to(tl.int64)
    hcs = tl.arange(0, HC)
    n_mix: tl.constexpr = (2 + HC) * HC
    m1 = tmask[:, None]
    m3 = tmask[:, None, None]
    cc = hcs[:, None] * HC + hcs[None, :]  # [HC, HC]
    # pre = sigmoid(l) + eps, post = 2 sigmoid(l): d l = g * sig * (1 - sig) (* 2)
    lp = (
        tl.load(mix_ptr + ts64[:, None] * n_mix + hcs[None, :], mask=m1, other=0.0) * tl.load(scale_ptr)
        + tl.load(base_ptr + hcs)[None, :]
    )
    sp = tl.sigmoid(lp)
    tl.store(pre_ptr + ts64[:, None] * HC + hcs[None, :], sp + hc_eps, mask=m1)
    g = tl.load(gpre_ptr + ts64[:, None] * HC + hcs[None, :], mask=m1, other=0.0)
    tl.store(glogit_ptr + ts64[:, None] * n_mix + hcs[None, :], g * sp * (1.0 - sp), mask=m1)
    lq = (
        tl.load(mix_ptr + ts64[:, None] * n_mix + HC + hcs[None, :], mask=m1, other=0.0) * tl.load(scale_ptr + 1)
        + tl.load(base_ptr + HC + hcs)[None, :]
    )
    sq = tl.sigmoid(lq)
    g = tl.load(gpost_ptr + ts64[:, None] * HC + hcs[None, :], mask=m1, other=0.0)
    tl.store(glogit_ptr + ts64[:, None] * n_mix + HC + hcs[None, :], 2.0 * g * sq * (1.0 - sq), mask=m1)
    # comb: softmax rows (+eps), a column normalisation, then ITERS-1 (row, column) pairs
    z = (
        tl.load(mix_ptr + ts64[:, None, None] * n_mix + 2 * HC + cc[None, :, :], mask=m3, other=0.0)
        * tl.load(scale_ptr + 2)
        + tl.load(base_ptr + 2 * HC + cc)[None, :, :]
    )
    p = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    p = p / tl.sum(p, axis=2)[:, :, None]
    c0 = p + hc_eps
    x = _colnorm(c0, hc_eps)
    its = its_ptr + ts64[:, None, None] * ((ITERS - 1) * HC * HC) + cc[None, :, :]  # this token's iterates
    for i in range(ITERS - 1):  # the forward once: the input of (row, column) pair i, kept
        tl.store(its + i * HC * HC, x, mask=m3)
        x = _colnorm(_rownorm(x, hc_eps), hc_eps)
    dc = tl.load(gcomb_ptr + ts64[:, None, None] * HC * HC + cc[None, :, :], mask=m3, other=0.0)
    for pp in range(ITERS - 1):  # the pairs backward, last first
        x = tl.load(its + (ITERS - 2 - pp) * HC * HC, mask=m3, other=1.0)
        r = _rownorm(x, hc_eps)
        dc = _rownorm_bwd(_colnorm_bwd(dc, r, hc_eps), x, hc_eps)
    dc = _colnorm_bwd(dc, c0, hc_eps)
    dz = p * (dc - tl.sum(dc * p, axis=2)[:, :, None])
    tl.store(glogit_ptr + ts64[:, None, None] * n_mix + 2 * HC + cc[None, :, :], dz, mask=m3)


@triton.jit
def _hc_pre_gpre_kernel(x_ptr, gy_ptr, gpre_ptr, T, D, HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """g_pre[t, i] = sum_d x[t, i, d] g_y[t, d] in fp32 (x read in its own dtype: no fp32 copy of it)."""
    pid = tl.program_id(0)
    ts = pid * BT + tl.arange(0, BT)
    tmask = ts < T
    ts64 = ts.to(tl.int64)
    hcs = tl.arange(0, HC)
    acc = tl.zeros((BT, HC), dtype=tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        m = tmask[:, None] & (ds < D)[None, :]
        gy = tl.load(gy_ptr + ts64[:, None] * D + ds[None, :], mask=m, other=0.0).to(tl.float32)
        for i in tl.static_range(HC):
            xi = tl.load(x_ptr + ts64[:, None] * (HC * D) + i * D + ds[None, :], mask=m, other=0.0).to(tl.float32)
            acc = tl.where(hcs[None, :] == i, acc + tl.sum(xi * gy, axis=1)[:, None], acc)
    tl.store(gpre_ptr + ts64[:, None] * HC + hcs[None, :], acc, mask=tmask[:, None])


@triton.jit
def _mma_pairs(a0, a1, a2, b0, b1, b2, acc, UPCAST: tl.constexpr):
    """acc + (a0 + a1 + a2) @ (b0 + b1 + b2) over three-way bf16 splits, the six part products whose terms
    matter at fp32 precision (i + j <= 2), smallest first."""
    acc = mma(a2, b0, acc, UPCAST)
    acc = mma(a0, b2, acc, UPCAST)
    acc = mma(a1, b1, acc, UPCAST)
    acc = mma(a1, b0, acc, UPCAST)
    acc = mma(a0, b1, acc, UPCAST)
    return mma(a0, b0, acc, UPCAST)


@triton.jit
def _hc_pre_gx_kernel(
    x_ptr,
    gy_ptr,
    fn_ptr,
    gmr_ptr,
    c_ptr,
    pre_ptr,
    gx_ptr,
    gfn_ptr,
    T,
    D,
    per_split,
    MIX: tl.constexpr,
    HC: tl.constexpr,
    MP: tl.constexpr,
    HAS_GY: tl.constexpr,
    X_BF16: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The projection gradients of hc_pre in one pass over x, for the K columns of program axis 0 and the
    tokens of split axis 1 (K = HC * D, column k = copy k // D, channel k % D):

        g_x[t, k] = sum_m gmr[t, m] fn[m, k] - c[t] x[t, k] (+ pre[t, k // D] g_y[t, k % D])   in x's dtype
        g_fn part[split, m, k] = sum over the split's tokens of gmr[t, m] x[t, k]               fp32

    gmr = d loss / d raw mixes [T, MIX], c = the rsqrt's gradient term [T]. Both sums run on bf16 tensor
    cores with fp32 accumulation over exact three-way bf16 splits (`split3`) of the fp32 operands: g_x keeps
    the six of nine part products that matter at fp32 precision (i + j <= 2: the rest are below 2^-24
    relative), g_fn the three of gmr's parts times x when x holds bf16 values (exact: one part), else six as
    g_x. The caller adds the parts in split order: no atomics, the same bits at every run."""
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    K = HC * D
    ks = pid_k * BK + tl.arange(0, BK)
    kmask = ks < K
    ms = tl.arange(0, MP)
    mmask = ms < MIX
    fnt = tl.load(fn_ptr + ms[:, None] * K + ks[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0).to(
        tl.float32
    )  # [MP, BK]
    f0, f1, f2 = split3(fnt, UPCAST)
    acc = tl.zeros((MP, BK), dtype=tl.float32)
    t0 = pid_s * per_split
    t1 = tl.minimum(t0 + per_split, T)
    for tb in range(t0, t1, BT):
        ts = tb + tl.arange(0, BT)
        tmask = ts < t1
        ts64 = ts.to(tl.int64)
        m = tmask[:, None] & kmask[None, :]
        gmr = tl.load(gmr_ptr + ts64[:, None] * MIX + ms[None, :], mask=tmask[:, None] & mmask[None, :], other=0.0)
        g0, g1, g2 = split3(gmr, UPCAST)  # [BT, MP] each
        xr = tl.load(x_ptr + ts64[:, None] * K + ks[None, :], mask=m, other=0.0)  # [BT, BK] in x's dtype
        xt = xr.to(tl.float32)
        c = tl.load(c_ptr + ts64, mask=tmask, other=0.0)
        d = _mma_pairs(g0, g1, g2, f0, f1, f2, tl.zeros((BT, BK), dtype=tl.float32), UPCAST)  # gmr fn
        g = d - c[:, None] * xt
        if HAS_GY:
            pre = tl.load(pre_ptr + ts64[:, None] * HC + (ks // D)[None, :], mask=m, other=0.0)
            gy = tl.load(gy_ptr + ts64[:, None] * D + (ks % D)[None, :], mask=m, other=0.0).to(tl.float32)
            g += pre * gy
        tl.store(gx_ptr + ts64[:, None] * K + ks[None, :], round_to(g, gx_ptr.dtype.element_ty, UPCAST), mask=m)
        g0t, g1t, g2t = tl.trans(g0), tl.trans(g1), tl.trans(g2)  # [MP, BT]
        if X_BF16:
            acc = mma(g2t, xr, acc, UPCAST)
            acc = mma(g1t, xr, acc, UPCAST)
            acc = mma(g0t, xr, acc, UPCAST)
        else:
            x0, x1, x2 = split3(xt, UPCAST)
            acc = _mma_pairs(g0t, g1t, g2t, x0, x1, x2, acc, UPCAST)
    tl.store(gfn_ptr + pid_s * MP * K + ms[:, None] * K + ks[None, :], acc, mask=mmask[:, None] & kmask[None, :])


GPRE_BD = 32 if INTERPRET else 128  # channels per step of the g_pre kernel
# the projection kernel's tiles: tokens per step and K columns per program (smaller in the interpreter);
# 32 x 128 was the fastest of nine on an H100 at 65,536 tokens of 4 x 384 (BENCHMARKS.md, "The training
# step 21% faster")
GX_BT, GX_BK = (16, 32) if INTERPRET else (32, 128)
GX_PROGRAMS_PER_SM = 4  # (K tiles x token splits): about this many programs per SM


def projection_grads(
    xk: torch.Tensor, gy: torch.Tensor | None, fn: torch.Tensor, gmr: torch.Tensor, c: torch.Tensor, pre: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_x [T, K] in x's dtype, g_fn [MIX, K] fp32) of hc_pre for x [T, K] (K = HC * D), g_y [T, D] or None,
    fn [MIX, K], gmr [T, MIX] fp32, c [T] fp32, pre [T, HC] fp32: `_hc_pre_gx_kernel` over (K tiles, token
    splits), its fp32 g_fn parts added in split order."""
    t, k = xk.shape
    mix, hc = gmr.size(1), pre.size(1)
    if t == 0:  # no tokens: nothing to launch (a zero grid is an error)
        return torch.empty_like(xk), torch.zeros(mix, k, dtype=torch.float32, device=xk.device)
    k_tiles = triton.cdiv(k, GX_BK)
    want = max(1, GX_PROGRAMS_PER_SM * num_sms(xk.device) // k_tiles)
    per_split = triton.cdiv(triton.cdiv(t, min(want, triton.cdiv(t, GX_BT))), GX_BT) * GX_BT
    splits = triton.cdiv(t, per_split)
    mp = max(16, triton.next_power_of_2(mix))
    g_x = torch.empty_like(xk)
    parts = torch.empty(splits, mp, k, dtype=torch.float32, device=xk.device)
    _launch(
        _hc_pre_gx_kernel,
        (k_tiles, splits),
        xk,
        gy if gy is not None else xk,
        fn.contiguous(),
        gmr,
        c,
        pre,
        g_x,
        parts,
        t,
        k // hc,
        per_split,
        MIX=mix,
        HC=hc,
        MP=mp,
        HAS_GY=gy is not None,
        X_BF16=xk.dtype == torch.bfloat16,
        BT=GX_BT,
        BK=GX_BK,
        UPCAST=INTERPRET,
        num_warps=4,
    )
    return g_x, parts[:, :mix].sum(0)  # (rows past MIX pad the dots and are never written)


def head_grads(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    mix: torch.Tensor,
    rs: torch.Tensor,
    hc_eps: float,
    g_y: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (x, fn, scale, base) of `hc_head` from its forward's RMS-scaled mixes mix [T, HC] and RMS
    scales rs [T]: pre = sigmoid(mix * scale + base) + hc_eps, y = sum_i pre_i x_i (no Sinkhorn). g_pre and
    the projection gradients are `hc_pre`'s kernels; the [T, HC] steps between them are torch ops."""
    b, s, hc, d = x.shape
    t = b * s
    xk = x.reshape(t, hc * d).contiguous()
    gy = g_y.reshape(t, d).contiguous()
    g_pre = torch.empty(t, hc, device=x.device)
    if t > 0:
        _launch(_hc_pre_gpre_kernel, (triton.cdiv(t, 32),), xk, gy, g_pre, t, d, HC=hc, BT=32, BD=GPRE_BD)
    sc, bs = scale.detach().float(), base.detach().float()
    sig = torch.sigmoid(mix * sc + bs)  # [T, HC]
    glogit = g_pre * sig * (1.0 - sig)  # d loss / d (mix * scale + base)
    g_m = glogit * sc  # d loss / d mix
    r = rs.unsqueeze(-1)  # [T, 1]
    g_r = (g_m * mix).sum(-1, keepdim=True) / r  # d loss / d rsqrt (mix = raw mixes * rsqrt)
    c = (g_r * r.pow(3) / (hc * d)).reshape(t).contiguous()  # g_x's term in x (the rsqrt's gradient)
    g_x, g_fn = projection_grads(xk, gy, fn, (g_m * r).contiguous(), c, sig + hc_eps)
    g_sc = (glogit * mix).sum().reshape(scale.shape)
    return g_x.reshape(x.shape).to(x.dtype), g_fn.to(fn.dtype), g_sc.to(scale.dtype), glogit.sum(0).to(base.dtype)
