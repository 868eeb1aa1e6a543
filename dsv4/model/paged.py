"""The model's runtime memory: a paged pool of hybrid caches, and the per-step plan that addresses it.

One incremental entry point, `DeepSeekV4.append`, appends tokens to many sequences at once, each at its
own positions (s = 1: decode; s > 1: a prefill chunk; s = k + 1: a speculative verify). Every token of a
step is laid out in one flat list of T tokens; rows of the step are sequences, and each row's tokens are
contiguous and at consecutive positions.

What a V4 layer keeps between steps, and where it lives here:

| state | per | storage |
|---|---|---|
| window KV (last `window` positions) | token | window pages (`page_size` positions each), every layer |
| compressed entries (CSA 4, HCA 128) | group of r tokens | compressed pages (`page_size / r` entries each) |
| indexer keys (CSA) | group of 4 tokens | compressed pages, the indexer's own pool |
| compressor pending rows (raw kv, gate score) | token | a small ring per running sequence (`state` slot) |

Pages are addressed through two tables per sequence, `wtable` (window) and `ctable` (compressed):
logical page k holds positions [k*P, (k+1)*P). Page 0 of each pool and ring row 0 are reserved as
*trash*: writes that must not land anywhere (padding tokens, groups that are not complete yet) go there,
so every write has a static shape and needs no host synchronization. Reads never point at trash: a key
that does not exist is -1.

The compressor's pending rows are position-addressed (row of position p at ring slot p % R), so rolling a
sequence back (a rejected speculative draft) needs no undo: rows, entries and window slots written for
positions at or past the sequence's length are never read before they are written again.

`plan_step` turns the small host-built `StepInputs` (tokens, positions, tables) into every index the
layers need, on the device, with static shapes: a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import ops
from ..config import ModelConfig
from ..ops.reference_plan import EMPTY_ROW, RING_BASE, TRASH, lookup_page  # noqa: F401  (also importable here)

SPEC_ROWS = 16  # ring rows beyond the compressor's history: tokens one step may add to a sequence
# and still roll back (a speculative verify of up to SPEC_ROWS tokens)


def overlap(ratio: int) -> bool:
    """Ratio-4 compressors pool overlapping windows (the previous group's first-half channels)."""
    return ratio == 4


def default_page_size(cfg: ModelConfig) -> int:
    """The smallest multiple of every compression ratio that is >= 64 and >= the window."""
    ratios = [r for r in cfg.compress_ratios if r]
    lcm = math.lcm(*ratios) if ratios else 1
    want = max(64, cfg.window_size)
    return lcm * math.ceil(want / lcm)


@dataclass(frozen=True)
class CacheLayout:
    """Sizes of a paged cache. `max_len` bounds one sequence (table widths, candidate lists)."""

    page_size: int
    window: int
    ratios: tuple[int, ...]  # the distinct nonzero compression ratios
    n_window_pages: int  # including the reserved trash page 0
    n_comp_pages: int  # including the reserved trash page 0
    n_states: int  # sequences that can be running at once (ring slots)
    max_len: int
    page_tails: bool = False  # keep each page's last raw group (prefix caching, ratio-4 overlap)

    def __post_init__(self) -> None:
        for r in self.ratios:
            if self.page_size % r:
                raise ValueError(
                    f"page_size {self.page_size} must be a multiple of every compression ratio (got ratio {r})"
                )
        if self.n_window_pages < 2 or self.n_states < 1 or self.max_len < 1:
            raise ValueError("a cache needs at least one window page, one state slot and max_len >= 1")
        if self.ratios and self.n_comp_pages < 2:
            raise ValueError("a model with compressed layers needs at least one compressed page")

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        n_window_pages: int,
        n_comp_pages: int,
        n_states: int,
        max_len: int,
        page_size: int | None = None,
        page_tails: bool = False,
    ) -> CacheLayout:
        ratios = tuple(sorted({r for r in cfg.compress_ratios if r}))
        return cls(
            page_size or default_page_size(cfg),
            cfg.window_size,
            ratios,
            n_window_pages,
            n_comp_pages if ratios else 1,
            n_states,
            max_len,
            page_tails,
        )

    def table_width(self) -> int:
        """Columns of a page table: logical pages of one sequence of max_len positions."""
        return -(-self.max_len // self.page_size)

    def entries_per_page(self, ratio: int) -> int:
        return self.page_size // ratio

    def max_entries(self, ratio: int) -> int:
        """Compressed entries one sequence can hold (the width of candidate / visible lists)."""
        return self.max_len // ratio

    def ring_len(self, ratio: int) -> int:
        return (2 if overlap(ratio) else 1) * ratio + SPEC_ROWS

    def raw_keep(self, ratio: int) -> tuple[int, int]:
        """Which tokens of a prompt chunk leave raw rows for later steps: its last `R` tokens (the ring)
        and, where page tails are kept, every token whose position p has p % page_size >= page_size - t.
        -> (R, t), t = 0 without tails."""
        tail = ratio if self.page_tails and overlap(ratio) else 0
        return self.ring_len(ratio), tail

    def keep_bound(self, ratio: int, chunk: int) -> int:
        """At most this many tokens of `chunk` consecutive positions of one sequence leave raw rows
        (`raw_keep`): the last R, and t of each page end the chunk reaches (at most chunk // page + 1)."""
        R, t = self.raw_keep(ratio)
        return min(chunk, R + t * (chunk // self.page_size + 1))


@dataclass
class Ring:
    """A compressor's raw rows by position: kv and gate score, fp32 [RING_BASE + n_states * R, W]."""

    kv: torch.Tensor
    score: torch.Tensor


@dataclass
class LayerPool:
    """One attention layer's storage. `kv` rows: [window pages * P | compressed entries]; sparse
    attention reads it directly, so window rows and compressed entries share one index space."""

    kv: torch.Tensor  # [n_window_pages * P + n_comp_pages * P / r, head_dim]
    entry_offset: int  # first compressed-entry row in kv
    ratio: int = 0
    rows: Ring | None = None  # the attention compressor's pending rows
    index_keys: torch.Tensor | None = None  # [n_comp_pages * P / 4, index_head_dim] (CSA)
    index_rows: Ring | None = None  # the indexer compressor's pending rows
    tails: Ring | None = None  # [n_comp_pages * r, W]: each page's last group (overlap)
    index_tails: Ring | None = None


class PagedKVCache:
    """Every layer's pools for one layout (the main layers, then the MTP layers)."""

    def __init__(self, cfg: ModelConfig, layout: CacheLayout, device: torch.device | str, dtype: torch.dtype):
        self.cfg, self.layout = cfg, layout
        self.device, self.dtype = torch.device(device), dtype
        P = layout.page_size
        self.layers: list[LayerPool] = []
        for ratio in cfg.compress_ratios:
            n_win = layout.n_window_pages * P
            n_ent = layout.n_comp_pages * (P // ratio) if ratio else 0
            pool = LayerPool(
                kv=torch.zeros(n_win + n_ent, cfg.head_dim, device=device, dtype=dtype), entry_offset=n_win, ratio=ratio
            )
            if ratio:
                width = (2 if overlap(ratio) else 1) * cfg.head_dim
                pool.rows = self._ring(ratio, width)
                if layout.page_tails and overlap(ratio):
                    pool.tails = self._tail(ratio, width)
            if ratio == 4:
                pool.index_keys = torch.zeros(n_ent, cfg.index_head_dim, device=device, dtype=dtype)
                width = 2 * cfg.index_head_dim
                pool.index_rows = self._ring(ratio, width)
                if layout.page_tails:
                    pool.index_tails = self._tail(ratio, width)
            self.layers.append(pool)

    def _ring(self, ratio: int, width: int) -> Ring:
        n = RING_BASE + self.layout.n_states * self.layout.ring_len(ratio)
        score = torch.zeros(n, width, device=self.device, dtype=torch.float32)
        score[EMPTY_ROW] = float("-inf")
        return Ring(torch.zeros(n, width, device=self.device, dtype=torch.float32), score)

    def _tail(self, ratio: int, width: int) -> Ring:
        n = self.layout.n_comp_pages * ratio
        return Ring(
            torch.zeros(n, width, device=self.device, dtype=torch.float32),
            torch.zeros(n, width, device=self.device, dtype=torch.float32),
        )

    def nbytes(self) -> int:
        total = 0
        for pool in self.layers:
            for t in (pool.kv, pool.index_keys):
                if t is not None:
                    total += t.numel() * t.element_size()
            for ring in (pool.rows, pool.index_rows, pool.tails, pool.index_tails):
                if ring is not None:
                    total += 2 * ring.kv.numel() * ring.kv.element_size()
            # (reserved trash rows included)
        return total

    def restore_tail(self, state: int, cpage: int, end: int) -> None:
        """Copy the raw rows of the group ending at position `end` (exclusive, a page boundary) from
        compressed page `cpage`'s tail into ring slot `state` (a sequence resuming from a cached prefix)."""
        for pool in self.layers:
            for ring, tail in ((pool.rows, pool.tails), (pool.index_rows, pool.index_tails)):
                if ring is None or tail is None:
                    continue
                r = pool.ratio
                R = self.layout.ring_len(r)
                pos = torch.arange(end - r, end)
                dst = RING_BASE + state * R + pos % R
                src = cpage * r + pos % r
                ring.kv[dst.to(self.device)] = tail.kv[src.to(self.device)]
                ring.score[dst.to(self.device)] = tail.score[src.to(self.device)]


@dataclass
class StepInputs:
    """What one `append` call processes: T tokens in B rows. All tensors on the model's device.

    Row b's tokens are flat[seg_start[b] : seg_start[b] + length[b] - start[b]] at positions
    start[b] ... length[b] - 1. Padding rows have start = length = 0 and tables of -1.
    """

    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    rows: torch.Tensor  # [T] long: the row of each token
    seg_start: torch.Tensor  # [B] long: flat index of the row's first token
    start: torch.Tensor  # [B] long: position of the row's first token
    length: torch.Tensor  # [B] long: the row's length after this step
    wtable: torch.Tensor  # [B, table_width] long: window page ids (-1: none)
    ctable: torch.Tensor  # [B, table_width] long: compressed page ids (-1: none)
    state: torch.Tensor  # [B] long: ring slot of each row
    # ratio -> [G] flat indices of the tokens that complete a group; None: every token may (decode and
    # verify: completion is decided on the device)
    groups: dict[int, torch.Tensor | None] = field(default_factory=dict)
    # indexer groups: token index maps [b_g, s_g] (-1: padding) and the row of each map row [b_g]
    # ratio -> [K] flat indices of the tokens whose raw rows may be kept (a superset: the others are not
    # written at all); absent: every token (`CacheLayout.raw_keep`)
    keep: dict[int, torch.Tensor] = field(default_factory=dict)
    index_maps: list[torch.Tensor] = field(default_factory=list)
    index_rows: list[torch.Tensor] = field(default_factory=list)
    out: torch.Tensor | None = None  # [n_out] flat indices whose logits are wanted (None: all)
    shape: tuple[int, int] | None = None  # (b, s) when the flat list is b rows of s tokens (row-major)


@dataclass
class RatioPlan:
    """Indices for the layers of one compression ratio (`dsv4.ops.reference_plan` defines each)."""

    ratio: int
    slot: torch.Tensor | None = None  # [T] each token's slot in its group (positions % ratio): its `ape` row
    group_pos: torch.Tensor | None = None  # [G] position of each group's last token
    group_j: torch.Tensor | None = None  # [G] entry id
    group_new: torch.Tensor | None = None  # [G, coff*r] flat token index of each slot's row, or -1
    group_ring: torch.Tensor | None = None  # [G, coff*r] ring row when not new (EMPTY_ROW: none)
    entry_write: torch.Tensor | None = None  # [G] entry slot to write (TRASH unless complete)
    group_live: torch.Tensor | None = None  # [G] bool: complete, with a slot to write (entry_write != TRASH)
    keep_tok: torch.Tensor | None = None  # [K] the tokens whose raw rows are written (None: all T)
    ring_write: torch.Tensor | None = None  # [K] ring row for each such token's raw row (TRASH: not kept)
    tail_write: torch.Tensor | None = None  # [K] page-tail row (TRASH: not a page's last group)
    visible: torch.Tensor | None = None  # [T, max_entries] entry slots visible (HCA), -1 none
    cand: list[torch.Tensor] = field(default_factory=list)  # per indexer group [b_g, max_entries]
    # per indexer group, what every indexer layer of the step reads alike: the token of each map cell
    # [b_g, s_g] (padding: 0), its position (padding: -1) and the flat row its selection goes to [b_g * s_g]
    # (padding: T, a spare row)
    index_cells: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class Plan:
    inputs: StepInputs
    window_write: torch.Tensor  # [T] window slot for each token's kv
    window_idx: torch.Tensor  # [T, window] window slots of the keys each token sees, -1 none
    ratios: dict[int, RatioPlan]


def plan_step(inp: StepInputs, layout: CacheLayout, compressed: bool = True) -> Plan:
    """Every index a step needs, computed on the device with shapes fixed by the inputs' shapes: the ops
    `plan_window`, `plan_groups`, `plan_keep` and `plan_entries` (one launch each where a Triton backend
    runs them).

    compressed=False plans the window only (the MTP block's window-only layer)."""
    P = layout.page_size
    window_write, window_idx, has_page = ops.plan_window(inp.positions, inp.rows, inp.wtable, P, layout.window)
    ratios = {r: _ratio_plan(inp, layout, r, has_page) for r in layout.ratios} if compressed else {}
    return Plan(inp, window_write, window_idx, ratios)


def _ratio_plan(inp: StepInputs, layout: CacheLayout, r: int, has_page: torch.Tensor) -> RatioPlan:
    """has_page [T]: each token's window page exists (a real token, not padding)."""
    P, R = layout.page_size, layout.ring_len(r)
    pos, rows, ct = inp.positions, inp.rows, inp.ctable
    plan = RatioPlan(r, slot=pos % r, keep_tok=inp.keep.get(r))  # (the slot: once per ratio, not per layer)
    # groups completing in this step; raw rows kept for later steps (the last R positions of each row)
    g = ops.plan_groups(
        inp.groups.get(r), pos, rows, inp.start, inp.seg_start, inp.state, ct, has_page, r, P, R, 2 if overlap(r) else 1
    )
    plan.group_pos, plan.group_j, plan.group_new, plan.group_ring, plan.group_live, plan.entry_write = g
    tails = layout.page_tails and overlap(r)
    plan.ring_write, plan.tail_write = ops.plan_keep(
        plan.keep_tok, pos, rows, inp.length, inp.state, ct, has_page, r, P, R, tails
    )
    # what each token may read
    n_max = layout.max_entries(r)
    if r != 4:
        plan.visible = ops.plan_entries(rows, ct, r, P, n_max, pos)
    else:
        plan.cand = [ops.plan_entries(g_rows, ct, r, P, n_max, None) for g_rows in inp.index_rows]
        T = pos.numel()
        for qmap in inp.index_maps:
            pad = qmap < 0
            tok = qmap.clamp_min(0)  # [b_g, s_g]
            plan.index_cells.append((tok, pos[tok].masked_fill(pad, -1), qmap.masked_fill(pad, T).flatten()))
    return plan


# ------------------------------------------------------------------------------ simple batches
_LAYOUTS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}
LAYOUT_MAX_S = 16  # rows of at most this many tokens (decodes, verifies, draft links) keep their layout
LAYOUT_ENTRIES = 1024  # layouts kept at most (then new shapes are made each time: a kept one is never
# dropped, since a CUDA graph captured with it reads its memory for as long as the graph lives)


def row_layout(b: int, s: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """What b rows of s tokens index by, a function of the shape alone: (offsets [s], each token's row
    [b * s], each row's first token [b], the token of each row's cells [b, s], the row ids [b]).

    Made once per shape and device for short rows and kept, so a step replayed from a CUDA graph reads
    them as constants instead of making them with a handful of small kernels every replay. Made outside
    inference mode (a later step with autograd may index with them) and not kept when made during a graph
    capture (they would hold their values only once the graph has run); never dropped once kept (a graph
    reads them by address). Nothing writes to them."""
    key = (b, s, dev)
    got = _LAYOUTS.get(key)
    if got is not None:
        return got
    with torch.inference_mode(False), torch.no_grad():
        ids = torch.arange(b, device=dev)
        got = (
            torch.arange(s, device=dev),
            ids.repeat_interleave(s),
            ids * s,
            torch.arange(b * s, device=dev).view(b, s),
            ids,
        )
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if s <= LAYOUT_MAX_S and not capturing and len(_LAYOUTS) < LAYOUT_ENTRIES:
        _LAYOUTS[key] = got
    return got


def uniform_inputs(
    tokens: torch.Tensor,
    start: torch.Tensor,
    wtable: torch.Tensor,
    ctable: torch.Tensor,
    state: torch.Tensor,
    layout: CacheLayout,
    last_only: bool = False,
    static_start: int | None = None,
) -> StepInputs:
    """Inputs for b rows of s tokens each, row b at positions start[b] ... start[b] + s - 1.

    `static_start` (a host int equal to every start) lets the groups that complete be listed on the host
    for s > 1 (a prefill); otherwise every token is a candidate (decode, verify: static shapes).
    """
    b, s = tokens.shape
    dev = tokens.device
    offs, rows, seg_start, cells, row_ids = row_layout(b, s, dev)
    positions = (start.view(b, 1) + offs).flatten()
    groups: dict[int, torch.Tensor | None] = {}
    for r in layout.ratios:
        if static_start is None or s <= r:
            groups[r] = None
        else:
            first = (r - 1 - static_start) % r  # offsets i with (start + i + 1) % r == 0
            idx = torch.arange(first, s, r, device=dev)  # a kernel, not a host copy (capturable)
            groups[r] = (seg_start.view(b, 1) + idx).flatten()
    out = seg_start + s - 1 if last_only else None
    return StepInputs(
        tokens=tokens.flatten(),
        positions=positions,
        rows=rows,
        seg_start=seg_start,
        start=start.expand(b).clone(),
        length=start + s,
        wtable=wtable,
        ctable=ctable,
        state=state,
        groups=groups,
        index_maps=[cells],
        index_rows=[row_ids],
        out=out,
        shape=(b, s),
    )


def token_inputs(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    length: torch.Tensor,
    wtable: torch.Tensor,
    ctable: torch.Tensor,
    state: torch.Tensor,
    layout: CacheLayout,
) -> StepInputs:
    """`uniform_inputs` for b rows of one token each whose positions [b] and lengths [b] (positions + 1) the
    caller has made (a chained draft's link: `ops.spec_advance`): no kernel. The inputs keep both tensors as
    they are, so they must be the caller's own, not a tensor it later changes in place."""
    b, s = tokens.shape
    if s != 1:
        raise ValueError(f"token_inputs takes rows of one token, got {s}")
    _, rows, seg_start, cells, row_ids = row_layout(b, 1, tokens.device)
    return StepInputs(
        tokens=tokens.flatten(),
        positions=positions,
        rows=rows,
        seg_start=seg_start,
        start=positions,
        length=length,
        wtable=wtable,
        ctable=ctable,
        state=state,
        groups={r: None for r in layout.ratios},
        index_maps=[cells],
        index_rows=[row_ids],
        shape=(b, 1),
    )


class BatchCache:
    """b sequences decoded in lockstep from position 0 (the `prefill` / `decode_step` API).

    A paged pool whose tables are fixed: row b owns window and compressed pages 1 + b*n ... (b+1)*n for
    the n = ceil(max_len / page_size) pages of max_len positions (page 0 is the trash page). Nothing is
    freed or shared; the serving engine (`dsv4.engine`) allocates pages on demand instead. The position
    lives on the host (`pos`) and on the device (`pos_t`, read by decode steps so that a step has no host
    synchronization and can be replayed from a CUDA graph).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        page_size: int | None = None,
    ):
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"a cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        ps = page_size or default_page_size(cfg)
        n = -(-max_len // ps)
        self.layout = CacheLayout.for_model(cfg, 1 + batch_size * n, 1 + batch_size * n, batch_size, max_len, ps)
        self.kv = PagedKVCache(cfg, self.layout, device, dtype)
        self.batch_size, self.max_len = batch_size, max_len
        dev = self.kv.device
        pages = 1 + torch.arange(batch_size * n, device=dev).view(batch_size, n)  # [b, n]
        width = self.layout.table_width()
        self.wtable = torch.full((batch_size, width), -1, dtype=torch.long, device=dev)
        self.wtable[:, :n] = pages
        self.ctable = self.wtable.clone()
        self.state = torch.arange(batch_size, device=dev)
        self.pos = 0
        self.pos_t = torch.zeros(1, dtype=torch.long, device=dev)

    def step_inputs(self, tokens: torch.Tensor, static_start: int | None = None, last_only: bool = False) -> StepInputs:
        """Inputs for tokens [b, s] at positions pos ... pos + s - 1 (the start read from pos_t)."""
        start = self.pos_t.expand(tokens.size(0))
        return uniform_inputs(tokens, start, self.wtable, self.ctable, self.state, self.layout, last_only, static_start)

    def advance(self, n: int) -> None:
        self.pos += n
        self.pos_t += n

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache owns (for graph capture: snapshot and restore)."""
        out = [self.pos_t]
        for pool in self.kv.layers:
            out.extend(t for t in (pool.kv, pool.index_keys) if t is not None)
            for ring in (pool.rows, pool.index_rows, pool.tails, pool.index_tails):
                if ring is not None:
                    out.extend((ring.kv, ring.score))
        return out
