"""A step's rows laid out as the model's `StepInputs`: host arrays first, device tensors after one copy.

Every integer a step needs is a named field of one flat int64 array (`Fields`), so the host fills numpy
views and the device receives it in a single transfer. Two layouts:

- **ragged** (`ragged_fields`): the rows exactly as scheduled, no padding; the shapes change every step, so
  it runs eagerly (CPUs, and steps no bucket covers).
- **bucketed** (`Bucket`, `fill_bucket`): D one-token rows, then C slots of L tokens for prompt chunks (a
  chunk of n tokens fills ceil(n / L) consecutive slots), D + C x L tokens in all. Every shape depends on
  (D, C, L) only, so one CUDA graph per bucket replays any step that fits it. Padding tokens (unused
  decode rows, the rest of a slot) belong to the padding row, which has no pages: their writes go to the
  trash page and they complete no group, so the real rows compute exactly what the ragged layout
  computes. The fixed-length lists (groups, kept rows, logits rows) name, where a row has fewer entries
  than its share, a token of the same row or slot: a decode row its own token, a slot its last token (in
  a partly filled slot a padding token; in a full one a real token, whose listing again writes what its
  own listing writes, or, as it completes no group, writes to the trash page). No token is added for
  them: one more token costs every kernel of the step a row (1-2% of a decode step). Where a compressor
  keeps fewer raw rows than a slot holds tokens (`KeepRule`), the bucket also lists, per slot, the tokens
  that may leave raw rows for later steps; only those are written (the rest of a long chunk would all be
  written to the trash row).

Tables are not in the fields: each row names its table row (`trow`, the sequence's ring slot), and the
device gathers the rows of the page tables it keeps (`BlockTables`, copied a few changed rows per step).
A row's single input token can also come from the device (`feed`: an index into the previous step's
sampled tokens), so a step can be launched before the host has read the last one's tokens.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..model.paged import CacheLayout, StepInputs

HEAL_ROWS = 4  # rows under a token-healing constraint that a step with the MTP catch-up draws in its graph


@dataclass(slots=True)
class Row:
    """One sequence's part of a step: tokens at positions start ... start + len(tokens) - 1."""

    tokens: list[int]
    start: int
    state: int  # ring slot, which is also the row of the page tables
    want_logits: bool
    all_logits: bool = False  # logits at every position of the row (a speculative verify), not the last
    feed: int = -1  # >= 0: the (single) input token is the previous step's sampled token [feed]
    after: int = -1  # >= 0: the token after the row's last position, known (a prompt chunk the prompt goes on
    # after); else it is the row's sampled token. Read by a bucket that carries the MTP catch-up (`Bucket.mtp`)


class Fields:
    """Named int64 arrays in one flat buffer: spec [(name, shape)] -> views by name."""

    def __init__(self, spec: list[tuple[str, tuple[int, ...]]]):
        self.spec = spec
        self.offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
        at = 0
        for name, shape in spec:
            self.offsets[name] = (at, shape)
            at += math.prod(shape)
        self.size = at

    def views(self, flat):
        """{name: view} of a flat numpy array or torch tensor of at least `size` elements."""
        out = {}
        for name, (at, shape) in self.offsets.items():
            n = math.prod(shape)
            v = flat[at : at + n]
            out[name] = v.reshape(shape) if isinstance(v, np.ndarray) else v.view(shape)
        return out


_ROW_FIELDS = ("seg", "start", "length", "state", "trow")


def _base_spec(T: int, B: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("tok", (T,)), ("feed", (T,)), ("pos", (T,)), ("row", (T,))] + [(f, (B,)) for f in _ROW_FIELDS]


# ------------------------------------------------------------------------------------------ bucketed
@dataclass(frozen=True)
class KeepRule:
    """Tokens of a chunk that leave raw rows in a compressor of `ratio` (`CacheLayout.raw_keep`): the last
    `ring` of the chunk, and those at a position p with p % page >= page - tail; at most `per_slot` in a
    slot (`CacheLayout.keep_bound`)."""

    ratio: int
    ring: int
    tail: int
    page: int
    per_slot: int

    @classmethod
    def for_layout(cls, layout: CacheLayout, slot_len: int) -> tuple[KeepRule, ...]:
        """The rules of the ratios where a slot holds more tokens than can leave raw rows."""
        rules = []
        for r in layout.ratios:
            ring, tail = layout.raw_keep(r)
            k = layout.keep_bound(r, slot_len)
            if k < slot_len:
                rules.append(cls(r, ring, tail, layout.page_size, k))
        return tuple(rules)

    def kept(self, pos: np.ndarray, length: int) -> np.ndarray:
        """bool [n]: which tokens at positions pos (a chunk ending at length) may leave raw rows."""
        mask = pos >= length - self.ring
        if self.tail:
            mask |= pos % self.page >= self.page - self.tail
        return mask


@dataclass(frozen=True)
class Bucket:
    """A fixed step shape: `decode` one-token rows, `slots` chunk slots of `slot_len` tokens."""

    decode: int
    slots: int
    slot_len: int
    ratios: tuple[int, ...]
    keep: tuple[KeepRule, ...] = ()
    mtp: bool = False  # the step also runs the MTP block's catch-up (speculative decoding): fields nx, nxo

    @property
    def tokens(self) -> int:
        return self.decode + self.slots * self.slot_len

    @property
    def rows(self) -> int:
        return self.decode + self.slots + 1  # + the padding row

    @property
    def n_out(self) -> int:
        return self.decode + self.slots

    def group_len(self, ratio: int) -> int:
        """Tokens that may complete a group of `ratio`: every decode token, ceil(L / ratio) per slot."""
        return self.decode + self.slots * -(-self.slot_len // ratio)

    def fields(self) -> Fields:
        """The bucket's layout (made once per bucket: every step of the bucket asks for it)."""
        return _bucket_fields(self)

    def fits(self, n_decode: int, n_slots: int) -> bool:
        return n_decode <= self.decode and n_slots <= self.slots


@functools.cache
def _bucket_fields(b: Bucket) -> Fields:
    spec = _base_spec(b.tokens, b.rows)
    spec += [(f"g{r}", (b.group_len(r),)) for r in b.ratios]
    if b.slots:
        spec += [(f"k{k.ratio}", (b.decode + b.slots * k.per_slot,)) for k in b.keep]
    if b.decode:
        spec += [("imap0", (b.decode, 1)), ("irow0", (b.decode,))]
    if b.slots:
        spec += [("imap1", (b.slots, b.slot_len)), ("irow1", (b.slots,))]
    spec += [("out", (b.n_out,))]
    # every out row is drawn in the graph with its settings (`SamplingTensors.pack`: floats as float64 bits)
    spec += [("s_f", (b.n_out, 4)), ("s_i", (b.n_out, 4))]
    if b.mtp:  # the token after each position: nx, or where nxo >= 0 the step's draw at out row nxo;
        # heal: the out rows drawn under a token-healing constraint (-1: none; `Runner.heal_rows`)
        spec += [("nx", (b.tokens,)), ("nxo", (b.tokens,)), ("heal", (HEAL_ROWS,))]
    return Fields(spec)


@functools.cache
def _blank(b: Bucket, pad_trow: int) -> dict[str, np.ndarray]:
    """The fields of bucket b with no row in it: every token, row and list entry as padding (see the
    module docstring), which `fill_bucket` copies before it writes the rows (made once per bucket)."""
    D, L, T = b.decode, b.slot_len, b.tokens
    pad = b.rows - 1
    fields = b.fields()
    v = fields.views(np.zeros(fields.size, np.int64))
    v["feed"][:] = -1
    v["row"][:] = pad
    v["seg"][:] = T - 1
    v["trow"][:] = pad_trow
    if b.mtp:
        v["nxo"][:] = -1
        v["heal"][:] = -1
    if D:
        v["imap0"][:] = -1
        v["irow0"][:] = pad
    # the lists' entries that no row fills: a decode row's own token, a slot's last token
    slot_last = D + np.arange(b.slots, dtype=np.int64) * L + L - 1
    for r in b.ratios:
        g = v[f"g{r}"]
        g[:D] = np.arange(D)
        g[D:] = np.repeat(slot_last, -(-L // r))
    for k in b.keep if b.slots else ():
        kt = v[f"k{k.ratio}"]
        kt[:D] = np.arange(D)
        kt[D:] = np.repeat(slot_last, k.per_slot)
    v["out"][:D] = np.arange(D)
    v["out"][D:] = slot_last
    if b.slots:
        v["imap1"][:] = -1
        v["irow1"][:] = pad
    v = {name: a for name, a in v.items() if name not in ("s_f", "s_i")}  # (the runner's: sampling settings)
    for a in v.values():
        a.flags.writeable = False
    return v


def _within(groups: np.ndarray) -> np.ndarray:
    """Each entry's rank among the entries of its group, for sorted group ids: [3, 3, 5, 7, 7, 7] ->
    [0, 1, 0, 0, 1, 2]."""
    return np.arange(len(groups)) - np.searchsorted(groups, groups)


def fill_bucket(b: Bucket, decode: list[Row], chunks: list[Row], v: dict[str, np.ndarray], pad_trow: int) -> list[int]:
    """Write the rows into the field views `v` of bucket b. -> the logits row (index into `out`) of each
    row in order (decode rows, then chunks)."""
    D, L = b.decode, b.slot_len
    for name, blank in _blank(b, pad_trow).items():
        np.copyto(v[name], blank)
    nd = len(decode)
    logits_rows = list(range(nd))
    if nd:
        start = np.fromiter((r.start for r in decode), np.int64, nd)
        state = np.fromiter((r.state for r in decode), np.int64, nd)
        v["tok"][:nd] = np.fromiter((r.tokens[0] for r in decode), np.int64, nd)
        v["feed"][:nd] = np.fromiter((r.feed for r in decode), np.int64, nd)
        v["pos"][:nd] = start
        idx = np.arange(nd)
        v["row"][:nd] = idx
        v["seg"][:nd] = idx
        v["start"][:nd] = start
        v["length"][:nd] = start + 1
        v["state"][:nd] = state
        v["trow"][:nd] = state
        v["imap0"][:nd, 0] = idx
        v["irow0"][:nd] = idx
        if b.mtp:
            after = np.fromiter((r.after for r in decode), np.int64, nd)
            want = np.fromiter((r.want_logits for r in decode), bool, nd)
            v["nx"][:nd] = np.maximum(after, 0)
            v["nxo"][:nd] = np.where((after >= 0) | ~want, -1, idx)
    nc = len(chunks)
    if not nc:
        return logits_rows
    # every chunk token at once: chunk c's n tokens fill k = ceil(n / L) slots from its first slot, at
    # token lo + j (j < n) of the step
    n = np.fromiter((len(r.tokens) for r in chunks), np.int64, nc)
    cstart = np.fromiter((r.start for r in chunks), np.int64, nc)
    k = -(-n // L)
    slot0 = np.cumsum(k) - k  # each chunk's first slot
    lo = D + slot0 * L
    rows = D + np.arange(nc)
    of = np.repeat(np.arange(nc), n)  # the chunk of each token
    j = np.arange(len(of)) - np.repeat(np.cumsum(n) - n, n)
    at = lo[of] + j  # the step's token
    pos = cstart[of] + j
    toks = np.fromiter(itertools.chain.from_iterable([r.tokens for r in chunks]), np.int64, len(of))
    v["tok"][at] = toks
    v["pos"][at] = pos
    v["row"][at] = rows[of]
    v["seg"][rows], v["start"][rows], v["length"][rows] = lo, cstart, cstart + n
    v["state"][rows] = v["trow"][rows] = np.fromiter((r.state for r in chunks), np.int64, nc)
    v["imap1"].reshape(-1)[at - D] = at
    slot_of = np.repeat(np.arange(nc), k)  # the chunk of each slot
    s = np.arange(len(slot_of)) - np.repeat(slot0, k)  # each slot's index in its chunk
    v["irow1"][: len(slot_of)] = rows[slot_of]
    out = v["out"]
    out[D : D + len(slot_of)] = lo[slot_of] + np.minimum((s + 1) * L, n[slot_of]) - 1  # each slot's last token
    slot_at = (at - D) // L  # each token's slot
    for ratio in b.ratios:  # tokens that complete a group, listed in their slot's share
        done = (pos + 1) % ratio == 0
        m = -(-L // ratio)
        v[f"g{ratio}"][D + slot_at[done] * m + _within(slot_at[done])] = at[done]
    for rule in b.keep:
        kept = rule.kept(pos, (cstart + n)[of])
        rank = _within(slot_at[kept])
        assert not len(rank) or rank.max() < rule.per_slot, "CacheLayout.keep_bound undercounts"
        v[f"k{rule.ratio}"][D + slot_at[kept] * rule.per_slot + rank] = at[kept]
    last = D + slot0 + k - 1  # each chunk's logits row: its last slot's
    logits_rows += last.tolist()
    if b.mtp:
        inner = j < n[of] - 1
        v["nx"][at[inner]] = toks[np.nonzero(inner)[0] + 1]
        end = lo + n - 1
        after = np.fromiter((r.after for r in chunks), np.int64, nc)
        want = np.fromiter((r.want_logits for r in chunks), bool, nc)
        v["nx"][end] = np.maximum(after, 0)
        v["nxo"][end] = np.where((after >= 0) | ~want, -1, last)
    return logits_rows


# ------------------------------------------------------------------------------------------ ragged
def ragged_fields(rows: list[Row], ratios: tuple[int, ...], pad_trow: int) -> tuple[Fields, np.ndarray, list[int]]:
    """The rows exactly (no padding). Rows of one token form one indexer group; every longer row is a group
    of its own; only tokens that complete a group are listed. -> (fields, filled array, logits row of each
    row, -1 where it wants none; for an all_logits row the first of its consecutive rows)."""
    lens = [len(r.tokens) for r in rows]
    B = len(rows)
    seg = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if B else np.zeros(0, np.int64)
    T = int(sum(lens))
    pos = np.concatenate([np.arange(r.start, r.start + n) for r, n in zip(rows, lens)]) if B else np.zeros(0)
    single = [b for b in range(B) if lens[b] == 1]
    multi = [b for b in range(B) if lens[b] > 1]
    done = {ratio: np.nonzero((pos + 1) % ratio == 0)[0] for ratio in ratios}
    out, logits_rows = [], []
    for b, r in enumerate(rows):
        logits_rows.append(len(out) if r.want_logits else -1)
        if r.want_logits:
            out.extend(seg[b] + np.arange(lens[b]) if r.all_logits else [seg[b] + lens[b] - 1])
    spec = _base_spec(T, B) + [(f"g{ratio}", (len(done[ratio]),)) for ratio in ratios]
    groups = ([(single, (len(single), 1))] if single else []) + [([b], (1, lens[b])) for b in multi]
    spec += [x for i, (_, shape) in enumerate(groups) for x in ((f"imap{i}", shape), (f"irow{i}", (shape[0],)))]
    spec += [("out", (len(out),))]
    fields = Fields(spec)
    buf = np.empty(fields.size, np.int64)
    v = fields.views(buf)
    v["tok"][:] = [t for r in rows for t in r.tokens]
    v["feed"][:] = [r.feed if n == 1 else -1 for r, n in zip(rows, lens) for _ in range(n)]
    v["pos"][:] = pos
    v["row"][:] = np.repeat(np.arange(B), lens)
    v["seg"][:] = seg
    v["start"][:] = [r.start for r in rows]
    v["length"][:] = [r.start + n for r, n in zip(rows, lens)]
    v["state"][:] = v["trow"][:] = [r.state for r in rows]
    for ratio in ratios:
        v[f"g{ratio}"][:] = done[ratio]
    for i, (members, _) in enumerate(groups):
        if len(members) == 1 and lens[members[0]] > 1:
            b = members[0]
            v[f"imap{i}"][0] = seg[b] + np.arange(lens[b])
        else:
            v[f"imap{i}"][:, 0] = seg[members]
        v[f"irow{i}"][:] = members
    v["out"][:] = out
    del pad_trow  # ragged steps have no padding rows
    return fields, buf, logits_rows


# ------------------------------------------------------------------------------------------ on the device
def step_inputs(
    t: dict[str, torch.Tensor],
    ratios: tuple[int, ...],
    tables_w: torch.Tensor,
    tables_c: torch.Tensor,
    sampled: torch.Tensor | None,
) -> tuple[torch.Tensor, StepInputs]:
    """(tokens [1, T], StepInputs) from device field views: fed tokens taken from `sampled`, page tables
    gathered by table row. No host synchronization (capturable)."""
    tok = t["tok"]
    if sampled is not None:
        feed = t["feed"]
        tok = torch.where(feed >= 0, sampled[feed.clamp_min(0)], tok)
    trow = t["trow"]
    ids = sorted(int(name[4:]) for name in t if name.startswith("imap"))
    maps, rows = [t[f"imap{i}"] for i in ids], [t[f"irow{i}"] for i in ids]
    inputs = StepInputs(
        tokens=tok,
        positions=t["pos"],
        rows=t["row"],
        seg_start=t["seg"],
        start=t["start"],
        length=t["length"],
        wtable=tables_w[trow],
        ctable=tables_c[trow],
        state=t["state"],
        groups={r: t[f"g{r}"] for r in ratios},
        keep={r: t[f"k{r}"] for r in ratios if f"k{r}" in t},
        index_maps=maps,
        index_rows=rows,
        out=t["out"],
    )
    return tok.view(1, -1), inputs
