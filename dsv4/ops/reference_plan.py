"""Plain-torch references of a paged step's plan: every cache index one `append` step needs, from the step's
small inputs (`dsv4.model.paged.StepInputs`) and its page tables, on the device and with static shapes; and
of the rows each attention layer reads (`select_rows`, `attend_rows`).

Part of `dsv4.ops.reference` (which re-exports every name here). `dsv4.model.paged` describes the layout:
window pages of `page_size` positions, compressed pages of `page_size / ratio` entries, page 0 and ring row
0 reserved as trash (`TRASH`: the target of writes that must not land), ring row 1 never written
(`EMPTY_ROW`), ring slot s of a compressor starting at `RING_BASE + s * ring_len`. A key that does not exist
is -1. Every integer here is int64; division and remainder are floor division and Python's remainder (a
negative position's page is -1, its offset in [0, page)).

Each function is a few dozen small integer kernels on a GPU (a serving step's plan was some 200 of its
~1,000 launches); the Triton backends compute the same integers in one launch each.
"""

from __future__ import annotations

import torch

TRASH = 0  # reserved page 0 / ring row 0: the target of writes that must not land (`or_trash`: 0)
EMPTY_ROW = 1  # ring row 1: never written; kv 0, score -inf (the "group before the first one")
RING_BASE = 2  # ring rows of state slot s start at RING_BASE + s * ring_len

# the ops defined here: the plan's, and with them the ones that assemble each layer's attention rows
PLAN_OPS = ("plan_window", "plan_groups", "plan_keep", "plan_entries")
INDEX_OPS = (*PLAN_OPS, "select_rows", "attend_rows")


def lookup_page(table: torch.Tensor, rows: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """The physical page of logical page `col` of each row: table[rows, col], -1 outside the table."""
    inside = col.clamp(0, table.size(1) - 1)
    # (one comparison, and masked_fill takes -1 as a kernel argument: torch.where with a number first fills a
    # device scalar tensor, one more launch per call in every CUDA graph)
    return table[rows, inside].masked_fill(inside != col, -1)


def or_trash(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x where keep, else TRASH: the product with the mask, one kernel (TRASH is 0; `torch.where(keep, x,
    TRASH)` would first fill a device tensor with the number, a second kernel in every captured step)."""
    return x * keep


def entry_index(pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """The compressed entry that the group ending at token position `pos` becomes: pos // ratio."""
    return torch.div(pos, ratio, rounding_mode="floor")


def window_slot(wtable: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, page_size: int) -> torch.Tensor:
    """The window-pool row of position q of each row (-1: no page, or q < 0)."""
    page = lookup_page(wtable, rows, torch.div(q, page_size, rounding_mode="floor"))
    return (page * page_size + q % page_size).masked_fill((page <= 0) | (q < 0), -1)


def entry_slot(ctable: torch.Tensor, rows: torch.Tensor, j: torch.Tensor, ratio: int, page_size: int) -> torch.Tensor:
    """The compressed-pool row (entry-region coordinates) of entry j of each row (-1: no page)."""
    per_page = page_size // ratio
    page = lookup_page(ctable, rows, torch.div(j * ratio, page_size, rounding_mode="floor"))
    return (page * per_page + j % per_page).masked_fill(page <= 0, -1)


def plan_window(
    positions: torch.Tensor, rows: torch.Tensor, wtable: torch.Tensor, page_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window part of a step's plan. positions, rows [T]; wtable [B, width] ->

    window_write [T]: each token's window row (TRASH where it has no page: padding);
    window_idx [T, window]: the rows of positions pos - window + 1 ... pos of the token's row (-1 none);
    has_page [T] bool: the token's window page exists (a real token)."""
    wslot = window_slot(wtable, rows, positions, page_size)
    has_page = wslot >= 0
    q = positions.unsqueeze(1) - window + 1 + torch.arange(window, device=positions.device)  # [T, w]
    window_idx = window_slot(wtable, rows.unsqueeze(1).expand_as(q), q, page_size)
    return or_trash(wslot, has_page), window_idx, has_page


def plan_groups(
    g_tok: torch.Tensor | None,
    positions: torch.Tensor,
    rows: torch.Tensor,
    start: torch.Tensor,
    seg_start: torch.Tensor,
    state: torch.Tensor,
    ctable: torch.Tensor,
    has_page: torch.Tensor,
    ratio: int,
    page_size: int,
    ring_len: int,
    coff: int,
) -> tuple[torch.Tensor, ...]:
    """The compressed groups a step may complete, one per token listed in g_tok [G] (None: every token).
    A group of ratio r ends at a position p with (p + 1) % r == 0; it pools the raw rows of positions
    (j - coff + 1) * r ... (j + 1) * r - 1, j = p // r (coff = 2: overlapping windows). ->

    group_pos [G], group_j [G] (the entry id);
    group_new [G, coff*r]: the flat token index of each pooled position written in this step, else -1;
    group_ring [G, coff*r]: its ring row where it was written before, else EMPTY_ROW;
    group_live [G] bool: complete, on a real token, with an entry slot to write;
    entry_write [G]: that slot (TRASH unless live)."""
    g_tok = torch.arange(positions.numel(), device=positions.device) if g_tok is None else g_tok
    g_pos, g_row = positions[g_tok], rows[g_tok]
    complete = ((g_pos + 1) % ratio == 0) & has_page[g_tok]
    j = torch.div(g_pos, ratio, rounding_mode="floor")  # entry id (rope position j*r)
    q = (j - coff + 1).unsqueeze(1) * ratio + torch.arange(coff * ratio, device=positions.device)  # [G, coff*r]
    first, seg = start[g_row].unsqueeze(1), seg_start[g_row].unsqueeze(1)
    ring = RING_BASE + state[g_row].unsqueeze(1) * ring_len + q % ring_len
    group_new = (seg + q - first).masked_fill((q < first) | (q > g_pos.unsqueeze(1)), -1)  # new rows only
    group_ring = ring.masked_fill((q < 0) | (q >= first), EMPTY_ROW)  # kept rows only
    slot = entry_slot(ctable, g_row, entry_index(g_pos, ratio), ratio, page_size)
    live = complete & (slot >= 0)
    return g_pos, j, group_new, group_ring, live, or_trash(slot, live)


def plan_keep(
    k_tok: torch.Tensor | None,
    positions: torch.Tensor,
    rows: torch.Tensor,
    length: torch.Tensor,
    state: torch.Tensor,
    ctable: torch.Tensor,
    has_page: torch.Tensor,
    ratio: int,
    page_size: int,
    ring_len: int,
    tails: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where the raw rows of the tokens listed in k_tok [K] (None: every token) go for later steps ->

    ring_write [K]: the ring row of each token among its row's last ring_len positions (TRASH otherwise);
    tail_write [K] or None (tails=False): the page-tail row of each token in its compressed page's last
    group (TRASH otherwise)."""
    if k_tok is None:
        k_pos, k_rows, k_page = positions, rows, has_page
    else:
        k_pos, k_rows, k_page = positions[k_tok], rows[k_tok], has_page[k_tok]
    keep = (k_pos >= length[k_rows] - ring_len) & k_page
    ring_write = or_trash(RING_BASE + state[k_rows] * ring_len + k_pos % ring_len, keep)
    if not tails:
        return ring_write, None
    cpage = lookup_page(ctable, k_rows, torch.div(k_pos, page_size, rounding_mode="floor"))
    tail = (cpage * ratio + k_pos % ratio).masked_fill((k_pos % page_size < page_size - ratio) | (cpage <= 0), TRASH)
    return ring_write, tail


def plan_entries(
    rows: torch.Tensor, ctable: torch.Tensor, ratio: int, page_size: int, n_max: int, positions: torch.Tensor | None
) -> torch.Tensor:
    """The compressed-pool rows of entries 0 ... n_max - 1 of each row in rows [N] -> [N, n_max].

    positions [N] given: what each token may read (entries j < (pos + 1) // ratio; -1 elsewhere and where
    there is no page). None: an indexer's candidates (TRASH where there is no page; visibility is decided
    by the indexer from the positions)."""
    N = rows.numel()
    jj = torch.arange(n_max, device=rows.device)
    slots = entry_slot(ctable, rows.unsqueeze(1).expand(-1, n_max), jj.unsqueeze(0).expand(N, -1), ratio, page_size)
    if positions is None:
        return slots.masked_fill(slots < 0, TRASH)
    hidden = jj.unsqueeze(0) >= torch.div(positions + 1, ratio, rounding_mode="floor").unsqueeze(1)  # [N, n_max]
    return slots.masked_fill(hidden | (slots < 0), -1)


# ------------------------------------------------------------------------------ a layer's attention rows
def select_rows(out: torch.Tensor, sel: torch.Tensor, cand: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The indexer's choices as pool slots, written in place: sel [b, s, k] entry ids (-1 none) of each row's
    candidates cand [b, n] (entry slots) -> out[dst[i], :k] for the b*s cells in row-major order (dst [b*s];
    padding cells all go to a spare row, whose content is then unspecified). out: [rows, width >= k]. -> out"""
    phys = cand.gather(1, sel.clamp_min(0).flatten(1)).view_as(sel).masked_fill(sel < 0, -1)
    out[:, : sel.size(-1)].index_copy_(0, dst, phys.flatten(0, 1))
    return out


def attend_rows(window_idx: torch.Tensor, slots: torch.Tensor, offset: int) -> torch.Tensor:
    """The kv rows a layer's tokens attend to: window rows [T, w] and compressed-pool slots [T, n] (-1 none),
    whose entries start at row `offset` of the layer's kv -> [T, w + n] (-1 none)."""
    return torch.cat([window_idx, (slots + offset).masked_fill(slots < 0, -1)], -1)
