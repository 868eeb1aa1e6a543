"""Triton Lightning Indexer: fused scoring, head-sum, causal visibility and top-k (the `triton` backend).

Semantics: `dsv4.ops.reference.indexer_scores` / `indexer_topk`:
`score[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])`, entries with `j >= (positions[t]+1) // ratio`
set to -inf; top-k keeps the `min(topk, n)` best visible entries, -1 in unused slots.

Design
- Scoring: one program per (batch, query tile BLOCK_M, key tile BLOCK_N). The key tile is loaded once; a
  loop over heads multiplies each head's query tile [BLOCK_M, d] with it on tensor cores, applies ReLU
  and the per-(query, head) weight and accumulates into one fp32 [BLOCK_M, BLOCK_N] tile. The
  [s, heads, n] product never exists in memory; only the head-summed [s, n] scores are written. Key tiles
  that no query of the tile can see (causal) skip the head loop and store -inf. The query tile is 128
  rows for long prompts and follows the rows a call has in small ones (`score_config`; fixed under exact
  accumulation).
- Top-k is two-stage: the fused kernel scores a chunk of query rows into a bounded fp32 buffer
  (at most ~64 Mi entries), then the reference's `select_topk` (stable descending sort: ties go to the
  lower index, -inf winners become -1) selects per row. The buffer is reused chunk by chunk, so memory
  stays bounded at any context length.
- Backward of the scores (the indexer's training loss): with `G = d loss / d score` (zero where
  invisible) and `a = q[t, h] . k[j]`:
  dweights[t, h] = sum_j G[t, j] relu(a); dq[t, h] = sum_j G[t, j] w[t, h] [a > 0] k[j];
  dk[j] = sum_{t, h} G[t, j] w[t, h] [a > 0] q[t, h]. Two kernels recompute `a`: one owns (query tile,
  head) rows and writes dq, dweights; the other owns key tiles and writes dk. No atomics: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import ops as _ops
from .. import reference as _ref
from ..precision import is_exact
from ._common import FLOAT_DTYPES, Kernel, device_reason, dot_precision, dot_type, interpret_mode, num_sms


# ----------------------------------------------------------------------------- kernels
def _score_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    pos_ptr,
    out_ptr,
    cand_ptr,
    S,
    H,
    N,
    D,
    ratio,
    row_lo,
    n_rows,
    out_bstride,
    pos_bstride,
    cand_bstride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
    INDIRECT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of this chunk
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n_rows
    n_ok = offs_n < N
    d_ok = offs_d < D
    t = (row_lo + offs_m).to(tl.int64)  # query index in the sequence
    pos = tl.load(pos_ptr + b * pos_bstride + t, mask=m_ok, other=0)  # positions [s] (stride 0) or [b, s]
    lim = tl.where(m_ok, tl.maximum(pos + 1, 0) // ratio, 0)  # visible: j < lim (position -1: none)
    seen = pid_n * BLOCK_N < tl.max(lim, 0)
    n_heads = tl.where(seen, H, 0)  # skip tiles no query can see (and do not read their keys)
    k_ok = n_ok & ((pid_n * BLOCK_N + offs_n * 0) < tl.max(lim, 0))  # [BN]
    if INDIRECT:  # a paged pool: row b's key n is pool row cand[b, n]
        krow = tl.load(cand_ptr + b * cand_bstride + offs_n, mask=k_ok, other=0).to(tl.int64)
    else:
        krow = b * N + offs_n
    kt = tl.load(k_ptr + krow[:, None] * D + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    row = (b * S + t) * H  # [BM]
    for hh in range(0, n_heads):
        qh = tl.load(
            q_ptr + (row[:, None] + hh) * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
        )  # [BM, BD]
        wh = tl.load(w_ptr + row + hh, mask=m_ok, other=0.0).to(tl.float32)  # [BM]
        a = tl.dot(qh.to(DOT_T), tl.trans(kt.to(DOT_T)), input_precision=PREC)  # [BM, BN]
        acc += tl.maximum(a, 0.0) * wh[:, None]
    vis = offs_n[None, :] < lim[:, None]
    out = tl.where(vis, acc, float("-inf"))
    tl.store(out_ptr + b * out_bstride + offs_m[:, None] * N + offs_n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def _bwd_q_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    pos_ptr,
    g_ptr,
    dq_ptr,
    dw_ptr,
    S,
    H,
    N,
    D,
    ratio,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
):
    pid_m = tl.program_id(0)
    hh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < S
    d_ok = offs_d < D
    t = offs_m.to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=m_ok, other=0)
    lim = tl.where(m_ok, tl.minimum((pos + 1) // ratio, N), 0)
    row = (b * S + t) * H + hh  # [BM]
    qh = tl.load(q_ptr + row[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    wh = tl.load(w_ptr + row, mask=m_ok, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dw = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, tl.max(lim, 0), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        kt = tl.load(
            k_ptr + (b * N + offs_n[:, None]) * D + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
        )  # [BN, BD]
        vis = offs_n[None, :] < lim[:, None]
        g = tl.load(g_ptr + (b * S + t[:, None]) * N + offs_n[None, :], mask=vis, other=0.0)  # [BM, BN]
        a = tl.dot(qh.to(DOT_T), tl.trans(kt.to(DOT_T)), input_precision=PREC)
        dw += tl.sum(g * tl.maximum(a, 0.0), 1)
        ga = tl.where(a > 0.0, g * wh[:, None], 0.0)
        dq += tl.dot(ga.to(kt.dtype).to(DOT_T), kt.to(DOT_T), input_precision=PREC)
    tl.store(
        dq_ptr + row[:, None] * D + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :]
    )
    tl.store(dw_ptr + row, dw.to(dw_ptr.dtype.element_ty), mask=m_ok)


def _bwd_k_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    pos_ptr,
    g_ptr,
    dk_ptr,
    S,
    H,
    N,
    D,
    ratio,
    B,
    rows_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """Partial dk of key tile pid_n from the queries of split pid_split -> dk_ptr[pid_split, b] (fp32)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_split = tl.program_id(2).to(tl.int64)
    m_lo = pid_split * rows_per_split
    m_hi = tl.minimum(m_lo + rows_per_split, S)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < D
    kt = tl.load(
        k_ptr + (b * N + offs_n[:, None]) * D + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
    )  # [BN, BD]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for mstart in range(m_lo, m_hi, BLOCK_M):
        offs_m = mstart + tl.arange(0, BLOCK_M)
        m_ok = offs_m < m_hi
        t = offs_m.to(tl.int64)
        pos = tl.load(pos_ptr + t, mask=m_ok, other=0)
        lim = tl.where(m_ok, (pos + 1) // ratio, 0)
        vis = (offs_n[None, :] < lim[:, None]) & n_ok[None, :]
        g = tl.load(g_ptr + (b * S + t[:, None]) * N + offs_n[None, :], mask=vis, other=0.0)  # [BM, BN]
        n_heads = tl.where(pid_n * BLOCK_N < tl.max(lim, 0), H, 0)
        for hh in range(0, n_heads):
            row = (b * S + t) * H + hh
            qh = tl.load(
                q_ptr + row[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
            )  # [BM, BD]
            wh = tl.load(w_ptr + row, mask=m_ok, other=0.0).to(tl.float32)
            a = tl.dot(qh.to(DOT_T), tl.trans(kt.to(DOT_T)), input_precision=PREC)  # [BM, BN]
            ga = tl.where(a > 0.0, g * wh[:, None], 0.0)
            dk += tl.dot(tl.trans(ga.to(qh.dtype).to(DOT_T)), qh.to(DOT_T), input_precision=PREC)
    tl.store(
        dk_ptr + ((pid_split * B + b) * N + offs_n[:, None]) * D + offs_d[None, :],
        dk,
        mask=n_ok[:, None] & d_ok[None, :],
    )


_score = Kernel(_score_kernel)
_bwd_q = Kernel(_bwd_q_kernel)
_bwd_k = Kernel(_bwd_k_kernel)

# tuned on an H200 at 64 heads x 128 dims (see BENCHMARKS.md)
SCORE_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
BWD_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
MAX_CHUNK_ENTRIES = 1 << 26  # top-k scores buffer bound (fp32 entries)


def _opts(cfg: dict, keep_m: bool = False) -> dict:
    """Launch options; on the interpreter small key tiles (and query tiles unless keep_m: the scoring
    kernel's tile choice is tested there too)."""
    if interpret_mode():
        return {"BLOCK_M": cfg["BLOCK_M"] if keep_m else 16, "BLOCK_N": 16}
    return dict(cfg)


def score_config(b: int, rows: int, n: int, sms: int) -> dict:
    """The scoring kernel's tiles for b batches of `rows` query rows against n keys on `sms` SMs.

    The full tile (SCORE_CONFIG) suits long prompts. A serving step's groups are small: a decode group is b
    sequences of one row each (a 128-row tile would multiply 127 rows of padding per head), a prompt
    chunk is a few slots of 64 rows against few entries (a handful of programs). So the query tile shrinks
    to the rows there are (at least 16, what tl.dot takes), and further while the grid is under one
    program per SM. Under exact accumulation the full tile stays: a plan that depends on the call's size
    would let a row's scores round differently alone and in a batch."""
    if is_exact():
        return dict(SCORE_CONFIG)
    bm = min(SCORE_CONFIG["BLOCK_M"], max(16, triton.next_power_of_2(max(1, rows))))
    tiles_n = triton.cdiv(n, SCORE_CONFIG["BLOCK_N"])
    while bm > 16 and b * triton.cdiv(rows, bm) * tiles_n < sms:
        bm //= 2
    if bm == SCORE_CONFIG["BLOCK_M"]:
        return dict(SCORE_CONFIG)
    return {**SCORE_CONFIG, "BLOCK_M": bm, "num_warps": 4}


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


# ----------------------------------------------------------------------------- forward / backward
def _scores_rows(
    q,
    k,
    weights,
    positions,
    ratio: int,
    row_lo: int,
    n_rows: int,
    out: torch.Tensor | None = None,
    cand: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of query rows [row_lo, row_lo + n_rows) -> [b, n_rows, n] fp32 (contiguous inputs).

    `out` may be a view whose rows are contiguous (e.g. `buf[:, :rows]` of a [b, chunk, n] buffer). cand
    [b, n] (rows contiguous): k is a pool [rows, d] read through it (`indexer_topk`'s paged form)."""
    b, s, h, d = q.shape
    n = k.size(1) if cand is None else cand.size(1)
    if out is None:
        out = torch.empty(b, n_rows, n, dtype=torch.float32, device=q.device)
    if (
        out.shape != (b, n_rows, n)
        or out.dtype != torch.float32
        or (n_rows > 1 and out.stride(1) != n)
        or (n > 1 and out.stride(2) != 1)
    ):
        raise ValueError("out must be [b, rows, n] fp32 with contiguous rows")
    if b * n_rows * n == 0:
        return out
    cfg = _opts(score_config(b, n_rows, n, num_sms(q.device)), keep_m=True)
    grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), b)
    pos_bstride = positions.stride(0) if positions.dim() == 2 else 0
    _score[grid](
        q,
        k,
        weights,
        positions,
        out,
        out if cand is None else cand,
        s,
        h,
        n,
        d,
        int(ratio),
        row_lo,
        n_rows,
        out.stride(0),
        pos_bstride,
        0 if cand is None else cand.stride(0),
        BLOCK_D=_block_d(d),
        PREC=dot_precision(q.dtype),
        DOT_T=dot_type(q.dtype),
        INDIRECT=cand is not None,
        **cfg,
    )
    return out


def indexer_scores_fwd(q, k, weights, positions, ratio: int) -> torch.Tensor:
    q, k, weights, positions = q.contiguous(), k.contiguous(), weights.contiguous(), positions.contiguous()
    return _scores_rows(q, k, weights, positions, ratio, 0, q.size(1))


def indexer_scores_bwd(q, k, weights, positions, ratio: int, g: torch.Tensor):
    """(dq, dk, dweights) for `d loss / d score = g` [b, s, n]."""
    q, k, weights, positions = q.contiguous(), k.contiguous(), weights.contiguous(), positions.contiguous()
    g = g.float().contiguous()
    b, s, h, d = q.shape
    n = k.size(1)
    dq = torch.empty_like(q)
    dw = torch.empty_like(weights)
    if b * s * n * h == 0:
        return dq.zero_(), torch.zeros_like(k), dw.zero_()
    cfg = _opts(BWD_CONFIG)
    common = {"BLOCK_D": _block_d(d), "PREC": dot_precision(q.dtype), "DOT_T": dot_type(q.dtype), **cfg}
    _bwd_q[(triton.cdiv(s, cfg["BLOCK_M"]), h, b)](
        q, k, weights, positions, g, dq, dw, s, h, n, d, int(ratio), **common
    )
    # key tiles alone are too few programs to fill the device: split the queries too and sum the parts
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"]) * b
    splits = max(1, min(triton.cdiv(2 * num_sms(q.device), n_tiles), triton.cdiv(s, cfg["BLOCK_M"])))
    rows = triton.cdiv(triton.cdiv(s, splits), cfg["BLOCK_M"]) * cfg["BLOCK_M"]
    splits = triton.cdiv(s, rows)
    dk_part = torch.empty(splits, b, n, d, dtype=torch.float32, device=q.device)
    _bwd_k[(triton.cdiv(n, cfg["BLOCK_N"]), b, splits)](
        q, k, weights, positions, g, dk_part, s, h, n, d, int(ratio), b, rows, **common
    )
    dk = dk_part.sum(0).to(k.dtype)
    return dq, dk, dw


class _IndexerScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, weights, positions, ratio):
        ctx.save_for_backward(q, k, weights, positions)
        ctx.ratio = ratio
        return indexer_scores_fwd(q, k, weights, positions, ratio)

    @staticmethod
    def backward(ctx, g):
        q, k, weights, positions = ctx.saved_tensors
        dq, dk, dw = indexer_scores_bwd(q, k, weights, positions, ctx.ratio, g)
        need = ctx.needs_input_grad
        return dq if need[0] else None, dk if need[1] else None, dw if need[2] else None, None, None


def indexer_scores(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, ratio: int
) -> torch.Tensor:
    """Triton backend of `dsv4.ops.indexer_scores` (differentiable in q, k and weights)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or weights.requires_grad):
        return _IndexerScores.apply(q, k, weights, positions, ratio)
    return indexer_scores_fwd(q, k, weights, positions, ratio)


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    topk: int,
    cand: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton backend of `dsv4.ops.indexer_topk`: chunked fused scoring, then per-row top-k. With cand the
    keys are read from the pool through it (no gathered copy, and no key of a tile no query sees)."""
    with torch.no_grad():
        q, k, weights = q.contiguous(), k.contiguous(), weights.contiguous()
        positions = positions.contiguous()
        b, s, h, d = q.shape
        n = k.size(1) if cand is None else cand.size(1)
        kk = min(topk, n)
        out = torch.empty(b, s, kk, dtype=torch.int64, device=q.device)
        if b * s == 0 or kk == 0:
            return out
        chunk = max(1, min(s, MAX_CHUNK_ENTRIES // max(1, b * n)))
        buf = torch.empty(b, chunk, n, dtype=torch.float32, device=q.device)
        for lo in range(0, s, chunk):
            rows = min(chunk, s - lo)
            score = _scores_rows(q, k, weights, positions, ratio, lo, rows, out=buf[:, :rows], cand=cand)
            out[:, lo : lo + rows] = _ref.select_topk(score, kk)
        return out


def _can_run(
    q, k, weights, positions, ratio, *_args, row_positions: bool = False, k_shape: tuple | None = None
) -> str | None:
    """k_shape: the keys' [b, n, d] where k is a pool read through candidates (`can_run_topk`)."""
    reason = device_reason(q, k, weights, positions)
    if reason:
        return reason
    k_shape = tuple(k.shape) if k_shape is None else k_shape
    if (
        q.dim() != 4
        or len(k_shape) != 3
        or weights.dim() != 3
        or positions.dim() not in ((1, 2) if row_positions else (1,))
    ):
        return "expected q [b, s, h, d], k [b, n, d], weights [b, s, h], positions [s]" + (
            " or [b, s]" if row_positions else " (per-row positions [b, s]: top-k only)"
        )
    b, s, h, d = q.shape
    if (
        k_shape[0] != b
        or k_shape[2] != d
        or weights.shape != (b, s, h)
        or positions.shape[-1] != s
        or (positions.dim() == 2 and positions.size(0) != b)
    ):
        return "shape mismatch between q, k, weights and positions"
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or weights.dtype not in FLOAT_DTYPES:
        return f"dtypes q={q.dtype} k={k.dtype} weights={weights.dtype} (q, k: one of bf16/fp16/fp32)"
    if positions.dtype not in (torch.int32, torch.int64):
        return f"positions dtype {positions.dtype} (need int32 or int64)"
    if d > 256:
        return f"head dim {d} > 256"
    if int(ratio) < 1:
        return f"ratio {ratio} < 1"
    return None


def can_run_scores(q, k, weights, positions, ratio) -> str | None:
    return _can_run(q, k, weights, positions, ratio)


def can_run_topk(q, k, weights, positions, ratio, topk, cand=None) -> str | None:
    if cand is None:
        return _can_run(q, k, weights, positions, ratio, row_positions=True)
    reason = device_reason(q, k, weights, positions, cand)
    if reason:
        return reason
    if k.dim() != 2 or cand.dim() != 2 or cand.dtype != torch.int64 or (cand.size(1) > 1 and cand.stride(1) != 1):
        got = f"{tuple(k.shape)}, {tuple(cand.shape)} {cand.dtype}"
        return f"a paged call needs keys [rows, d] and cand [b, n] int64 with contiguous rows, got {got}"
    # the rest as for the gathered keys k[cand] [b, n, d] (checked by their shape, not gathered)
    return _can_run(q, k, weights, positions, ratio, row_positions=True, k_shape=(*cand.shape, k.size(1)))


_ops.register("indexer_scores", "triton", indexer_scores, can_run=can_run_scores, deterministic=True, priority=10)
_ops.register("indexer_topk", "triton", indexer_topk, can_run=can_run_topk, deterministic=True, priority=10)
