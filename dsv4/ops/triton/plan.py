"""The paged step's indices (backend "triton"): the plan (`plan_window`, `plan_groups`, `plan_keep`,
`plan_entries`) and each layer's attention rows (`select_rows`, `attend_rows`), one launch each instead of
the references' dozens of small integer kernels.

Every output is an integer (or a flag) computed from integers with the references' formulas
(`dsv4.ops.reference_plan`): the same values on any device. Floor division and Python's remainder of a
possibly negative position by a positive divisor are built from a division of non-negative numbers (C and
Triton truncate towards zero): x < 0 gives -((-x - 1) // d) - 1. Kernels launched through `Kernel` must be
self-contained, so that formula is written out where it is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import register
from ..reference_plan import EMPTY_ROW, RING_BASE
from ._common import Kernel, device_reason

_alloc = torch.empty  # (the tests poison it: every output element must be written)
ENTRY_BLOCK = 1024  # entries per loop iteration of `plan_entries`


def _plan_window_kernel(
    pos_ptr,
    rows_ptr,
    wt_ptr,
    ww_ptr,
    widx_ptr,
    hp_ptr,
    s_pos,
    s_rows,
    s_wt0,
    s_wt1,
    WIDTH,
    P: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t * s_pos).to(tl.int64)
    r = tl.load(rows_ptr + t * s_rows).to(tl.int64)
    # the token's own row: page p // P, offset p % P
    neg = p < 0
    a = tl.where(neg, -p - 1, p)
    col = tl.where(neg, -(a // P) - 1, a // P)
    inside = (col >= 0) & (col < WIDTH)
    page = tl.load(wt_ptr + r * s_wt0 + tl.minimum(tl.maximum(col, 0), WIDTH - 1) * s_wt1).to(tl.int64)
    page = tl.where(inside, page, -1)
    slot = tl.where((page <= 0) | neg, -1, page * P + (p - col * P))
    has = slot >= 0
    tl.store(ww_ptr + t, tl.where(has, slot, 0))
    tl.store(hp_ptr + t, has.to(tl.uint8))
    # the window: positions p - W + 1 ... p of the same row
    i = tl.arange(0, BW)
    q = p - W + 1 + i
    qneg = q < 0
    qa = tl.where(qneg, -q - 1, q)
    qcol = tl.where(qneg, -(qa // P) - 1, qa // P)
    qin = (qcol >= 0) & (qcol < WIDTH)
    qpage = tl.load(wt_ptr + r * s_wt0 + tl.minimum(tl.maximum(qcol, 0), WIDTH - 1) * s_wt1, mask=i < W, other=-1)
    qpage = tl.where(qin, qpage.to(tl.int64), -1)
    qslot = tl.where((qpage <= 0) | qneg, -1, qpage * P + (q - qcol * P))
    tl.store(widx_ptr + t * W + i, qslot, mask=i < W)


def _plan_groups_kernel(
    gtok_ptr,
    pos_ptr,
    rows_ptr,
    start_ptr,
    seg_ptr,
    state_ptr,
    ct_ptr,
    hp_ptr,
    gpos_ptr,
    gj_ptr,
    gnew_ptr,
    gring_ptr,
    live_ptr,
    ew_ptr,
    s_gtok,
    s_pos,
    s_rows,
    s_start,
    s_seg,
    s_state,
    s_ct0,
    s_ct1,
    s_hp,
    WIDTH,
    RL,
    RATIO: tl.constexpr,
    P: tl.constexpr,
    COFF: tl.constexpr,
    BC: tl.constexpr,
    HAS_LIST: tl.constexpr,
    RING0: tl.constexpr,
    EMPTY: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    if HAS_LIST:
        tok = tl.load(gtok_ptr + g * s_gtok).to(tl.int64)
    else:
        tok = g
    p = tl.load(pos_ptr + tok * s_pos).to(tl.int64)
    r = tl.load(rows_ptr + tok * s_rows).to(tl.int64)
    hp = tl.load(hp_ptr + tok * s_hp) != 0
    # complete: (p + 1) % RATIO == 0 on a real token; j = p // RATIO
    x = p + 1
    xn = x < 0
    xa = tl.where(xn, -x - 1, x)
    x_q = tl.where(xn, -(xa // RATIO) - 1, xa // RATIO)
    complete = ((x - x_q * RATIO) == 0) & hp
    pn = p < 0
    pa = tl.where(pn, -p - 1, p)
    j = tl.where(pn, -(pa // RATIO) - 1, pa // RATIO)
    # the pooled positions q = (j - COFF + 1) * RATIO + c: this step's rows or the ring's
    C = COFF * RATIO
    c = tl.arange(0, BC)
    q = (j - COFF + 1) * RATIO + c
    first = tl.load(start_ptr + r * s_start).to(tl.int64)
    seg = tl.load(seg_ptr + r * s_seg).to(tl.int64)
    st = tl.load(state_ptr + r * s_state).to(tl.int64)
    qn = q < 0
    qa = tl.where(qn, -q - 1, q)
    q_q = tl.where(qn, -(qa // RL) - 1, qa // RL)
    ring = RING0 + st * RL + (q - q_q * RL)
    new = tl.where((q < first) | (q > p), -1, seg + q - first)
    kept = tl.where(qn | (q >= first), EMPTY, ring)
    tl.store(gnew_ptr + g * C + c, new, mask=c < C)
    tl.store(gring_ptr + g * C + c, kept, mask=c < C)
    # the entry's slot: compressed page (j * RATIO) // P, entry j % (P / RATIO) of it
    E = P // RATIO
    y = j * RATIO
    yn = y < 0
    ya = tl.where(yn, -y - 1, y)
    col = tl.where(yn, -(ya // P) - 1, ya // P)
    inside = (col >= 0) & (col < WIDTH)
    page = tl.load(ct_ptr + r * s_ct0 + tl.minimum(tl.maximum(col, 0), WIDTH - 1) * s_ct1).to(tl.int64)
    page = tl.where(inside, page, -1)
    jn = j < 0
    ja = tl.where(jn, -j - 1, j)
    j_q = tl.where(jn, -(ja // E) - 1, ja // E)
    slot = tl.where(page <= 0, -1, page * E + (j - j_q * E))
    live = complete & (slot >= 0)
    tl.store(gpos_ptr + g, p)
    tl.store(gj_ptr + g, j)
    tl.store(live_ptr + g, live.to(tl.uint8))
    tl.store(ew_ptr + g, tl.where(live, slot, 0))


def _plan_keep_kernel(
    ktok_ptr,
    pos_ptr,
    rows_ptr,
    len_ptr,
    state_ptr,
    ct_ptr,
    hp_ptr,
    rw_ptr,
    tw_ptr,
    s_ktok,
    s_pos,
    s_rows,
    s_len,
    s_state,
    s_ct0,
    s_ct1,
    s_hp,
    WIDTH,
    RL,
    RATIO: tl.constexpr,
    P: tl.constexpr,
    HAS_LIST: tl.constexpr,
    TAILS: tl.constexpr,
    RING0: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    if HAS_LIST:
        tok = tl.load(ktok_ptr + k * s_ktok).to(tl.int64)
    else:
        tok = k
    p = tl.load(pos_ptr + tok * s_pos).to(tl.int64)
    r = tl.load(rows_ptr + tok * s_rows).to(tl.int64)
    hp = tl.load(hp_ptr + tok * s_hp) != 0
    keep = (p >= tl.load(len_ptr + r * s_len).to(tl.int64) - RL) & hp
    pn = p < 0
    pa = tl.where(pn, -p - 1, p)
    p_q = tl.where(pn, -(pa // RL) - 1, pa // RL)
    ring = RING0 + tl.load(state_ptr + r * s_state).to(tl.int64) * RL + (p - p_q * RL)
    tl.store(rw_ptr + k, tl.where(keep, ring, 0))
    if TAILS:
        col = tl.where(pn, -(pa // P) - 1, pa // P)
        inside = (col >= 0) & (col < WIDTH)
        cpage = tl.load(ct_ptr + r * s_ct0 + tl.minimum(tl.maximum(col, 0), WIDTH - 1) * s_ct1).to(tl.int64)
        cpage = tl.where(inside, cpage, -1)
        p_r = tl.where(pn, -(pa // RATIO) - 1, pa // RATIO)
        tail = cpage * RATIO + (p - p_r * RATIO)
        tl.store(tw_ptr + k, tl.where(((p - col * P) < P - RATIO) | (cpage <= 0), 0, tail))


def _plan_entries_kernel(
    rows_ptr,
    ct_ptr,
    pos_ptr,
    out_ptr,
    s_rows,
    s_ct0,
    s_ct1,
    s_pos,
    WIDTH,
    N_MAX,
    RATIO: tl.constexpr,
    P: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
    VISIBLE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + n * s_rows).to(tl.int64)
    E = P // RATIO
    if VISIBLE:  # entries j < (pos + 1) // RATIO
        x = tl.load(pos_ptr + n * s_pos).to(tl.int64) + 1
        xn = x < 0
        xa = tl.where(xn, -x - 1, x)
        n_vis = tl.where(xn, -(xa // RATIO) - 1, xa // RATIO)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for b in range(NB):
        jj = b * BLOCK + offs  # (>= 0: plain division)
        valid = jj < N_MAX
        col = (jj * RATIO) // P
        page = tl.load(ct_ptr + r * s_ct0 + tl.minimum(col, WIDTH - 1) * s_ct1, mask=valid, other=-1).to(tl.int64)
        page = tl.where(col < WIDTH, page, -1)
        slot = tl.where(page <= 0, -1, page * E + jj % E)
        if VISIBLE:
            out = tl.where((jj >= n_vis) | (slot < 0), -1, slot)
        else:
            out = tl.where(slot < 0, 0, slot)
        tl.store(out_ptr + n * N_MAX + jj, out, mask=valid)


def _select_rows_kernel(
    sel_ptr,
    cand_ptr,
    dst_ptr,
    out_ptr,
    S,
    s_sel0,
    s_sel1,
    s_cand0,
    s_cand1,
    s_dst,
    s_out0,
    K: tl.constexpr,
    BK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # cell i = (row b, column s) of the map, row-major
    b = i // S
    col = i - b * S
    kk = tl.arange(0, BK)
    inside = kk < K
    e = tl.load(sel_ptr + b * s_sel0 + col * s_sel1 + kk, mask=inside, other=-1).to(tl.int64)
    slot = tl.load(cand_ptr + b * s_cand0 + tl.maximum(e, 0) * s_cand1, mask=inside, other=-1).to(tl.int64)
    row = tl.load(dst_ptr + i * s_dst).to(tl.int64)
    tl.store(out_ptr + row * s_out0 + kk, tl.where(e < 0, -1, slot), mask=inside)


def _attend_rows_kernel(
    win_ptr,
    slot_ptr,
    out_ptr,
    W,
    N,
    offset,
    s_win,
    s_slot,
    NBW: tl.constexpr,
    NBN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    row = out_ptr + t * (W + N)
    for b in range(NBW):
        c = b * BLOCK + offs
        tl.store(row + c, tl.load(win_ptr + t * s_win + c, mask=c < W), mask=c < W)
    for b in range(NBN):
        c = b * BLOCK + offs
        v = tl.load(slot_ptr + t * s_slot + c, mask=c < N, other=-1).to(tl.int64)
        tl.store(row + W + c, tl.where(v < 0, -1, v + offset), mask=c < N)


_window = Kernel(_plan_window_kernel)
_groups = Kernel(_plan_groups_kernel)
_keep = Kernel(_plan_keep_kernel)
_entries = Kernel(_plan_entries_kernel)
_select = Kernel(_select_rows_kernel)
_attend = Kernel(_attend_rows_kernel)
ROW_BLOCK = 1024  # columns per loop iteration of `attend_rows`


def triton_plan_window(positions, rows, wtable, page_size, window):
    T = positions.numel()
    dev = positions.device
    ww = _alloc((T,), dtype=torch.int64, device=dev)
    widx = _alloc((T, window), dtype=torch.int64, device=dev)
    hp = _alloc((T,), dtype=torch.uint8, device=dev)
    if T:
        _window[(T,)](
            positions, rows, wtable, ww, widx, hp,
            positions.stride(0), rows.stride(0), wtable.stride(0), wtable.stride(1), wtable.size(1),
            P=page_size, W=window, BW=triton.next_power_of_2(window),
        )  # fmt: skip
    return ww, widx, hp.view(torch.bool)


def triton_plan_groups(
    g_tok, positions, rows, start, seg_start, state, ctable, has_page, ratio, page_size, ring_len, coff
):
    G = positions.numel() if g_tok is None else g_tok.numel()
    dev = positions.device
    C = coff * ratio
    gpos = _alloc((G,), dtype=torch.int64, device=dev)
    gj = _alloc((G,), dtype=torch.int64, device=dev)
    gnew = _alloc((G, C), dtype=torch.int64, device=dev)
    gring = _alloc((G, C), dtype=torch.int64, device=dev)
    live = _alloc((G,), dtype=torch.uint8, device=dev)
    ew = _alloc((G,), dtype=torch.int64, device=dev)
    if G:
        lst = positions if g_tok is None else g_tok
        hp = has_page.view(torch.uint8)
        _groups[(G,)](
            lst, positions, rows, start, seg_start, state, ctable, hp, gpos, gj, gnew, gring, live, ew,
            lst.stride(0), positions.stride(0), rows.stride(0), start.stride(0), seg_start.stride(0),
            state.stride(0), ctable.stride(0), ctable.stride(1), hp.stride(0), ctable.size(1), ring_len,
            RATIO=ratio, P=page_size, COFF=coff, BC=triton.next_power_of_2(C), HAS_LIST=g_tok is not None,
            RING0=RING_BASE, EMPTY=EMPTY_ROW,
        )  # fmt: skip
    return gpos, gj, gnew, gring, live.view(torch.bool), ew


def triton_plan_keep(k_tok, positions, rows, length, state, ctable, has_page, ratio, page_size, ring_len, tails):
    K = positions.numel() if k_tok is None else k_tok.numel()
    dev = positions.device
    rw = _alloc((K,), dtype=torch.int64, device=dev)
    tw = _alloc((K,), dtype=torch.int64, device=dev) if tails else None
    if K:
        lst = positions if k_tok is None else k_tok
        hp = has_page.view(torch.uint8)
        _keep[(K,)](
            lst, positions, rows, length, state, ctable, hp, rw, rw if tw is None else tw,
            lst.stride(0), positions.stride(0), rows.stride(0), length.stride(0), state.stride(0),
            ctable.stride(0), ctable.stride(1), hp.stride(0), ctable.size(1), ring_len,
            RATIO=ratio, P=page_size, HAS_LIST=k_tok is not None, TAILS=bool(tails), RING0=RING_BASE,
        )  # fmt: skip
    return rw, tw


def triton_plan_entries(rows, ctable, ratio, page_size, n_max, positions):
    N = rows.numel()
    out = _alloc((N, n_max), dtype=torch.int64, device=rows.device)
    if N and n_max:
        block = min(ENTRY_BLOCK, triton.next_power_of_2(n_max))
        pos = rows if positions is None else positions
        _entries[(N,)](
            rows, ctable, pos, out, rows.stride(0), ctable.stride(0), ctable.stride(1), pos.stride(0),
            ctable.size(1), n_max,
            RATIO=ratio, P=page_size, NB=triton.cdiv(n_max, block), BLOCK=block, VISIBLE=positions is not None,
        )  # fmt: skip
    return out


def triton_select_rows(out, sel, cand, dst):
    b, s, k = sel.shape
    if b * s and k:
        _select[(b * s,)](
            sel, cand, dst, out, s, sel.stride(0), sel.stride(1), cand.stride(0), cand.stride(1), dst.stride(0),
            out.stride(0), K=k, BK=triton.next_power_of_2(k),
        )  # fmt: skip
    return out


def triton_attend_rows(window_idx, slots, offset):
    T, W = window_idx.shape
    N = slots.size(1)
    out = _alloc((T, W + N), dtype=torch.int64, device=window_idx.device)
    if T and W + N:
        block = min(ROW_BLOCK, triton.next_power_of_2(max(W, N, 1)))
        _attend[(T,)](
            window_idx, slots, out, W, N, offset, window_idx.stride(0), slots.stride(0),
            NBW=triton.cdiv(W, block), NBN=triton.cdiv(N, block), BLOCK=block,
        )  # fmt: skip
    return out


# ------------------------------------------------------------------------------ what the kernels take
def _ints(named: dict) -> str | None:
    """None when every named tensor is a 1-D int64 vector (or absent), else which is not."""
    for name, t in named.items():
        if t is not None and (t.dim() != 1 or t.dtype != torch.int64):
            return f"{name} must be a 1-D int64 tensor, got {tuple(t.shape)} {t.dtype}"
    return None


def _table(name: str, t: torch.Tensor) -> str | None:
    if t.dim() != 2 or t.dtype != torch.int64 or t.size(1) < 1:
        return f"{name} must be a [rows, width >= 1] int64 table, got {tuple(t.shape)} {t.dtype}"
    return None


def _sizes(page_size: int, ratio: int = 1) -> str | None:
    if not (isinstance(page_size, int) and isinstance(ratio, int) and ratio >= 1 and page_size >= ratio):
        return f"page_size {page_size!r} and ratio {ratio!r} must be integers, page_size >= ratio >= 1"
    if page_size % ratio:
        return f"page_size {page_size} must be a multiple of the ratio {ratio}"
    return None


def _can_window(positions, rows, wtable, page_size, window) -> str | None:
    return (
        device_reason(positions, rows, wtable)
        or _ints({"positions": positions, "rows": rows})
        or _table("wtable", wtable)
        or _sizes(page_size)
        or (None if isinstance(window, int) and 1 <= window <= 8192 else f"window {window!r} (1 .. 8192)")
        or (None if rows.numel() == positions.numel() else "rows and positions differ in length")
    )


def _flags(has_page: torch.Tensor, n: int) -> str | None:
    if has_page.dtype != torch.bool or tuple(has_page.shape) != (n,):
        return f"has_page must be [{n}] bool, got {tuple(has_page.shape)} {has_page.dtype}"
    return None


def _can_groups(
    g_tok, positions, rows, start, seg_start, state, ctable, has_page, ratio, page_size, ring_len, coff
) -> str | None:
    tensors = [t for t in (g_tok, positions, rows, start, seg_start, state, ctable, has_page) if t is not None]
    named = {"g_tok": g_tok, "positions": positions, "rows": rows, "start": start, "seg_start": seg_start}
    return (
        device_reason(*tensors)
        or _ints(named | {"state": state})
        or _table("ctable", ctable)
        or _flags(has_page, positions.numel())
        or _sizes(page_size, ratio)
        or (None if coff in (1, 2) and isinstance(ring_len, int) and ring_len >= 1 else "coff 1 or 2, ring_len >= 1")
        or (None if coff * ratio <= 4096 else f"groups of {coff * ratio} rows (the kernel takes up to 4096)")
    )


def _can_keep(k_tok, positions, rows, length, state, ctable, has_page, ratio, page_size, ring_len, tails) -> str | None:
    tensors = [t for t in (k_tok, positions, rows, length, state, ctable, has_page) if t is not None]
    return (
        device_reason(*tensors)
        or _ints({"k_tok": k_tok, "positions": positions, "rows": rows, "length": length, "state": state})
        or _table("ctable", ctable)
        or _flags(has_page, positions.numel())
        or _sizes(page_size, ratio)
        or (None if isinstance(ring_len, int) and ring_len >= 1 else f"ring_len {ring_len!r}")
    )


def _can_entries(rows, ctable, ratio, page_size, n_max, positions) -> str | None:
    tensors = [t for t in (rows, ctable, positions) if t is not None]
    return (
        device_reason(*tensors)
        or _ints({"rows": rows, "positions": positions})
        or _table("ctable", ctable)
        or _sizes(page_size, ratio)
        or (None if isinstance(n_max, int) and n_max >= 0 else f"n_max {n_max!r}")
        or (None if positions is None or positions.numel() == rows.numel() else "positions and rows differ in length")
    )


def _can_select(out, sel, cand, dst) -> str | None:
    reason = device_reason(out, sel, cand, dst)
    if reason:
        return reason
    if sel.dim() != 3 or sel.dtype != torch.int64 or (sel.size(2) > 1 and sel.stride(2) != 1):
        return f"sel must be [b, s, k] int64 with contiguous rows, got {tuple(sel.shape)} {sel.dtype}"
    b, s, k = sel.shape
    if cand.dim() != 2 or cand.size(0) != b or cand.dtype != torch.int64:
        return f"cand must be [{b}, n] int64, got {tuple(cand.shape)} {cand.dtype}"
    if tuple(dst.shape) != (b * s,) or dst.dtype != torch.int64:
        return f"dst must be [{b * s}] int64, got {tuple(dst.shape)} {dst.dtype}"
    if out.dim() != 2 or out.dtype != torch.int64 or out.size(1) < k or (out.size(1) > 1 and out.stride(1) != 1):
        return f"out must be [rows, >= {k}] int64 with contiguous rows, got {tuple(out.shape)} {out.dtype}"
    if k > 4096:
        return f"top-{k} (the kernel takes up to 4096 per row)"
    return None


def _can_attend(window_idx, slots, offset) -> str | None:
    reason = device_reason(window_idx, slots)
    if reason:
        return reason
    for name, t in (("window_idx", window_idx), ("slots", slots)):
        if t.dim() != 2 or t.dtype != torch.int64 or (t.size(1) > 1 and t.stride(1) != 1):
            return f"{name} must be [T, n] int64 with contiguous rows, got {tuple(t.shape)} {t.dtype}"
    if window_idx.size(0) != slots.size(0):
        return "window_idx and slots differ in rows"
    return None if isinstance(offset, int) and offset >= 0 else f"offset {offset!r}"


for _op, _fn, _can in (
    ("plan_window", triton_plan_window, _can_window),
    ("plan_groups", triton_plan_groups, _can_groups),
    ("plan_keep", triton_plan_keep, _can_keep),
    ("plan_entries", triton_plan_entries, _can_entries),
    ("select_rows", triton_select_rows, _can_select),
    ("attend_rows", triton_attend_rows, _can_attend),
):
    register(_op, "triton", _fn, can_run=_can, deterministic=True, priority=10)

__all__ = [
    "triton_attend_rows",
    "triton_plan_entries",
    "triton_plan_groups",
    "triton_plan_keep",
    "triton_plan_window",
    "triton_select_rows",
]
