"""Host-side bookkeeping of the paged cache: page allocation, per-sequence page tables, prefix reuse.

Two page kinds (see `dsv4.model.paged`): *window* pages hold every layer's window rows of `page_size`
positions and are needed only while they are inside the window; *compressed* pages hold the compressed
entries and indexer keys of `page_size` positions and are needed for the whole sequence. Pages are
reference counted: a page can belong to several sequences (a shared prompt prefix) and to the prefix
cache at once; it returns to the free list when its last reference goes.

Prefix caching works at page granularity, the granularity the compressed caches allow: a page is
reusable once all its positions are computed, because every compressed group inside it is then complete
(page_size is a multiple of every compression ratio). A cached page k is keyed by a hash of all tokens
up to its end; a new sequence whose prompt starts with the same tokens reuses compressed pages 0..m and
the window pages covering the window before position (m+1)*P, and resumes there. The ratio-4
compressors' pooling overlaps the previous group, so each compressed page also keeps its last group's
raw rows (`page_tails`), which are copied into the new sequence's ring.

With speculative decoding by the MTP block (`next_token_keys`), window pages also hold that block's rows,
and its row at a position is computed from the token after it: the row at a page's last position depends
on the first token of the next page. A window page is then keyed by its chain hash and that token too, so a
sequence reuses it only where its own next token is the same (and the page is offered to the cache once
that token is known): the drafts, and so a sampled request's tokens, never depend on which sequence
computed a shared prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..model.paged import CacheLayout


class PagePool:
    """Free list and reference counts of one page kind; page 0 is reserved (the trash page).

    A page can also be held by the prefix cache (`cached`); `evictable` counts the cached pages that
    nothing else holds, so the free capacity is known without scanning the cache."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free: list[int] = list(range(n_pages - 1, 0, -1))  # pop() hands out low ids first
        self.refs = [0] * n_pages
        self.cached = [False] * n_pages
        self.evictable = 0

    def alloc(self) -> int | None:
        if not self.free:
            return None
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self.cached[page] and self.refs[page] == 1:
            self.evictable -= 1
        self.refs[page] += 1

    def decref(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if self.cached[page]:
                self.cached[page] = False
                self.evictable -= 1
            self.free.append(page)
        elif self.refs[page] < 0:
            raise RuntimeError(f"page {page} released more often than taken")
        elif self.refs[page] == 1 and self.cached[page]:
            self.evictable += 1

    def cache(self, page: int) -> None:
        """The prefix cache takes a reference on the page."""
        self.incref(page)
        self.cached[page] = True

    def uncache(self, page: int) -> None:
        """The prefix cache drops its reference."""
        if self.refs[page] == 1:
            self.evictable -= 1
        self.cached[page] = False
        self.decref(page)

    @property
    def n_free(self) -> int:
        return len(self.free)


class BlockTables:
    """The page tables of every ring slot: logical page -> physical page (-1: none), one row per slot of
    `table_width` columns for the window and one for the compressed pages. Row `n_states` stays all -1
    (the rows of padding). The host owns them; rows changed since the last `take_dirty` are what a
    runner must copy to its device copy before the next step (a few rows per step, not the tables)."""

    def __init__(self, n_states: int, width: int):
        self.w = np.full((n_states + 1, width), -1, dtype=np.int64)
        self.c = np.full((n_states + 1, width), -1, dtype=np.int64)
        self.pad_row = n_states
        self.dirty: set[int] = set()

    def take_dirty(self) -> np.ndarray:
        rows = np.fromiter(sorted(self.dirty), dtype=np.int64, count=len(self.dirty))
        self.dirty.clear()
        return rows


@dataclass(eq=False)
class SeqPages:
    """The pages and ring slot of one running sequence; its table rows live in `BlockTables`."""

    state: int
    tables: BlockTables
    hashes: list[bytes] = field(default_factory=list)  # chain hash of each complete page's tokens
    registered: int = 0  # pages offered to the prefix cache so far
    wregistered: int = 0  # window pages offered so far (with next-token keys, up to the last known token)
    trimmed: int = 0  # window pages before this one are released

    @property
    def wtable(self) -> np.ndarray:
        return self.tables.w[self.state]

    @property
    def ctable(self) -> np.ndarray:
        return self.tables.c[self.state]


def page_hashes(tokens: list[int], page_size: int, n_pages: int, parent: bytes = b"") -> list[bytes]:
    """Chain hashes of the first n_pages pages of tokens: page k's hash covers tokens [0, (k+1)*P)."""
    out = []
    h = parent
    for k in range(n_pages):
        chunk = tokens[k * page_size : (k + 1) * page_size]
        h = hashlib.blake2b(h + b"|" + ",".join(map(str, chunk)).encode(), digest_size=16).digest()
        out.append(h)
    return out


class CacheManager:
    """Allocates pages and ring slots for sequences and runs the prefix cache (LRU eviction)."""

    def __init__(
        self,
        layout: CacheLayout,
        prefix_caching: bool = True,
        has_compressed: bool = True,
        next_token_keys: bool = False,
    ):
        self.layout = layout
        self.P, self.window = layout.page_size, layout.window
        self.wpool = PagePool(layout.n_window_pages)
        self.cpool = PagePool(layout.n_comp_pages) if has_compressed else None
        self.tables = BlockTables(layout.n_states, layout.table_width())
        self.free_states = list(range(layout.n_states - 1, -1, -1))
        self.prefix_caching = prefix_caching
        self.next_token_keys = next_token_keys  # window pages keyed by the token after them too (module doc)
        # page hash -> page, least recently used first; each holds one reference on its page
        self.cached_c: OrderedDict[bytes, int] = OrderedDict()
        self.cached_w: OrderedDict[bytes, int] = OrderedDict()
        self.hits = 0  # prompt tokens served from the prefix cache
        self.queries = 0  # prompt tokens looked up

    # ------------------------------------------------------------------ capacity
    def free_pages(self) -> tuple[int, int]:
        """(window, compressed) pages free or held only by the prefix cache (evictable)."""
        w = self.wpool.n_free + self.wpool.evictable
        if self.cpool is None:
            return w, 1 << 30
        return w, self.cpool.n_free + self.cpool.evictable

    def usage(self) -> float:
        """Fraction of pages in use by running sequences (cached-but-idle pages count as free)."""
        w, c = self.free_pages()
        fw = 1 - w / max(1, self.wpool.n_pages - 1)
        if self.cpool is None:
            return fw
        return max(fw, 1 - c / max(1, self.cpool.n_pages - 1))

    def pages_for(self, start: int, end: int) -> tuple[int, int]:
        """New (window, compressed) pages a sequence at length `start` needs to append up to `end`."""
        P = self.P
        first_w = max(0, start - self.window + 1) // P
        have_w = max(0, (start - 1) // P + 1) if start else 0
        w = max(0, (end - 1) // P + 1 - max(first_w, have_w))
        c = max(0, (end - 1) // P + 1 - have_w) if self.cpool is not None else 0
        return w, c

    def can_fit(self, start: int, end: int, reserve: tuple[int, int] = (0, 0)) -> bool:
        w, c = self.pages_for(start, end)
        fw, fc = self.free_pages()
        return w + reserve[0] <= fw and c + reserve[1] <= fc

    # ------------------------------------------------------------------ sequences
    def new_sequence(self) -> SeqPages | None:
        if not self.free_states:
            return None
        return SeqPages(state=self.free_states.pop(), tables=self.tables)

    def _alloc(self, pool: PagePool, cached: OrderedDict[bytes, int]) -> int | None:
        page = pool.alloc()
        while page is None:
            if not pool.evictable:
                return None
            victim = next(h for h, p in cached.items() if pool.refs[p] == 1)
            pool.uncache(cached.pop(victim))
            page = pool.alloc()
        return page

    def allocate(self, seq: SeqPages, start: int, end: int) -> bool:
        """Make sure pages exist for appending positions [start, end) (and the window before start).
        False (nothing kept half-done matters: pages taken stay with the sequence) when memory is short."""
        P = self.P
        last = (end - 1) // P
        if last >= self.tables.w.shape[1]:
            raise ValueError(f"positions up to {end} do not fit a table of {self.tables.w.shape[1]} pages")
        for table, pool, cached, first in (
            (seq.wtable, self.wpool, self.cached_w, max(max(0, start - self.window + 1) // P, seq.trimmed)),
            (seq.ctable, self.cpool, self.cached_c, 0),
        ):
            if pool is None:
                continue
            for k in range(first, last + 1):
                if table[k] < 0:
                    page = self._alloc(pool, cached)
                    if page is None:
                        return False
                    table[k] = page
                    self.tables.dirty.add(seq.state)
        return True

    def trim_window(self, seq: SeqPages, length: int) -> None:
        """Release window pages no future token can see (all positions < length - window + 1)."""
        keep_from = min(max(0, length - self.window + 1) // self.P, self.tables.w.shape[1])
        if keep_from <= seq.trimmed:
            return
        table = seq.wtable
        for k in range(seq.trimmed, keep_from):
            if table[k] > 0:
                self.wpool.decref(int(table[k]))
                table[k] = -1
                self.tables.dirty.add(seq.state)
        seq.trimmed = keep_from

    def release(self, seq: SeqPages) -> None:
        for table, pool in ((seq.wtable, self.wpool), (seq.ctable, self.cpool)):
            if pool is None:
                continue
            for page in table[table > 0].tolist():
                pool.decref(page)
            table[:] = -1
        self.tables.dirty.add(seq.state)
        seq.trimmed = 0
        self.free_states.append(seq.state)

    # ------------------------------------------------------------------ prefix cache
    def match(self, seq: SeqPages, tokens: list[int]) -> int:
        """Reuse cached pages for the longest cached prefix of tokens that leaves at least one token to
        compute. Returns the number of positions served (a multiple of page_size; 0 on a miss)."""
        if not self.prefix_caching:
            return 0
        P = self.P
        self.queries += len(tokens)
        hashes, wkeys = self.prompt_keys(tokens)
        m = self._servable(hashes, wkeys)  # pages reused
        if m == 0:
            return 0
        if self.cpool is not None:
            for k in range(m):
                page = self.cached_c[hashes[k]]
                self.cached_c.move_to_end(hashes[k])
                self.cpool.incref(page)
                seq.ctable[k] = page
        first = max(0, m * P - self.window) // P
        for k in range(first, m):
            page = self.cached_w[wkeys[k]]
            self.cached_w.move_to_end(wkeys[k])
            self.wpool.incref(page)
            seq.wtable[k] = page
        self.tables.dirty.add(seq.state)
        seq.trimmed = first
        seq.hashes = hashes[:m]
        seq.registered = seq.wregistered = m
        self.hits += m * P
        return m * P

    def prompt_keys(self, tokens: list[int]) -> tuple[list[bytes], list[bytes]]:
        """(page hashes, window page keys) of the pages a prompt of these tokens may reuse: its first
        (len(tokens) - 1) // P pages (one token is always left to compute)."""
        hashes = page_hashes(tokens, self.P, (len(tokens) - 1) // self.P)
        return hashes, self._window_keys(hashes, tokens)

    def cached_prefix(self, keys: tuple[list[bytes], list[bytes]]) -> int:
        """The positions `match` would serve from the cache for a prompt of these `prompt_keys`, now, without
        taking anything."""
        return self._servable(*keys) * self.P if self.prefix_caching else 0

    def _window_keys(self, hashes: list[bytes], tokens: list[int]) -> list[bytes]:
        """The window pages' cache keys: their hashes, or with `next_token_keys` each hash with the token
        after its page (only for pages whose next token is among `tokens`)."""
        if not self.next_token_keys:
            return hashes
        P = self.P
        return [
            hashlib.blake2b(h + b">" + str(tokens[(k + 1) * P]).encode(), digest_size=16).digest()
            for k, h in enumerate(hashes)
            if (k + 1) * P < len(tokens)
        ]

    def _servable(self, hashes: list[bytes], wkeys: list[bytes]) -> int:
        """How many leading pages of these hashes the cache can serve: each one's compressed page and the
        window pages a sequence at its end still reads (looked up by `wkeys`)."""
        P, best = self.P, -1
        for k, h in enumerate(hashes[: len(wkeys)]):
            if self.cpool is not None and h not in self.cached_c:
                break
            need = range(max(0, (k + 1) * P - self.window) // P, k + 1)
            if all(wkeys[i] in self.cached_w for i in need):
                best = k
        return best + 1

    def register(self, seq: SeqPages, tokens: list[int], computed: int) -> None:
        """Offer the sequence's newly complete pages (all positions < computed) to the prefix cache."""
        if not self.prefix_caching:
            return
        P = self.P
        n = computed // P
        nw = min(n, (len(tokens) - 1) // P) if self.next_token_keys else n  # (their next token known)
        if n <= seq.registered and nw <= seq.wregistered:
            return
        if n > len(seq.hashes):
            parent = seq.hashes[-1] if seq.hashes else b""
            seq.hashes.extend(page_hashes(tokens[len(seq.hashes) * P :], P, n - len(seq.hashes), parent))
        wt, ct = seq.wtable, seq.ctable
        for k in range(seq.registered, n):
            h = seq.hashes[k]
            if self.cpool is not None and ct[k] > 0 and h not in self.cached_c:
                self.cpool.cache(int(ct[k]))
                self.cached_c[h] = int(ct[k])
        seq.registered = max(seq.registered, n)
        if nw > seq.wregistered:
            wkeys = self._window_keys(seq.hashes[:nw], tokens)
            for k in range(seq.wregistered, nw):
                if wt[k] > 0 and wkeys[k] not in self.cached_w:
                    self.wpool.cache(int(wt[k]))
                    self.cached_w[wkeys[k]] = int(wt[k])
            seq.wregistered = nw
