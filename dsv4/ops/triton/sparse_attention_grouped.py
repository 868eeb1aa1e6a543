"""Sparse attention's forward over groups of consecutive queries that share their keys (a plan of the
`triton` backend for inference steps of many queries and few heads).

Semantics: `dsv4.ops.reference.sparse_attention`, the same op (q [b, s, h, d], kv [b, n, d], sink [h], idx
[b, s, k] with -1 = no key -> o, lse). The per-query kernel (`sparse_attention._fwd_kernel`) gathers each
query's keys for all its heads at once; with 16 heads its tensor-core tile has 16 rows and a prompt token
reads its keys by itself, although the next token of the same prompt lists almost the same keys: the
window of token p + 1 is the window of p shifted by one column.

Design
- One program takes G consecutive queries of one batch row (G = 64 // heads, padded to a power of two)
  as the G * heads rows of one tile. Its last query is the *leader*. Pass 1 walks the leader's keys: each
  key tile is gathered once and scores all G * heads rows; query g takes the leader's key n where it lists
  the same key at column n + delta_g (delta_g = leader - g: its window, shifted), or else at column n (an
  entry list in the same order; only where that column is not already the shifted match of another
  leader column). Pass 2 takes, query by query, the keys of its list that pass 1 did not give it (the
  oldest window columns, entries the leader does not list, a decode row's keys), gathered for it alone.
- Every column of a query's list is thereby taken exactly once, whatever the lists hold (ids compared,
  nothing assumed about their layout): a key listed twice counts twice, as in the reference. Only how
  much is shared depends on the layout.
- Online softmax from the sink, as the per-query kernel (the sink is a key with a zero value). Pass 1
  weights a key by the number of rows' columns it stands for (0, 1 or 2 per query). The loops run over
  the key blocks from the first to the last that hold something for the pass (as the per-query kernel's
  TRIM), so a block without a taken key is neither gathered nor scored.
- Forward only, at inference (no gradient, not in deterministic mode): a query's sums run in another
  order than the per-query kernel's, and which keys a program shares depends on its neighbours.

`ENABLED` is off: on an H100 it took 3.8x the per-query kernel's time at a 1,292-query mixed step and 6.3x
at 256 decode-shaped queries (64 rows scored against every leader key, and a second pass per query, cost
more than the shared gathers save); `scripts/bench_attn_prefill.py --grouped` repeats the comparison.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from ..precision import is_exact
from ._common import LOG2E, Kernel, dot_precision, dot_type, interpret_mode, num_sms

ENABLED = False  # the plan is chosen only where this is set (see the module docstring)
MAX_ROWS = 64  # queries x heads per program: the tensor-core tile's rows
CONFIG = {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def _grouped_fwd_kernel(
    q_ptr,
    kv_ptr,
    sink_ptr,
    idx_ptr,
    o_ptr,
    lse_ptr,
    S,
    H,
    K,
    N,
    D,
    n_groups,
    scale_log2,
    G: tl.constexpr,
    BH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BD: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
):
    M: tl.constexpr = G * BH
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_groups
    s0 = (pid % n_groups) * G
    s_last = tl.minimum(s0 + G - 1, S - 1)
    gs = tl.arange(0, G)
    rows = tl.arange(0, M)
    g_of = rows // BH  # [M] the query of each tile row
    h_of = rows % BH
    s_of = s0 + g_of
    r_ok = (s_of < S) & (h_of < H)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    qrow = (b * S + s_of) * H + h_of  # [M]
    q = tl.load(q_ptr + qrow[:, None] * D + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    sink = tl.load(sink_ptr + h_of, mask=h_of < H, other=0.0).to(tl.float32)  # [M]
    m = sink * 1.4426950408889634
    l_sum = tl.full([M], 1.0, tl.float32)
    acc = tl.zeros([M, BD], tl.float32)
    kv_base = b * N
    lead = (b * S + s_last) * K  # the leader's idx row
    own = (b * S + s0 + gs) * K  # [G]
    g_ok = (s0 + gs) < S
    delta = s_last - (s0 + gs)  # [G]: the leader's window is this many columns ahead of query g's
    # ---- pass 1: the leader's keys, shared by every query that lists them at the aligned column
    t_lo = K + 0
    t_hi = K * 0
    for start in range(0, K, BLOCK_N):  # the key blocks where the leader has a key
        offs_n = start + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + lead + offs_n, mask=offs_n < K, other=-1)
        live = tl.max(ids, axis=0) >= 0
        t_lo = tl.where(live, tl.minimum(t_lo, start), t_lo)
        t_hi = tl.where(live, start + BLOCK_N, t_hi)
    for start in range(t_lo, t_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < K
        ids = tl.load(idx_ptr + lead + offs_n, mask=n_ok, other=-1)  # [BN]
        live = (ids >= 0)[None, :]
        sh = offs_n[None, :] + delta[:, None]  # [G, BN] query g's column of leader column n, shifted
        at_sh = tl.load(idx_ptr + own[:, None] + sh, mask=g_ok[:, None] & (sh < K), other=-2)
        at_n = tl.load(idx_ptr + own[:, None] + offs_n[None, :], mask=g_ok[:, None] & n_ok[None, :], other=-2)
        back = offs_n[None, :] - delta[:, None]  # the leader column whose shift lands on column n
        back_ok = g_ok[:, None] & (back >= 0) & (back < K) & n_ok[None, :]
        lead_back = tl.load(idx_ptr + lead + back, mask=back_ok, other=-3)
        take_sh = (at_sh == ids[None, :]) & live
        take_n = (at_n == ids[None, :]) & live & (delta[:, None] != 0) & (lead_back != at_n)
        wgt = take_sh.to(tl.float32) + take_n.to(tl.float32)  # [G, BN]
        col = tl.max(wgt, axis=0) > 0  # [BN] some query takes the key
        w = tl.reshape(tl.broadcast_to(wgt[:, None, :], (G, BH, BLOCK_N)), (M, BLOCK_N))
        kv = tl.load(
            kv_ptr + (kv_base + ids[:, None].to(tl.int64)) * D + offs_d[None, :],
            mask=col[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BN, BD]
        s = tl.dot(q.to(DOT_T), tl.trans(kv.to(DOT_T)), input_precision=PREC) * scale_log2  # [M, BN]
        s = tl.where(w > 0, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None]) * w
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype).to(DOT_T), kv.to(DOT_T), input_precision=PREC)
        m = m_new
    # ---- pass 2: each query's keys that pass 1 did not give it, gathered for that query alone
    for g in tl.static_range(G):
        s_g = s0 + g
        row_g = (b * S + s_g) * K
        d_g = s_last - s_g
        ok_g = s_g < S
        t_lo = K + 0
        t_hi = K * 0
        for start in range(0, K, BLOCK_N):  # the key blocks where query g has a key left
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = (offs_n < K) & ok_g
            mine = tl.load(idx_ptr + row_g + offs_n, mask=n_ok, other=-1)
            by_sh = tl.load(idx_ptr + lead + offs_n - d_g, mask=n_ok & (offs_n - d_g >= 0), other=-3)
            by_n = tl.load(idx_ptr + lead + offs_n, mask=n_ok, other=-3)
            left = (mine >= 0) & (by_sh != mine) & ((d_g == 0) | (by_n != mine))
            live = tl.max(left.to(tl.int32), axis=0) > 0
            t_lo = tl.where(live, tl.minimum(t_lo, start), t_lo)
            t_hi = tl.where(live, start + BLOCK_N, t_hi)
        for start in range(t_lo, t_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = (offs_n < K) & ok_g
            mine = tl.load(idx_ptr + row_g + offs_n, mask=n_ok, other=-1)
            by_sh = tl.load(idx_ptr + lead + offs_n - d_g, mask=n_ok & (offs_n - d_g >= 0), other=-3)
            by_n = tl.load(idx_ptr + lead + offs_n, mask=n_ok, other=-3)
            left = (mine >= 0) & (by_sh != mine) & ((d_g == 0) | (by_n != mine))  # [BN]
            w = ((g_of == g)[:, None] & left[None, :]).to(tl.float32)  # [M, BN]: query g's rows only
            kv = tl.load(
                kv_ptr + (kv_base + mine[:, None].to(tl.int64)) * D + offs_d[None, :],
                mask=left[:, None] & d_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q.to(DOT_T), tl.trans(kv.to(DOT_T)), input_precision=PREC) * scale_log2
            s = tl.where(w > 0, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None]) * w
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype).to(DOT_T), kv.to(DOT_T), input_precision=PREC)
            m = m_new
    o = acc / l_sum[:, None]
    tl.store(
        o_ptr + qrow[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :]
    )
    # while the sink is still the maximum, lse = sink + log(l): exactly the sink when no key is valid
    lse = tl.where(m == sink * 1.4426950408889634, sink + tl.log(l_sum), (m + tl.log2(l_sum)) * 0.6931471805599453)
    tl.store(lse_ptr + qrow, lse, mask=r_ok)


_grouped_fwd = Kernel(_grouped_fwd_kernel)


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """`ENABLED` set to `on` inside the block, as it was after it."""
    global ENABLED
    before, ENABLED = ENABLED, on
    try:
        yield
    finally:
        ENABLED = before


def group_size(h: int) -> int:
    """Queries per program for h heads: the rows of one tile (1: no grouping)."""
    return max(1, MAX_ROWS // max(16, triton.next_power_of_2(h)))


def applies(q: torch.Tensor) -> bool:
    """Whether a forward over q [b, s, h, d] takes this plan: where set (`ENABLED`), not in deterministic mode
    (a query's sums would depend on its neighbours), at least two queries per program and a group's worth
    per batch row (groups do not cross rows: a batch of one-token rows, a dense decode step, shares nothing),
    and enough groups to give every SM one (fewer queries are the per-query kernel's decode plans)."""
    b, s, h, _ = q.shape
    g = group_size(h)
    return ENABLED and not is_exact() and 1 < g <= s and b * triton.cdiv(s, g) >= num_sms(q.device)


def grouped_forward(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only (no autograd) -> (o like q, lse [b, s, h] fp32)."""
    b, s, h, d = q.shape
    n, k = kv.size(1), idx.size(2)
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    if b * s == 0 or h == 0:
        return o, lse
    g = group_size(h)
    n_groups = triton.cdiv(s, g)
    cfg = {"BLOCK_N": 16} if interpret_mode() else CONFIG
    _grouped_fwd[(b * n_groups,)](
        q,
        kv,
        sink.float().contiguous(),
        idx,
        o,
        lse,
        s,
        h,
        k,
        n,
        d,
        n_groups,
        float(scale) * LOG2E,
        G=g,
        BH=max(16, triton.next_power_of_2(h)),
        BD=max(16, triton.next_power_of_2(d)),
        PREC=dot_precision(q.dtype),
        DOT_T=dot_type(q.dtype),
        **cfg,
    )
    return o, lse
