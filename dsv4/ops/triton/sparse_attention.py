"""Triton sparse attention with per-head sinks over index-gathered keys (the `triton` backend).

Semantics: `dsv4.ops.reference.sparse_attention` (q [b, s, h, d], kv [b, n, d] one shared head used as key
and value, sink [h] fp32, idx [b, s, k] with -1 = no key) -> (o [b, s, h, d], lse [b, s, h] fp32).

Design
- All heads of a query share its key indices, so one program takes one query and a block of BLOCK_H heads
  (the M dimension of the tensor-core products): each gathered KV tile [BLOCK_N, d] is loaded once and
  serves every head of the block. With 64 heads and BLOCK_H = 64 the KV of a query is read once.
- Online softmax starts from the sink: running max m = sink_h and running sum l = 1 (= exp(sink - m)),
  accumulator 0. The sink is thereby a key with a zero value, and every intermediate stays finite even
  when a query has no valid key at all (then o = 0 and lse = sink exactly, as in the reference).
- Decode (few queries, e.g. 1-2 per sequence in a large batch): the keys of each query are split over
  several programs (flash-decoding); partial (max, sum, accumulator) triples are merged with the sink in a
  second small kernel. Chosen automatically when one program per query would leave most SMs idle. A paged
  KV cache is served by the same op: flatten the pool to kv [1, slots, d], the decode queries to
  q [1, batch, h, d] and give physical slot ids in idx.
- Backward, recomputing scores from the saved lse. "two_pass" (default for <= 64 heads): pass 1, one
  program per (query, head block), computes dq (in registers: each program owns its rows) and dsink
  and stores P and scale*dS [b*s, h, k]; pass 2, one program per query, forms each key's dkv row with
  all heads reduced on tensor cores (P^T dO + dS^T Q, K = heads) and scatters it once. "fused" (any
  head count): one kernel does both and scatters once per head block. dsink per (query, head) is summed
  by torch. The dkv scatter onto the gathered rows uses fp32 atomics by default, or in deterministic mode
  (`dsv4.ops.is_deterministic()` at forward time) a two-pass reduction: every program writes its
  per-slot contribution, then a second kernel sums the contributions of each kv row in a fixed order
  (stable sort of the targets). Gradient for lse is accepted and ignored (lse is not differentiable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import ops as _ops
from ..precision import is_exact
from ._common import (
    FLOAT_DTYPES,
    LOG2E,
    Kernel,
    device_reason,
    dot_precision,
    dot_type,
    interpret_mode,
    num_sms,
)


# ----------------------------------------------------------------------------- kernels
def _fwd_kernel(
    q_ptr,
    kv_ptr,
    sink_ptr,
    idx_ptr,
    o_ptr,
    lse_ptr,
    olo_ptr,
    pacc_ptr,
    pm_ptr,
    pl_ptr,
    S,
    H,
    K,
    N,
    D,
    scale_log2,
    keys_per_split,
    n_splits,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
    STORE_LO: tl.constexpr,
    D_SPLIT: tl.constexpr,
    TRIM: tl.constexpr,
):
    """D_SPLIT > 1: D_SPLIT programs share a (query, head block), each accumulating 1/D_SPLIT of the
    output columns (scores are computed by each of them: less register pressure for more QK work).
    TRIM: a first pass over the key ids finds the first and last blocks holding a valid key; the loop runs
    over those only (a block of -1 keys leaves the running max, sum and accumulator exactly as they were)."""
    pid_q = tl.program_id(0).to(tl.int64)  # b * S + s
    pid_h = tl.program_id(1) // D_SPLIT
    pid_dh = tl.program_id(1) % D_SPLIT
    pid_k = tl.program_id(2)
    b = pid_q // S
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_o = pid_dh * (BLOCK_D // D_SPLIT) + tl.arange(0, BLOCK_D // D_SPLIT)  # output columns
    h_ok = offs_h < H
    d_ok = offs_d < D
    o_ok = offs_o < D
    first = (tl.zeros([BLOCK_H], tl.int32) + pid_dh) == 0  # [BH]: this program stores m, l, lse
    q = tl.load(
        q_ptr + (pid_q * H + offs_h[:, None]) * D + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0
    )  # [BH, BD]
    if SPLIT:
        m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: no inf - inf
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        k_lo = pid_k * keys_per_split
        k_hi = tl.minimum(k_lo + keys_per_split, K)
    else:
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        m = sink * 1.4426950408889634
        l_sum = tl.full([BLOCK_H], 1.0, tl.float32)
        k_lo = 0
        k_hi = K
    acc = tl.zeros([BLOCK_H, BLOCK_D // D_SPLIT], tl.float32)
    if TRIM:  # only the key blocks from the first to the last holding a valid key (same block bounds)
        t_lo, t_hi = k_hi, k_lo
        for start in range(k_lo, k_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            ids = tl.load(idx_ptr + pid_q * K + offs_n, mask=offs_n < k_hi, other=-1)
            live = tl.max(ids, axis=0) >= 0
            t_lo, t_hi = tl.where(live, tl.minimum(t_lo, start), t_lo), tl.where(live, start + BLOCK_N, t_hi)
        k_lo, k_hi = t_lo, tl.minimum(t_hi, k_hi)
    for start in range(k_lo, k_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + pid_q * K + offs_n, mask=offs_n < k_hi, other=-1).to(tl.int64)
        valid = ids >= 0
        kv = tl.load(
            kv_ptr + (b * N + ids[:, None]) * D + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0
        )  # [BN, BD]
        s = tl.dot(q.to(DOT_T), tl.trans(kv.to(DOT_T)), input_precision=PREC) * scale_log2  # [BH, BN]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if D_SPLIT == 1:
            kv_o = kv
        else:
            kv_o = tl.load(
                kv_ptr + (b * N + ids[:, None]) * D + offs_o[None, :], mask=valid[:, None] & o_ok[None, :], other=0.0
            )  # [BN, BD/D_SPLIT]
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype).to(DOT_T), kv_o.to(DOT_T), input_precision=PREC)
        m = m_new
    ho_ok = h_ok[:, None] & o_ok[None, :]
    if SPLIT:
        row = (pid_q * n_splits + pid_k) * H + offs_h  # [BH]
        tl.store(pm_ptr + row, m, mask=h_ok & first)
        tl.store(pl_ptr + row, l_sum, mask=h_ok & first)
        tl.store(pacc_ptr + row[:, None] * D + offs_o[None, :], acc, mask=ho_ok)
    else:
        o = acc / l_sum[:, None]
        o_hi = o.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + (pid_q * H + offs_h[:, None]) * D + offs_o[None, :], o_hi, mask=ho_ok)
        if STORE_LO:  # rounding residual of o, so that backward's rowsum(o * do) is fp32-accurate
            tl.store(
                olo_ptr + (pid_q * H + offs_h[:, None]) * D + offs_o[None, :],
                (o - o_hi.to(tl.float32)).to(olo_ptr.dtype.element_ty),
                mask=ho_ok,
            )
        # while the sink is still the maximum, lse = sink + log(l): exactly the sink when no key is valid
        lse = tl.where(m == sink * 1.4426950408889634, sink + tl.log(l_sum), (m + tl.log2(l_sum)) * 0.6931471805599453)
        tl.store(lse_ptr + pid_q * H + offs_h, lse, mask=h_ok & first)


def _combine_kernel(
    sink_ptr,
    pacc_ptr,
    pm_ptr,
    pl_ptr,
    o_ptr,
    lse_ptr,
    olo_ptr,
    H,
    D,
    n_splits,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_LO: tl.constexpr,
):
    pid_q = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    hd_ok = h_ok[:, None] & (offs_d < D)[None, :]
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    m = sink * 1.4426950408889634
    l_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(0, n_splits):
        row = (pid_q * n_splits + i) * H + offs_h
        mi = tl.load(pm_ptr + row, mask=h_ok, other=-1.0e30)
        li = tl.load(pl_ptr + row, mask=h_ok, other=0.0)
        ai = tl.load(pacc_ptr + row[:, None] * D + offs_d[None, :], mask=hd_ok, other=0.0)
        m_new = tl.maximum(m, mi)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(mi - m_new)
        l_sum = l_sum * alpha + li * beta
        acc = acc * alpha[:, None] + ai * beta[:, None]
        m = m_new
    o = acc / l_sum[:, None]
    o_hi = o.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + (pid_q * H + offs_h[:, None]) * D + offs_d[None, :], o_hi, mask=hd_ok)
    if STORE_LO:
        tl.store(
            olo_ptr + (pid_q * H + offs_h[:, None]) * D + offs_d[None, :],
            (o - o_hi.to(tl.float32)).to(olo_ptr.dtype.element_ty),
            mask=hd_ok,
        )
    lse = tl.where(m == sink * 1.4426950408889634, sink + tl.log(l_sum), (m + tl.log2(l_sum)) * 0.6931471805599453)
    tl.store(lse_ptr + pid_q * H + offs_h, lse, mask=h_ok)


def _bwd_kernel(
    q_ptr,
    kv_ptr,
    sink_ptr,
    idx_ptr,
    o_ptr,
    olo_ptr,
    do_ptr,
    lse_ptr,
    dq_ptr,
    dkv_ptr,
    dsink_ptr,
    contrib_ptr,
    S,
    H,
    K,
    N,
    D,
    scale,
    n_hblocks,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
    HAS_LO: tl.constexpr,
):
    pid_q = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    b = pid_q // S
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    hd_off = (pid_q * H + offs_h[:, None]) * D + offs_d[None, :]
    q = tl.load(q_ptr + hd_off, mask=hd_ok, other=0.0)  # [BH, BD]
    do = tl.load(do_ptr + hd_off, mask=hd_ok, other=0.0)  # [BH, BD]
    o = tl.load(o_ptr + hd_off, mask=hd_ok, other=0.0).to(tl.float32)
    if HAS_LO:
        o += tl.load(olo_ptr + hd_off, mask=hd_ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), 1)  # [BH]
    lse = tl.load(lse_ptr + pid_q * H + offs_h, mask=h_ok, other=0.0)  # [BH]
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    # d loss / d sink_h = -exp(sink_h - lse) * delta   (the sink is a key with a zero value)
    tl.store(dsink_ptr + pid_q * H + offs_h, -tl.exp(sink - lse) * delta, mask=h_ok)
    lse2 = lse * 1.4426950408889634
    scale_log2 = scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, K, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + pid_q * K + offs_n, mask=offs_n < K, other=-1).to(tl.int64)
        valid = ids >= 0
        kv = tl.load(
            kv_ptr + (b * N + ids[:, None]) * D + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0
        )  # [BN, BD]
        s = tl.dot(q.to(DOT_T), tl.trans(kv.to(DOT_T)), input_precision=PREC) * scale_log2  # [BH, BN]
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(valid[None, :] & h_ok[:, None], p, 0.0)
        dp = tl.dot(do.to(DOT_T), tl.trans(kv.to(DOT_T)), input_precision=PREC)  # [BH, BN]
        ds = p * (dp - delta[:, None])  # d loss / d (q.k)
        dq += tl.dot(ds.to(kv.dtype).to(DOT_T), kv.to(DOT_T), input_precision=PREC)
        dkv = tl.dot(tl.trans(p.to(do.dtype).to(DOT_T)), do.to(DOT_T), input_precision=PREC)  # value [BN, BD]
        dkv += tl.dot(tl.trans((ds * scale).to(q.dtype).to(DOT_T)), q.to(DOT_T), input_precision=PREC)  # key
        if DETERMINISTIC:
            slot = (pid_q * n_hblocks + pid_h) * K + offs_n  # [BN]
            tl.store(contrib_ptr + slot[:, None] * D + offs_d[None, :], dkv, mask=(offs_n < K)[:, None] & d_ok[None, :])
        else:
            tl.atomic_add(
                dkv_ptr + (b * N + ids[:, None]) * D + offs_d[None, :],
                dkv,
                mask=valid[:, None] & d_ok[None, :],
                sem="relaxed",
            )
    tl.store(dq_ptr + hd_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=hd_ok)


def _bwd_dq_kernel(
    q_ptr,
    kv_ptr,
    sink_ptr,
    idx_ptr,
    o_ptr,
    olo_ptr,
    do_ptr,
    lse_ptr,
    dq_ptr,
    dsink_ptr,
    p_ptr,
    ds_ptr,
    S,
    H,
    K,
    N,
    D,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
    HAS_LO: tl.constexpr,
):
    """Two-pass backward, pass 1: dq and dsink; saves P and scale*dS [b*s, h, k] for pass 2."""
    pid_q = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    b = pid_q // S
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    hd_off = (pid_q * H + offs_h[:, None]) * D + offs_d[None, :]
    q = tl.load(q_ptr + hd_off, mask=hd_ok, other=0.0)  # [BH, BD]
    do = tl.load(do_ptr + hd_off, mask=hd_ok, other=0.0)
    o = tl.load(o_ptr + hd_off, mask=hd_ok, other=0.0).to(tl.float32)
    if HAS_LO:
        o += tl.load(olo_ptr + hd_off, mask=hd_ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), 1)  # [BH]
    lse = tl.load(lse_ptr + pid_q * H + offs_h, mask=h_ok, other=0.0)
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(dsink_ptr + pid_q * H + offs_h, -tl.exp(sink - lse) * delta, mask=h_ok)
    lse2 = lse * 1.4426950408889634
    scale_log2 = scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, K, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < K
        ids = tl.load(idx_ptr + pid_q * K + offs_n, mask=n_ok, other=-1).to(tl.int64)
        valid = ids >= 0
        kv = tl.load(
            kv_ptr + (b * N + ids[:, None]) * D + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0
        )  # [BN, BD]
        s = tl.dot(q.to(DOT_T), tl.trans(kv.to(DOT_T)), input_precision=PREC) * scale_log2
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(valid[None, :] & h_ok[:, None], p, 0.0)  # [BH, BN]
        dp = tl.dot(do.to(DOT_T), tl.trans(kv.to(DOT_T)), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kv.dtype).to(DOT_T), kv.to(DOT_T), input_precision=PREC)
        hk_off = (pid_q * H + offs_h[:, None]) * K + offs_n[None, :]
        hk_ok = h_ok[:, None] & n_ok[None, :]
        tl.store(p_ptr + hk_off, p.to(p_ptr.dtype.element_ty), mask=hk_ok)
        tl.store(ds_ptr + hk_off, (ds * scale).to(ds_ptr.dtype.element_ty), mask=hk_ok)
    tl.store(dq_ptr + hd_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=hd_ok)


def _bwd_dkv_kernel(
    q_ptr,
    do_ptr,
    idx_ptr,
    p_ptr,
    ds_ptr,
    dkv_ptr,
    contrib_ptr,
    S,
    H,
    K,
    N,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """Two-pass backward, pass 2: one query, all heads (H <= BLOCK_H) reduced on tensor cores:
    dkv[idx_j] += P[:, j]^T dO + (scale dS)[:, j]^T Q, one scatter per (query, key)."""
    pid_q = tl.program_id(0).to(tl.int64)
    b = pid_q // S
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    hd_off = (pid_q * H + offs_h[:, None]) * D + offs_d[None, :]
    q = tl.load(q_ptr + hd_off, mask=hd_ok, other=0.0)  # [BH, BD]
    do = tl.load(do_ptr + hd_off, mask=hd_ok, other=0.0)
    for start in range(0, K, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < K
        ids = tl.load(idx_ptr + pid_q * K + offs_n, mask=n_ok, other=-1).to(tl.int64)
        valid = ids >= 0
        hk_off = (pid_q * H + offs_h[:, None]) * K + offs_n[None, :]
        hk_ok = h_ok[:, None] & n_ok[None, :]
        p = tl.load(p_ptr + hk_off, mask=hk_ok, other=0.0)  # [BH, BN]
        ds = tl.load(ds_ptr + hk_off, mask=hk_ok, other=0.0)
        dkv = tl.dot(tl.trans(p.to(DOT_T)), do.to(DOT_T), input_precision=PREC)  # [BN, BD]
        dkv += tl.dot(tl.trans(ds.to(DOT_T)), q.to(DOT_T), input_precision=PREC)
        if DETERMINISTIC:
            slot = pid_q * K + offs_n
            tl.store(contrib_ptr + slot[:, None] * D + offs_d[None, :], dkv, mask=n_ok[:, None] & d_ok[None, :])
        else:
            tl.atomic_add(
                dkv_ptr + (b * N + ids[:, None]) * D + offs_d[None, :],
                dkv,
                mask=valid[:, None] & d_ok[None, :],
                sem="relaxed",
            )


def _scatter_reduce_kernel(contrib_ptr, perm_ptr, start_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    """out[r] = sum of contrib[perm[i]] for i in [start[r], start[r+1]), in that order."""
    r = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lo = tl.load(start_ptr + r)
    hi = tl.load(start_ptr + r + 1)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for i in range(lo, hi):
        e = tl.load(perm_ptr + i)
        acc += tl.load(contrib_ptr + e * D + offs_d, mask=d_ok, other=0.0)
    tl.store(out_ptr + r * D + offs_d, acc, mask=d_ok)


_fwd = Kernel(_fwd_kernel)
_combine = Kernel(_combine_kernel)
_bwd = Kernel(_bwd_kernel)
_bwd_dq = Kernel(_bwd_dq_kernel)
_bwd_dkv = Kernel(_bwd_dkv_kernel)
_scatter_reduce = Kernel(_scatter_reduce_kernel)


# ----------------------------------------------------------------------------- launch configuration
def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _block_h(h: int, cap: int = 64) -> int:
    return min(cap, max(16, triton.next_power_of_2(h)))


# (BLOCK_N, num_warps, num_stages) by phase; tuned on an H200 at d=512, 64 heads (see BENCHMARKS.md)
# TRIM (key slots are sized for the longest sequence: a shorter one's are mostly -1), H200: 778 -> 519 us for
# 2,048 causal 64-head queries over 640 slots (`scripts/bench_attn_prefill.py`)
FWD_CONFIG = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "D_SPLIT": 1, "TRIM": True}
# <= 16 heads (one 16-row head block): smaller key blocks, more programs per SM (a 16-head step 126 -> 95 us)
FWD_CONFIG_NARROW = {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "D_SPLIT": 1, "TRIM": True}
# backward "two_pass" (heads <= 64): pass 1 (dq; BWD_CONFIG) stores P and dS, pass 2 (dkv; DKV_CONFIG)
# reduces all heads per key on tensor cores before one scatter. "fused": one kernel, a scatter per head block.
BWD_CONFIG = {"mode": "two_pass", "BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1}
DKV_CONFIG = {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
FUSED_BWD_CONFIG = {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}  # 64-head blocks overflow smem
# few queries (decode): smaller head blocks first (more programs, KV re-read from L2), key splits only if
# that still leaves the device idle ("max_splits"; partial accumulators cost h*d*4 bytes per split)
DECODE_CONFIG = dict(BLOCK_H=64, BLOCK_N=32, num_warps=4, num_stages=3, max_splits=1, D_SPLIT=2, TRIM=True)
# <= 16 heads: no column split (it doubles a 16-row block's score work): 256 decode rows 52 -> 27 us
DECODE_CONFIG_NARROW = {**FWD_CONFIG_NARROW, "max_splits": 1}


def _launch_opts(cfg: dict) -> dict:
    """Launch options without the planning keys (BLOCK_H, max_splits; the forward passes TRIM itself)."""
    if interpret_mode():
        return {"BLOCK_N": 16, **({"D_SPLIT": cfg["D_SPLIT"]} if "D_SPLIT" in cfg else {})}
    return {k: v for k, v in cfg.items() if k not in ("BLOCK_H", "max_splits", "mode", "TRIM")}


def choose_splits(n_programs: int, k: int, device: torch.device, max_splits: int = 16) -> int:
    """Number of key splits per query so that the grid fills the device (1 = no split)."""
    if k <= 128:
        return 1
    target = 2 * num_sms(device)
    if n_programs >= target:
        return 1
    return int(max(1, min(triton.cdiv(target, n_programs), triton.cdiv(k, 128), max_splits)))


def plan_forward(b: int, s: int, h: int, k: int, device: torch.device) -> tuple[int, int, dict]:
    """(BLOCK_H, key splits, launch config) for a forward over b*s queries of h heads and k keys. Under
    exact accumulation (the engine's deterministic mode) the plan does not depend on b*s: the decode plan's
    key blocks (BLOCK_N) and splits would rescale a query's online softmax at other points than the
    prefill plan's, so a query's output would round differently alone and in a batch."""
    cap = 16 if interpret_mode() else None  # the CPU interpreter: small head blocks, same decisions
    narrow = h <= 16
    fwd = FWD_CONFIG_NARROW if narrow else FWD_CONFIG
    bh = _block_h(h, cap or fwd["BLOCK_H"])
    if is_exact() or b * s * triton.cdiv(h, bh) >= 2 * num_sms(device):
        return bh, 1, fwd
    dec = DECODE_CONFIG_NARROW if narrow else DECODE_CONFIG
    bh = _block_h(h, cap or dec["BLOCK_H"])
    splits = choose_splits(b * s * triton.cdiv(h, bh), k, device, dec["max_splits"])
    return bh, splits, dec


# ----------------------------------------------------------------------------- forward / backward
def sparse_attention_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    sink: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    splits: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    o_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only (no autograd). `splits=None` chooses the decode split automatically; `out` = (o, lse)
    contiguous buffers to write into; `o_lo` (like q) receives o's rounding residual for the backward."""
    b, s, h, d = q.shape
    n, k = kv.size(1), idx.size(2)
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.contiguous()
    sink = sink.float().contiguous()
    if out is None:
        o = torch.empty_like(q)
        lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    else:
        o, lse = out
        like = (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (b, s, h), torch.float32)
        if not (like and o.is_contiguous() and lse.is_contiguous()):
            raise ValueError("out must be contiguous (o like q, lse [b, s, h] fp32)")
    if b * s == 0 or h == 0:
        return o, lse
    bh, auto_splits, cfg = plan_forward(b, s, h, k, q.device)
    if splits is None:
        splits = auto_splits
    bd = _block_d(d)
    n_hb = triton.cdiv(h, bh)
    prec, dot_t = dot_precision(q.dtype), dot_type(q.dtype)
    has_lo = o_lo is not None
    lo = o_lo if has_lo else o
    if has_lo and not (o_lo.is_contiguous() and o_lo.shape == q.shape):
        raise ValueError("o_lo must be a contiguous tensor shaped like q")
    scale_log2 = float(scale) * LOG2E
    dsplit = cfg.get("D_SPLIT", 1)
    if splits <= 1:
        _fwd[(b * s, n_hb * dsplit, 1)](
            q,
            kv,
            sink,
            idx,
            o,
            lse,
            lo,
            o,
            lse,
            lse,
            s,
            h,
            k,
            n,
            d,
            scale_log2,
            k,
            1,
            BLOCK_H=bh,
            BLOCK_D=bd,
            SPLIT=False,
            PREC=prec,
            DOT_T=dot_t,
            STORE_LO=has_lo,
            TRIM=cfg.get("TRIM", False),
            **_launch_opts(cfg),
        )
        return o, lse
    per = triton.cdiv(triton.cdiv(k, splits), 16) * 16
    splits = triton.cdiv(k, per)
    pacc = torch.empty(b * s, splits, h, d, dtype=torch.float32, device=q.device)
    pm = torch.empty(b * s, splits, h, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    _fwd[(b * s, n_hb * dsplit, splits)](
        q,
        kv,
        sink,
        idx,
        o,
        lse,
        lo,
        pacc,
        pm,
        pl,
        s,
        h,
        k,
        n,
        d,
        scale_log2,
        per,
        splits,
        BLOCK_H=bh,
        BLOCK_D=bd,
        SPLIT=True,
        PREC=prec,
        DOT_T=dot_t,
        STORE_LO=False,
        TRIM=cfg.get("TRIM", False),
        **_launch_opts(cfg),
    )
    _combine[(b * s, n_hb)](
        sink,
        pacc,
        pm,
        pl,
        o,
        lse,
        lo,
        h,
        d,
        splits,
        BLOCK_H=bh,
        BLOCK_D=bd,
        STORE_LO=has_lo,
        **({} if interpret_mode() else {"num_warps": 8}),
    )
    return o, lse


def sparse_attention_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    sink: torch.Tensor,
    idx: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    deterministic: bool,
    o_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dkv, dsink) for the forward above (`o_lo`: o's rounding residual from the forward, if kept)."""
    b, s, h, d = q.shape
    n, k = kv.size(1), idx.size(2)
    q, kv, idx, o, do = q.contiguous(), kv.contiguous(), idx.contiguous(), o.contiguous(), do.contiguous()
    lse = lse.contiguous()
    sink32 = sink.float().contiguous()
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(b, n, d, dtype=torch.float32, device=q.device)
    dsink_part = torch.zeros(b * s, h, dtype=torch.float32, device=q.device)
    if b * s == 0 or h == 0:
        return dq.zero_(), dkv32.to(kv.dtype), torch.zeros_like(sink)
    two_pass = BWD_CONFIG.get("mode", "fused") == "two_pass" and h <= 64
    cfg = BWD_CONFIG if two_pass else FUSED_BWD_CONFIG
    bh, bd = _block_h(h, 16 if interpret_mode() else cfg["BLOCK_H"]), _block_d(d)
    n_hb = triton.cdiv(h, bh)
    contrib_rows = b * s * k if two_pass else b * s * n_hb * k
    contrib = torch.empty(contrib_rows, d, dtype=torch.float32, device=q.device) if deterministic else dkv32
    has_lo = o_lo is not None
    lo = o_lo.contiguous() if has_lo else o
    prec, dot_t = dot_precision(q.dtype), dot_type(q.dtype)
    if two_pass:
        p_buf = torch.empty(b * s, h, k, dtype=q.dtype, device=q.device)
        ds_buf = torch.empty_like(p_buf)
        _bwd_dq[(b * s, n_hb)](
            q,
            kv,
            sink32,
            idx,
            o,
            lo,
            do,
            lse,
            dq,
            dsink_part,
            p_buf,
            ds_buf,
            s,
            h,
            k,
            n,
            d,
            float(scale),
            BLOCK_H=bh,
            BLOCK_D=bd,
            PREC=prec,
            DOT_T=dot_t,
            HAS_LO=has_lo,
            **_launch_opts(BWD_CONFIG),
        )
        _bwd_dkv[(b * s,)](
            q,
            do,
            idx,
            p_buf,
            ds_buf,
            dkv32,
            contrib,
            s,
            h,
            k,
            n,
            d,
            BLOCK_H=_block_h(h),
            BLOCK_D=bd,
            DETERMINISTIC=deterministic,
            PREC=prec,
            DOT_T=dot_t,
            **_launch_opts(DKV_CONFIG),
        )
        n_hb = 1
    else:
        _bwd[(b * s, n_hb)](
            q,
            kv,
            sink32,
            idx,
            o,
            lo,
            do,
            lse,
            dq,
            dkv32,
            dsink_part,
            contrib,
            s,
            h,
            k,
            n,
            d,
            float(scale),
            n_hb,
            BLOCK_H=bh,
            BLOCK_D=bd,
            DETERMINISTIC=deterministic,
            PREC=prec,
            DOT_T=dot_t,
            HAS_LO=has_lo,
            **_launch_opts(FUSED_BWD_CONFIG),
        )
    if deterministic and contrib.numel() and b * n:
        # target kv row of every (query, head block, slot) contribution; -1 slots go to a dropped row
        rows = idx.long() + (torch.arange(b, device=q.device) * n).view(b, 1, 1)  # [b, s, k]
        rows = torch.where(idx >= 0, rows, b * n)
        rows = rows.view(b * s, 1, k).expand(b * s, n_hb, k).reshape(-1)
        sorted_rows, perm = torch.sort(rows, stable=True)
        start = torch.searchsorted(sorted_rows, torch.arange(b * n + 1, device=q.device))
        bdr = min(bd, 128)
        _scatter_reduce[(b * n, triton.cdiv(d, bdr))](contrib, perm, start, dkv32, d, BLOCK_D=bdr)
    dsink = dsink_part.sum(0).to(sink.dtype)
    return dq, dkv32.to(kv.dtype), dsink


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sink, idx, scale):
        # half-precision o loses ~3 digits; keeping its residual makes the backward's rowsum(o * do) as
        # accurate as the fp32 reference (without it, peaked softmaxes get ~5% error in dq)
        o_lo = torch.empty_like(q) if q.dtype != torch.float32 else None
        o, lse = sparse_attention_fwd(q, kv, sink, idx, scale, o_lo=o_lo)
        ctx.save_for_backward(q, kv, sink, idx, o, lse, o_lo)
        ctx.scale = scale
        ctx.deterministic = _ops.is_deterministic()
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):  # the gradient for lse is ignored: lse is not differentiable
        q, kv, sink, idx, o, lse, o_lo = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dkv, dsink = sparse_attention_bwd(q, kv, sink, idx, o, lse, do, ctx.scale, ctx.deterministic, o_lo)
        return (
            dq if ctx.needs_input_grad[0] else None,
            dkv if ctx.needs_input_grad[1] else None,
            dsink if ctx.needs_input_grad[2] else None,
            None,
            None,
        )


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backend of `dsv4.ops.sparse_attention` (differentiable in q, kv and sink)."""
    if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad or sink.requires_grad):
        return _SparseAttention.apply(q, kv, sink, idx, scale)
    return sparse_attention_fwd(q, kv, sink, idx, scale)


def can_run(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float) -> str | None:
    reason = device_reason(q, kv, sink, idx)
    if reason:
        return reason
    if q.dim() != 4 or kv.dim() != 3 or idx.dim() != 3 or sink.dim() != 1:
        return "expected q [b, s, h, d], kv [b, n, d], idx [b, s, k], sink [h]"
    b, s, h, d = q.shape
    if kv.size(0) != b or kv.size(2) != d or idx.shape[:2] != (b, s) or sink.size(0) != h:
        return "shape mismatch between q, kv, idx and sink"
    if q.dtype not in FLOAT_DTYPES or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (need one of bf16/fp16/fp32 for both)"
    if idx.dtype not in (torch.int32, torch.int64):
        return f"idx dtype {idx.dtype} (need int32 or int64)"
    if d > 1024:
        return f"head dim {d} > 1024"
    return None


_ops.register("sparse_attention", "triton", sparse_attention, can_run=can_run, deterministic=True, priority=10)
