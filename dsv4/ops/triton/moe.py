"""Triton grouped GEMM for the routed experts (`moe_experts` backend "triton").

All local experts run in one launch per projection. Slots are sorted by expert on the device by a
counting sort in two launches (`triton_moe_plan`: per-chunk bucket counts, then prefix sums and a stable
scatter; the same plan as `dsv4.ops.moe_shared.moe_plan`, bit for bit, without its ~20 sort and
index launches); the second launch also writes the tile table that maps each GEMM program to
(expert, first row), so no routing count ever reaches the host. The grid is sized for the worst case
(ceil(T*k / BM) + E + 1 row tiles); surplus programs exit at once. Slots of experts owned by other ranks
form a last bucket whose rows the kernel writes as zeros, so no output row is left uninitialised
(docs/bugzoo.md Z09).

Inference (no gradient needed) runs two kernels: gate+up with the gather of token rows, the clamped
SwiGLU and the routing weight fused in, then the down projection, which scatters each row back to its
(token, k) slot; one more launch sums the k slots of a token in slot order, in fp32. Training runs the same
gather and scatter GEMMs inside autograd.Functions with the SwiGLU kernel between them (dX with transposed
weight strides, scattered to the slots and summed per token the same way), plus a weight-gradient kernel
that reduces each expert's rows serially; no atomics anywhere, so repeats are bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fp8_round_trip, register
from ..moe_shared import (
    MoEPlan,
    act_round_trip,
    gate_dtype,
    moe_plan,
    register_plan_builder,
)
from ..precision import is_exact
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import device_reason, mma, round_to
from ._mm_utils import launch as _launch
from .swiglu import triton_clamped_swiglu


@triton.jit
def _gmm_kernel(
    a_ptr,
    a_idx_ptr,
    b_ptr,
    b2_ptr,
    c_ptr,
    c_idx_ptr,
    w_ptr,
    tile_group_ptr,
    tile_row_ptr,
    tile_end_ptr,
    N,
    K,
    n_groups,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    limit,
    GATHER_A: tl.constexpr,
    SCATTER_C: tl.constexpr,
    SWIGLU: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr = False,
    ROUND_GATE: tl.constexpr = True,
):
    """C[r] = A[r] @ B[g] for the rows r of group g; SWIGLU: silu(min(A B, L)) * clamp(A B2, +-L) * w[r]
    (gate and up rounded to A's dtype first when ROUND_GATE, kept in fp32 for fp16: `gate_dtype`)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.load(tile_group_ptr + pid_m)
    row0 = tl.load(tile_row_ptr + pid_m)
    rend = tl.load(tile_end_ptr + pid_m)
    if row0 >= rend:
        return
    rows = row0 + tl.arange(0, BM)
    rmask = rows < rend
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    if SCATTER_C:
        out_rows = tl.load(c_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    c_ptrs = c_ptr + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn
    smask = rmask[:, None] & cmask[None, :]
    if g >= n_groups:  # slots of other ranks' experts: defined zeros, never garbage
        tl.store(c_ptrs, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=smask)
        return
    if GATHER_A:
        a_rows = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_off = g.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + b_off, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST)
        if SWIGLU:
            b2 = tl.load(b2_ptr + b_off, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc2 = mma(a, b2, acc2, UPCAST)
        a_ptrs += BK * stride_ak
        b_off += BK * stride_bk
    if SWIGLU:
        # the projections round to the activation dtype first, as a plain linear layer would (bf16; fp16
        # keeps them in fp32, see moe_shared.gate_dtype)
        gate = acc
        up = acc2
        if ROUND_GATE:
            gate = round_to(acc, a_ptr.dtype.element_ty, UPCAST).to(tl.float32)
            up = round_to(acc2, a_ptr.dtype.element_ty, UPCAST).to(tl.float32)
        if limit > 0:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
        acc = gate * tl.sigmoid(gate) * up * w[:, None]
    tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty, UPCAST), mask=smask)


@triton.jit
def _gmm_wgrad_kernel(
    a_ptr,
    g_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    N,
    K,
    stride_am,
    stride_ak,
    stride_gm,
    stride_gn,
    stride_oe,
    stride_ok,
    stride_on,
    BR: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    UPCAST: tl.constexpr = False,
):
    """out[e] = A[rows of e]^T @ G[rows of e], rows reduced serially (deterministic)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.program_id(2)
    start = tl.load(starts_ptr + e)
    end = tl.load(ends_ptr + e)
    ks = pid_k * BK + tl.arange(0, BK)
    ns = pid_n * BN + tl.arange(0, BN)
    kmask = ks < K
    nmask = ns < N
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for r0 in range(start, end, BR):
        rs = r0 + tl.arange(0, BR)
        rmask = rs < end
        a = tl.load(
            a_ptr + rs[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )  # [BR, BK]
        gr = tl.load(
            g_ptr + rs[:, None].to(tl.int64) * stride_gm + ns[None, :] * stride_gn,
            mask=rmask[:, None] & nmask[None, :],
            other=0.0,
        )  # [BR, BN]
        acc = mma(tl.trans(a), gr, acc, UPCAST)
    o_ptrs = out_ptr + e.to(tl.int64) * stride_oe + ks[:, None] * stride_ok + ns[None, :] * stride_on
    tl.store(o_ptrs, round_to(acc, out_ptr.dtype.element_ty, UPCAST), mask=kmask[:, None] & nmask[None, :])


_GMM_CONFIGS = [
    triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in ((128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4), (256, 64, 8, 3))
]
_SWIGLU_CONFIGS = [
    triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in ((64, 64, 4, 4), (64, 64, 8, 3), (128, 64, 8, 3))
]
_WGRAD_CONFIGS = [
    triton.Config({"BK": bk, "BN": bn, "BR": br}, num_warps=w, num_stages=s)
    for bk, bn, br, w, s in ((128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 32, 4, 4))
]
_gmm_tuned = triton.autotune(_GMM_CONFIGS, key=["N", "K", "BM", "SCATTER_C", "GATHER_A"])(_gmm_kernel)
_swiglu_tuned = triton.autotune(_SWIGLU_CONFIGS, key=["N", "K", "BM"])(_gmm_kernel)
_wgrad_tuned = triton.autotune(_WGRAD_CONFIGS, key=["N", "K"])(_gmm_wgrad_kernel)


# ----------------------------------------------------------------------------- tile table (device side)
@triton.jit
def _tile_groups(start_g, end_g, BM: tl.constexpr):
    """Each group's first tile and the end of its tiles (exclusive), given its rows [start_g, end_g)."""
    tiles_g = (end_g - start_g + BM - 1) // BM
    cum = tl.cumsum(tiles_g, 0)
    return cum - tiles_g, cum


@triton.jit
def _store_tiles_of(
    group_ptr, row_ptr, end_ptr, ts, gs, start_g, end_g, first, cum, n_groups, n_tiles, BM: tl.constexpr
):
    """Tiles ts -> (group, first row, group end), given `_tile_groups`' first / cum of the groups."""
    hit = (ts[:, None] >= first[None, :]) & (ts[:, None] < cum[None, :])  # [TB, GP] one-hot
    found = tl.sum(hit.to(tl.int32), 1) > 0
    g = tl.sum(tl.where(hit, gs[None, :], 0), 1)
    row = ts * BM + tl.sum(tl.where(hit, (start_g - first * BM)[None, :], 0), 1)
    end = tl.sum(tl.where(hit, end_g[None, :], 0), 1)
    tmask = ts < n_tiles
    tl.store(group_ptr + ts, tl.where(found, g, n_groups + 1), mask=tmask)
    tl.store(row_ptr + ts, tl.where(found, row, 0), mask=tmask)
    tl.store(end_ptr + ts, tl.where(found, end, 0), mask=tmask)


@triton.jit
def _store_tiles(group_ptr, row_ptr, end_ptr, ts, gs, start_g, end_g, n_groups, n_tiles, BM: tl.constexpr):
    """Tiles ts -> (group, first row, group end), given each group's rows [start_g, end_g)."""
    first, cum = _tile_groups(start_g, end_g, BM)
    _store_tiles_of(group_ptr, row_ptr, end_ptr, ts, gs, start_g, end_g, first, cum, n_groups, n_tiles, BM)


@triton.jit
def _tile_table_kernel(
    ends_ptr,
    group_ptr,
    row_ptr,
    end_ptr,
    n_rows,
    n_groups,
    n_tiles,
    BM: tl.constexpr,
    GP: tl.constexpr,
    TB: tl.constexpr,
):
    """Tile t -> (group, first row, group end): groups 0..E-1 are the local experts, E the foreign bucket."""
    gs = tl.arange(0, GP)
    end_g = tl.load(ends_ptr + gs, mask=gs < n_groups, other=n_rows)  # bucket E ends at M
    start_g = tl.load(ends_ptr + gs - 1, mask=(gs >= 1) & (gs <= n_groups), other=0)
    start_g = tl.where(gs > n_groups, n_rows, start_g)  # padding: no rows
    ts = tl.program_id(0) * TB + tl.arange(0, TB)
    _store_tiles(group_ptr, row_ptr, end_ptr, ts, gs, start_g, end_g, n_groups, n_tiles, BM)


_TILE_TB = 32  # tiles per block of the table


class _Tiles:
    """Row tiles of BM rows per group (local experts, then the foreign bucket), built on the device in
    one launch (or by the routing plan's last kernel, which passes `table`): no routing count reaches
    the host."""

    def __init__(self, ends: torch.Tensor, n_rows: int, bm: int, table: torch.Tensor | None = None):
        e = ends.numel()
        self.ends = ends.to(torch.int32).contiguous()
        self.n_tiles = _n_tiles(n_rows, bm, e)
        if table is None:
            table = torch.empty(3, self.n_tiles, dtype=torch.int32, device=ends.device)
            _launch(
                _tile_table_kernel,
                (triton.cdiv(self.n_tiles, _TILE_TB),),
                self.ends,
                table[0],
                table[1],
                table[2],
                n_rows,
                e,
                self.n_tiles,
                BM=bm,
                GP=triton.next_power_of_2(e + 2),
                TB=_TILE_TB,
            )
        self.group, self.row, self.end = table[0], table[1], table[2]
        self.n_groups = e
        self.bm = bm

    @property
    def starts(self) -> torch.Tensor:
        return torch.cat([self.ends.new_zeros(1), self.ends[:-1]])


def _n_tiles(n_rows: int, bm: int, n_groups: int) -> int:
    """The tiles a grouped GEMM launches for n_rows rows in n_groups groups plus the foreign bucket: an upper
    bound known without reading the routing. A bucket of r rows takes ceil(r / bm) <= r / bm + 1 tiles and
    at most min(n_rows, n_groups + 1) buckets hold rows, so the tiles are at most cdiv(n_rows, bm) + that
    (a decode step's few rows then launch a few tiles, not one per expert: 7 of 258 at one token and 256
    experts). The unused tail of the table is marked empty."""
    return max(1, triton.cdiv(n_rows, bm) + min(n_rows, n_groups + 1))


# ----------------------------------------------------------------------------- routing plan (device side)
@triton.jit
def _slot_keys(idx_ptr, slots, smask, n_local, expert_offset):
    """Bucket of each slot: its local expert, or n_local for experts of other ranks (and padding)."""
    local = tl.load(idx_ptr + slots, mask=smask, other=-1).to(tl.int64) - expert_offset
    valid = (local >= 0) & (local < n_local) & smask
    return tl.where(valid, local, n_local).to(tl.int32), valid


@triton.jit
def _plan_count_kernel(
    idx_ptr, counts_ptr, n_slots, n_local, expert_offset, CH: tl.constexpr, S: tl.constexpr, EP: tl.constexpr
):
    """counts[c, b] = number of slots of chunk c (CH slots) in bucket b (E + 1 buckets, padded to EP)."""
    c = tl.program_id(0)
    hist = tl.zeros((EP,), dtype=tl.int32)
    for s0 in range(0, CH, S):
        slots = c * CH + s0 + tl.arange(0, S)
        smask = slots < n_slots
        key, _ = _slot_keys(idx_ptr, slots, smask, n_local, expert_offset)
        hist += tl.histogram(key, EP, mask=smask)
    tl.store(counts_ptr + c * EP + tl.arange(0, EP), hist)


@triton.jit
def _plan_scatter_kernel(
    idx_ptr,
    w_ptr,
    counts_ptr,
    next_ptr,
    order_ptr,
    token_ptr,
    valid_ptr,
    weight_ptr,
    ends_ptr,
    group_ptr,
    row_ptr,
    tend_ptr,
    n_slots,
    n_chunks,
    n_local,
    expert_offset,
    topk,
    n_tiles,
    n_progs,
    CH: tl.constexpr,
    S: tl.constexpr,
    EP: tl.constexpr,
    CT: tl.constexpr,
    TILES: tl.constexpr,
    BM: tl.constexpr,
    TB: tl.constexpr,
):
    """Stable counting sort: chunk c writes its slots at base[b] + (slots of b in chunks < c) + rank.
    TILES: the n_progs >= n_chunks programs also write the grouped GEMM's tile table (blocks c, c +
    n_progs, ...; programs past the chunks write tiles only: at a few slots and many experts one chunk
    would otherwise walk the whole table alone)."""
    c = tl.program_id(0)
    bs = tl.arange(0, EP)
    total = tl.zeros((EP,), dtype=tl.int32)
    before = tl.zeros((EP,), dtype=tl.int32)
    for c0 in range(0, n_chunks, CT):
        rows = c0 + tl.arange(0, CT)
        tile = tl.load(
            counts_ptr + rows[:, None] * EP + bs[None, :], mask=(rows < n_chunks)[:, None], other=0
        )  # [CT, EP]
        total += tl.sum(tile, 0)
        before += tl.sum(tl.where((rows < c)[:, None], tile, 0), 0)
    incl = tl.cumsum(total, 0)  # [EP]
    if c == 0:
        tl.store(ends_ptr + bs, incl, mask=bs < n_local)
    if TILES:  # bucket b holds rows [incl - total, incl); padding buckets are empty
        first, cum = _tile_groups(incl - total, incl, BM)
        for t0 in range(c * TB, n_tiles, n_progs * TB):
            ts = t0 + tl.arange(0, TB)
            _store_tiles_of(group_ptr, row_ptr, tend_ptr, ts, bs, incl - total, incl, first, cum, n_local, n_tiles, BM)
    if c >= n_chunks:
        return
    # next[c, b]: the sorted position the chunk's next slot of bucket b goes to
    nxt = next_ptr + c * EP
    tl.store(nxt + bs, incl - total + before)
    tl.debug_barrier()
    ii = tl.arange(0, S)
    earlier = ii[None, :] < ii[:, None]  # [S, S]: j < i
    for s0 in range(0, CH, S):
        slots = c * CH + s0 + ii
        smask = slots < n_slots
        key, valid = _slot_keys(idx_ptr, slots, smask, n_local, expert_offset)
        same = (key[:, None] == key[None, :]) & smask[None, :]  # [S, S]
        rank = tl.sum((same & earlier).to(tl.int32), 1)  # stable, in slot order
        count = tl.sum(same.to(tl.int32), 1)
        pos = tl.load(nxt + key, mask=smask, other=0) + rank
        tl.debug_barrier()  # every lane has read next[] before it moves on
        tl.store(nxt + key, pos + 1, mask=smask & (rank == count - 1))
        tl.store(order_ptr + pos, slots.to(tl.int64), mask=smask)
        tl.store(token_ptr + pos, (slots // topk).to(tl.int64), mask=smask)
        tl.store(valid_ptr + pos, valid.to(tl.uint8), mask=smask)
        w = tl.load(w_ptr + slots, mask=smask, other=0.0).to(tl.float32)
        tl.store(weight_ptr + pos, w, mask=smask)
        tl.debug_barrier()


_PLAN_S = 64  # slots ranked at once ([S, S] comparisons)
_PLAN_CT = 8192  # elements of one [chunks, buckets] tile of counts read back
_PLAN_MAX_BUCKETS = 2048  # beyond this many local experts the [*, buckets] tiles get too wide: sort
_PLAN_TABLE_PROGRAMS = 64  # programs that share the tile table's blocks, at most


def triton_moe_plan(weights: torch.Tensor, indices: torch.Tensor, n_local: int, expert_offset: int) -> MoEPlan:
    """`moe_plan` as a counting sort in two launches: per-chunk bucket counts, then prefix sums and a
    stable scatter. Same plan bit for bit; every buffer has T*k entries and nothing reaches the host."""
    return _plan_and_tiles(weights, indices, n_local, expert_offset, None)[0]


def _plan_and_tiles(
    weights: torch.Tensor, indices: torch.Tensor, n_local: int, expert_offset: int, bm: int | None
) -> tuple[MoEPlan, _Tiles | None]:
    """The plan, plus (bm given) the tile table of BM-row tiles, written by the same two launches."""
    t, k = indices.shape
    n = t * k
    if n_local + 1 > _PLAN_MAX_BUCKETS:
        plan = moe_plan(weights, indices, n_local, expert_offset)
        return plan, (_Tiles(plan.ends, n, bm) if bm else None)
    dev = indices.device
    idx = indices.contiguous()
    w = weights.contiguous()
    ep = triton.next_power_of_2(n_local + 1)  # buckets: local experts + the foreign one
    # chunks: enough for parallelism, few enough that every chunk can re-read all counts cheaply
    max_chunks = max(16, 16384 // ep)
    ch = max(_PLAN_S, triton.cdiv(triton.cdiv(max(n, 1), max_chunks), _PLAN_S) * _PLAN_S)
    n_chunks = max(1, triton.cdiv(n, ch))
    counts = torch.empty(2, n_chunks, ep, dtype=torch.int32, device=dev)  # counts, next positions
    order = torch.empty(n, dtype=torch.int64, device=dev)
    token = torch.empty(n, dtype=torch.int64, device=dev)
    valid = torch.empty(n, dtype=torch.uint8, device=dev)
    weight = torch.empty(n, dtype=torch.float32, device=dev)
    ends = torch.empty(n_local, dtype=torch.int32, device=dev)
    n_tiles = _n_tiles(n, bm, n_local) if bm else 0
    table = torch.empty(3, max(n_tiles, 1), dtype=torch.int32, device=dev)
    _launch(
        _plan_count_kernel, (n_chunks,), idx, counts[0], n, n_local, expert_offset, CH=ch, S=_PLAN_S, EP=ep, num_warps=4
    )
    tb = max(4, min(32, 4096 // ep))  # tiles per block of the table
    n_progs = max(n_chunks, min(triton.cdiv(n_tiles, tb), _PLAN_TABLE_PROGRAMS)) if bm else n_chunks
    _launch(
        _plan_scatter_kernel,
        (n_progs,),
        idx,
        w,
        counts[0],
        counts[1],
        order,
        token,
        valid,
        weight,
        ends,
        table[0],
        table[1],
        table[2],
        n,
        n_chunks,
        n_local,
        expert_offset,
        k,
        n_tiles,
        n_progs,
        CH=ch,
        S=_PLAN_S,
        EP=ep,
        CT=max(1, _PLAN_CT // ep),
        TILES=bool(bm),
        BM=bm or 1,
        TB=tb,
        num_warps=4,
        num_stages=1,
    )  # no software pipelining: next[] is re-read after each block's stores
    if torch.is_grad_enabled() and weights.requires_grad:  # same values, but differentiable
        weight = weights.reshape(-1).float()[order]
    plan = MoEPlan(order=order, token=token, valid=valid.view(torch.bool), weight=weight, ends=ends, n_tokens=t, topk=k)
    return plan, (_Tiles(ends, n, bm, table) if bm else None)


def _block_m(n_rows: int, n_groups: int) -> int:
    """Row tile of the grouped GEMM. Under exact accumulation (the engine's deterministic mode) one tile
    whatever the batch: the autotuned launch config is keyed on it, so another tile can mean another
    K order for the same row."""
    if is_exact():
        return 64
    return 64 if n_rows < 128 * n_groups or _INTERPRET else 128


def _launch_gmm(
    a: torch.Tensor,
    b: torch.Tensor,
    tiles: _Tiles,
    out: torch.Tensor,
    *,
    a_idx: torch.Tensor | None = None,
    c_idx: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    w: torch.Tensor | None = None,
    limit: float = 0.0,
) -> None:
    """out[rows of g] = a[rows] @ b[g] (b [E, K, N], any strides), or the fused SwiGLU when b2 is given."""
    k, n = b.shape[1], b.shape[2]
    swiglu = b2 is not None
    if swiglu:
        assert b2.stride() == b.stride()
    dummy = tiles.group
    args = (
        a,
        a_idx if a_idx is not None else dummy,
        b,
        b2 if swiglu else b,
        out,
        c_idx if c_idx is not None else dummy,
        w if w is not None else a,
        tiles.group,
        tiles.row,
        tiles.end,
        n,
        k,
        tiles.n_groups,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        float(limit),
    )
    flags = dict(
        GATHER_A=a_idx is not None,
        SCATTER_C=c_idx is not None,
        SWIGLU=swiglu,
        BM=tiles.bm,
        ROUND_GATE=gate_dtype(a.dtype) == a.dtype,
    )
    if _INTERPRET:
        _launch(_gmm_kernel, (triton.cdiv(n, 32), tiles.n_tiles), *args, **flags, BN=32, BK=32, UPCAST=True)
        return
    kern = _swiglu_tuned if swiglu else _gmm_tuned
    kern[lambda meta: (triton.cdiv(n, meta["BN"]), tiles.n_tiles)](*args, **flags)


def _launch_wgrad(a: torch.Tensor, g: torch.Tensor, tiles: _Tiles, out: torch.Tensor) -> None:
    k, n = a.size(1), g.size(1)
    args = (
        a,
        g,
        out,
        tiles.starts,
        tiles.ends,
        n,
        k,
        a.stride(0),
        a.stride(1),
        g.stride(0),
        g.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
    )
    if _INTERPRET:
        grid = (triton.cdiv(n, 32), triton.cdiv(k, 32), tiles.n_groups)
        _launch(_gmm_wgrad_kernel, grid, *args, BR=32, BK=32, BN=32, UPCAST=True)
        return
    _wgrad_tuned[lambda meta: (triton.cdiv(n, meta["BN"]), triton.cdiv(k, meta["BK"]), tiles.n_groups)](*args)


class _GatherGateUp(torch.autograd.Function):
    """gate, up = x[token[r]] @ b1[g], x[token[r]] @ b3[g] for the sorted rows r of group g, the token rows
    gathered in the kernel (no [T*k, D] copy; rows of other ranks' experts are zeros). b1, b3 [E, D, I].
    Backward: a token's input gradient is its k slots' dgate b1^T + dup b3^T, both products written in
    fp32 to the slot's two rows and summed per token in slot order (`sum_slots`), rounded once; the
    weight gradients read the gathered rows, made once."""

    @staticmethod
    def forward(ctx, x, b1, b3, token, order, tiles, topk):
        x = x.contiguous()
        gate = torch.empty(token.numel(), b1.size(2), dtype=x.dtype, device=x.device)  # [M, I]
        up = torch.empty_like(gate)
        _launch_gmm(x, b1, tiles, gate, a_idx=token)
        _launch_gmm(x, b3, tiles, up, a_idx=token)
        ctx.save_for_backward(x, b1, b3, token, order)
        ctx.tiles = tiles
        ctx.slots_per_token = topk
        return gate, up

    @staticmethod
    def backward(ctx, g_gate, g_up):
        x, b1, b3, token, order = ctx.saved_tensors
        tiles = ctx.tiles
        g_gate, g_up = g_gate.contiguous(), g_up.contiguous()
        gx = gb1 = gb3 = None
        if ctx.needs_input_grad[0]:
            parts = torch.empty(2 * token.numel(), x.size(1), dtype=torch.float32, device=x.device)  # [T, k, 2, D]
            _launch_gmm(g_gate, b1.transpose(1, 2), tiles, parts, c_idx=order * 2)
            _launch_gmm(g_up, b3.transpose(1, 2), tiles, parts, c_idx=order * 2 + 1)
            gx = sum_slots(parts, x.size(0), 2 * ctx.slots_per_token).to(x.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            xs = x[token]  # [M, D] (rows of other ranks' slots are never read)
            if ctx.needs_input_grad[1]:
                gb1 = torch.empty(b1.shape, dtype=b1.dtype, device=b1.device)
                _launch_wgrad(xs, g_gate, tiles, gb1)
            if ctx.needs_input_grad[2]:
                gb3 = torch.empty(b3.shape, dtype=b3.dtype, device=b3.device)
                _launch_wgrad(xs, g_up, tiles, gb3)
        return gx, gb1, gb3, None, None, None, None


class _DownToSlots(torch.autograd.Function):
    """y[t] = sum over t's k slots of h[r] @ b[g] (b [E, I, D]): each product row written to its (token, k)
    slot (zeros for other ranks' experts), a token's k rows summed in fp32 in slot order (`sum_slots`).
    Backward: each sorted row takes its token's gradient, rounded to h's dtype."""

    @staticmethod
    def forward(ctx, h, b, token, order, tiles, topk):
        h = h.contiguous()
        n_tokens = token.numel() // topk
        out = torch.empty(token.numel(), b.size(2), dtype=h.dtype, device=h.device)  # [T*k, D] slot order
        _launch_gmm(h, b, tiles, out, c_idx=order)
        ctx.save_for_backward(h, b, token)
        ctx.tiles = tiles
        return sum_slots(out, n_tokens, topk)

    @staticmethod
    def backward(ctx, gy):
        h, b, token = ctx.saved_tensors
        g = gy.to(h.dtype)[token]  # [M, D]
        gh = gb = None
        if ctx.needs_input_grad[0]:
            gh = torch.empty_like(h)
            _launch_gmm(g, b.transpose(1, 2), ctx.tiles, gh)
        if ctx.needs_input_grad[1]:
            gb = torch.empty(b.shape, dtype=b.dtype, device=b.device)
            _launch_wgrad(h, g, ctx.tiles, gb)
        return gh, gb, None, None, None, None


@triton.jit
def _slot_sum_kernel(x_ptr, out_ptr, D, KS: tl.constexpr, BD: tl.constexpr):
    """out[t, cols] = x[t, 0, cols] + x[t, 1, cols] + ... + x[t, KS - 1, cols] in fp32, added in that order
    from 0.0 (the same order for every row and batch: a row's sum has the same bits alone and in a batch)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(KS):
        acc += tl.load(x_ptr + (t * KS + j) * D + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc, mask=cm)


def sum_slots(out: torch.Tensor, n_tokens: int, topk: int) -> torch.Tensor:
    """[T*k, D] slot-ordered rows (contiguous) -> [T, D] fp32: each token's k rows summed in slot order."""
    d = out.size(-1)
    y = torch.empty(n_tokens, d, dtype=torch.float32, device=out.device)
    if n_tokens == 0 or d == 0:
        return y
    bd = min(1024, triton.next_power_of_2(d))
    _launch(_slot_sum_kernel, (n_tokens, triton.cdiv(d, bd)), out, y, d, KS=topk, BD=bd, num_warps=4)
    return y


# ----------------------------------------------------------------------------- the op
def triton_moe_experts(
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
    """`moe_experts` as Triton grouped GEMMs over all local experts (see the module docstring). act (W8A8 on
    dequantized weights): x and the SwiGLU output go through the FP8 round trip before their projections."""
    n_local = w1.size(0)
    x = act_round_trip(x, act, fp8_round_trip)
    m = indices.numel()
    plan, tiles = _plan_and_tiles(weights, indices, n_local, expert_offset, _block_m(m, n_local))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w1, w2, w3))
    if not needs_grad:
        x = x.contiguous()
        h = torch.empty(m, w1.size(1), dtype=x.dtype, device=x.device)  # [M, I]
        _launch_gmm(
            x,
            w1.transpose(1, 2),
            tiles,
            h,
            a_idx=plan.token,
            b2=w3.transpose(1, 2),
            w=plan.weight.contiguous(),
            limit=swiglu_limit,
        )
        out = torch.empty(m, x.size(1), dtype=x.dtype, device=x.device)  # [T*k, D] slot order
        _launch_gmm(act_round_trip(h, act, fp8_round_trip), w2.transpose(1, 2), tiles, out, c_idx=plan.order)
        return sum_slots(out, plan.n_tokens, plan.topk)
    # training: the token rows gathered inside the gate/up GEMMs and the down GEMM's rows scattered to their
    # slots, as at inference, with the SwiGLU between them differentiable (`swiglu`: one launch each way)
    gate, up = _GatherGateUp.apply(x, w1.transpose(1, 2), w3.transpose(1, 2), plan.token, plan.order, tiles, plan.topk)
    h = act_round_trip(
        triton_clamped_swiglu(gate, up, swiglu_limit, x.dtype, plan.weight.float().unsqueeze(-1)), act, fp8_round_trip
    )
    return _DownToSlots.apply(h, w2.transpose(1, 2), plan.token, plan.order, tiles, plan.topk)  # [T, D] fp32


def _can_run(x, weights, indices, w1, w2, w3, swiglu_limit, expert_offset=0, act=None) -> str | None:
    reason = device_reason(x)
    if reason:
        return reason
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        return "expects x [T, D] and stacked expert weights"
    if not (x.dtype == w1.dtype == w2.dtype == w3.dtype) or x.dtype not in (torch.bfloat16, torch.float16):
        return f"x and expert weights must all be bf16 or fp16 (got {x.dtype}, {w1.dtype})"
    return None


register("moe_experts", "triton", triton_moe_experts, can_run=_can_run, deterministic=True, priority=10)
# the grouped backend of dsv4.ops.torch_native builds its plan with the counting sort too on CUDA
register_plan_builder("cuda", triton_moe_plan, device_reason)
