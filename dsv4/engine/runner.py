"""The model runner: turns a scheduled step (rows of tokens at their positions) into `StepInputs` and
runs `DeepSeekV4.append` on the paged cache, eagerly or, for pure decode steps on a GPU, by replaying a
CUDA graph captured per batch-size bucket.

Host inputs are packed into one int64 buffer and copied to the device in one transfer; every tensor of
`StepInputs` is a view into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model import DeepSeekV4
from ..model.paged import CacheLayout, PagedKVCache, StepInputs

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class Row:
    """One sequence's part of a step: tokens at positions start ... start + len(tokens) - 1."""
    tokens: list[int]
    start: int
    wtable: list[int]
    ctable: list[int]
    state: int
    want_logits: bool
    all_logits: bool = False        # logits at every position of the row (a speculative verify), not the last


class _Packer:
    """Builds named int64 arrays in one host buffer; `to(device)` gives device views of each."""

    def __init__(self):
        self.parts: list[tuple[str, tuple[int, ...], np.ndarray]] = []

    def add(self, name: str, arr) -> None:
        a = np.asarray(arr, dtype=np.int64)
        self.parts.append((name, a.shape, a.reshape(-1)))

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        flat = np.concatenate([a for _, _, a in self.parts]) if self.parts else np.zeros(0, np.int64)
        host = torch.from_numpy(flat)
        dev = host.to(device) if device.type != "cpu" else host               # one transfer
        out, i = {}, 0
        for name, shape, a in self.parts:
            out[name] = dev[i:i + a.size].view(shape)
            i += a.size
        return out


def build_inputs(rows: list[Row], layout: CacheLayout, device: torch.device,
                 pad_to: int | None = None) -> tuple[torch.Tensor, StepInputs]:
    """(tokens [1, T], StepInputs) for the rows, in order. Rows of one token come first in the index
    groups (scored together); every longer row is its own indexer group. pad_to (decode graphs): pad to
    that many one-token rows with padding rows (tables of -1: every write goes to the trash page)."""
    width = layout.table_width()
    n_rows = len(rows) if pad_to is None else pad_to
    lens = [len(r.tokens) for r in rows] + [1] * (n_rows - len(rows))
    seg = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    T = int(sum(lens))
    tokens = np.zeros(T, np.int64)
    positions = np.zeros(T, np.int64)
    row_of = np.repeat(np.arange(n_rows), lens)
    start = np.zeros(n_rows, np.int64)
    length = np.zeros(n_rows, np.int64)
    wtable = np.full((n_rows, width), -1, np.int64)
    ctable = np.full((n_rows, width), -1, np.int64)
    state = np.zeros(n_rows, np.int64)
    out = []
    for b, r in enumerate(rows):
        n = len(r.tokens)
        tokens[seg[b]:seg[b] + n] = r.tokens
        positions[seg[b]:seg[b] + n] = np.arange(r.start, r.start + n)
        start[b], length[b], state[b] = r.start, r.start + n, r.state
        wtable[b, :len(r.wtable)] = r.wtable[:width]
        ctable[b, :len(r.ctable)] = r.ctable[:width]
        if r.want_logits:
            out.extend(seg[b] + np.arange(n) if r.all_logits else [seg[b] + n - 1])
    p = _Packer()
    for name, arr in (("tokens", tokens), ("positions", positions), ("rows", row_of), ("seg_start", seg),
                      ("start", start), ("length", length), ("wtable", wtable), ("ctable", ctable),
                      ("state", state)):
        p.add(name, arr)
    single = [b for b in range(n_rows) if lens[b] == 1]
    multi = [b for b in range(n_rows) if lens[b] > 1]
    index_groups = []
    if single:
        p.add("imap0", seg[single].reshape(-1, 1))
        p.add("irow0", single)
        index_groups.append(("imap0", "irow0"))
    for i, b in enumerate(multi):
        p.add(f"imap{i + 1}", (seg[b] + np.arange(lens[b])).reshape(1, -1))
        p.add(f"irow{i + 1}", [b])
        index_groups.append((f"imap{i + 1}", f"irow{i + 1}"))
    eager_groups = pad_to is None and bool(multi)
    for ratio in layout.ratios:
        if eager_groups:
            done = [seg[b] + i for b in range(n_rows) for i in range(lens[b])
                    if (positions[seg[b] + i] + 1) % ratio == 0]
            p.add(f"g{ratio}", done)
    if pad_to is None:
        p.add("out", out)
    t = p.to(device)
    inputs = StepInputs(
        tokens=t["tokens"], positions=t["positions"], rows=t["rows"], seg_start=t["seg_start"], start=t["start"],
        length=t["length"], wtable=t["wtable"], ctable=t["ctable"], state=t["state"],
        groups={r: (t[f"g{r}"] if eager_groups else None) for r in layout.ratios},
        index_maps=[t[m] for m, _ in index_groups], index_rows=[t[r] for _, r in index_groups],
        out=t["out"] if pad_to is None else None)
    return t["tokens"].view(1, -1), inputs


PREFILL_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048)
PREFILL_ROWS = (1, 2, 4, 8, 16, 32, 64)


def build_prefill(rows: list[Row], layout: CacheLayout, device: torch.device, n_slots: int,
                  length: int) -> tuple[torch.Tensor, StepInputs]:
    """Inputs of fixed shape for whole prompts from position 0: `n_slots` slots of `length` tokens.

    Slot b holds row b's tokens, then padding; the padding (and every empty slot) belongs to one extra
    row with no pages, so its writes go to the trash page and it completes no group. The shapes (T =
    n_slots * length, one indexer group [n_slots, length], the tokens that may complete a group) depend
    only on (n_slots, length), so a step can be replayed from a CUDA graph captured for them."""
    width = layout.table_width()
    pad = n_slots                                        # the padding row
    T = n_slots * length
    tokens = np.zeros(T, np.int64)
    positions = np.zeros(T, np.int64)
    row_of = np.full(T, pad, np.int64)
    seg = np.zeros(n_slots + 1, np.int64)
    seg[:n_slots] = np.arange(n_slots) * length
    start = np.zeros(n_slots + 1, np.int64)
    lens = np.zeros(n_slots + 1, np.int64)
    wtable = np.full((n_slots + 1, width), -1, np.int64)
    ctable = np.full((n_slots + 1, width), -1, np.int64)
    state = np.zeros(n_slots + 1, np.int64)
    qmap = np.full((n_slots, length), -1, np.int64)
    out = np.full(n_slots, T - 1, np.int64)
    for b, r in enumerate(rows):
        n = len(r.tokens)
        if r.start != 0 or n > length:
            raise ValueError("build_prefill takes whole prompts from position 0 that fit the slot")
        lo = b * length
        tokens[lo:lo + n] = r.tokens
        positions[lo:lo + n] = np.arange(n)
        row_of[lo:lo + n] = b
        lens[b], state[b] = n, r.state
        wtable[b, :len(r.wtable)] = r.wtable[:width]
        ctable[b, :len(r.ctable)] = r.ctable[:width]
        qmap[b, :n] = lo + np.arange(n)
        out[b] = lo + n - 1
    p = _Packer()
    for name, arr in (("tokens", tokens), ("positions", positions), ("rows", row_of), ("seg_start", seg),
                      ("start", start), ("length", lens), ("wtable", wtable), ("ctable", ctable),
                      ("state", state), ("imap", qmap), ("irow", np.arange(n_slots)), ("out", out)):
        p.add(name, arr)
    offsets = np.arange(length)
    for ratio in layout.ratios:                          # every slot position that could end a group
        ends = offsets[(offsets + 1) % ratio == 0]
        p.add(f"g{ratio}", (np.arange(n_slots)[:, None] * length + ends).reshape(-1))
    t = p.to(device)
    inputs = StepInputs(
        tokens=t["tokens"], positions=t["positions"], rows=t["rows"], seg_start=t["seg_start"], start=t["start"],
        length=t["length"], wtable=t["wtable"], ctable=t["ctable"], state=t["state"],
        groups={r: t[f"g{r}"] for r in layout.ratios}, index_maps=[t["imap"]], index_rows=[t["irow"]],
        out=t["out"])
    return t["tokens"].view(1, -1), inputs


def prefill_shape(rows: list[Row]) -> tuple[int, int] | None:
    """(slots, length) buckets for a step of whole prompts from position 0, or None."""
    if not rows or any(r.start != 0 or not r.want_logits for r in rows):
        return None
    longest = max(len(r.tokens) for r in rows)
    length = next((n for n in PREFILL_LENGTHS if n >= longest), None)
    slots = next((n for n in PREFILL_ROWS if n >= len(rows)), None)
    if length is None or slots is None:
        return None
    return slots, length


class PrefillGraph:
    """A captured step of whole prompts in `slots` slots of `length` tokens (`build_prefill`)."""

    _NAMES = ("tokens", "positions", "rows", "seg_start", "start", "length", "wtable", "ctable", "state", "out")

    def __init__(self, model: DeepSeekV4, cache: PagedKVCache, slots: int, length: int, pool=None):
        self.model, self.cache, self.shape = model, cache, (slots, length)
        tokens, inputs = build_prefill([], cache.layout, cache.device, slots, length)
        self.tokens, self.inputs = tokens.clone(), _clone_inputs(inputs, keep_out=True)
        side = torch.cuda.Stream(cache.device)
        side.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(side):                     # compile / autotune outside the graph
            for _ in range(2):
                model.append(self.tokens, self.inputs, cache)
        torch.cuda.current_stream(cache.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model.append(self.tokens, self.inputs, cache)

    def run(self, rows: list[Row]) -> torch.Tensor:
        tokens, inputs = build_prefill(rows, self.cache.layout, self.cache.device, *self.shape)
        self.tokens.copy_(tokens)
        for name in self._NAMES[1:]:
            getattr(self.inputs, name).copy_(getattr(inputs, name))
        self.inputs.index_maps[0].copy_(inputs.index_maps[0])
        self.graph.replay()
        return self.logits[:len(rows)]


class DecodeGraph:
    """A captured decode step for `batch` one-token rows; `run(rows)` copies the inputs and replays."""

    def __init__(self, model: DeepSeekV4, cache: PagedKVCache, batch: int):
        self.model, self.cache, self.batch = model, cache, batch
        dev = cache.device
        rows = [Row([0], 0, [], [], 0, True)]
        tokens, inputs = build_inputs(rows, cache.layout, dev, pad_to=batch)
        self.tokens, self.inputs = tokens.clone(), _clone_inputs(inputs)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):                     # compile / autotune kernels outside the graph
            for _ in range(2):
                model.append(self.tokens, self.inputs, cache)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.append(self.tokens, self.inputs, cache)
        # the warm-up steps wrote only to the trash page (padding rows): nothing to restore

    def run(self, rows: list[Row], feed=None) -> torch.Tensor:
        tokens, inputs = build_inputs(rows, self.cache.layout, self.cache.device, pad_to=self.batch)
        self.tokens.copy_(tokens)
        _feed(self.tokens, rows, feed)
        for name in ("positions", "rows", "seg_start", "start", "length", "wtable", "ctable", "state"):
            getattr(self.inputs, name).copy_(getattr(inputs, name))
        self.graph.replay()
        return self.logits[:len(rows)]


def _feed(tokens: torch.Tensor, rows: list[Row], feed) -> None:
    """Write device-resident input tokens (an earlier step's samples) into the flat token buffer."""
    if not feed:
        return
    sampled, src = feed
    starts = np.concatenate([[0], np.cumsum([len(r.tokens) for r in rows])[:-1]])
    dst = torch.tensor([int(starts[r]) for r, _ in src], dtype=torch.long).to(tokens.device)
    idx = torch.tensor([j for _, j in src], dtype=torch.long).to(sampled.device)
    tokens.view(-1).index_copy_(0, dst, sampled[idx].to(tokens.dtype))


def _clone_inputs(inp: StepInputs, keep_out: bool = False) -> StepInputs:
    return StepInputs(tokens=inp.tokens.clone(), positions=inp.positions.clone(), rows=inp.rows.clone(),
                      seg_start=inp.seg_start.clone(), start=inp.start.clone(), length=inp.length.clone(),
                      wtable=inp.wtable.clone(), ctable=inp.ctable.clone(), state=inp.state.clone(),
                      groups={r: (g.clone() if g is not None else None) for r, g in inp.groups.items()},
                      index_maps=[m.clone() for m in inp.index_maps],
                      index_rows=[r.clone() for r in inp.index_rows],
                      out=inp.out.clone() if keep_out and inp.out is not None else None)


class Runner:
    """Runs steps of the model on one paged cache."""

    def __init__(self, model: DeepSeekV4, cache: PagedKVCache, cuda_graphs: bool = False,
                 max_graph_batch: int = 64, pad_prefill: bool = False):
        self.model, self.cache = model, cache
        self.cuda_graphs = cuda_graphs and cache.device.type == "cuda"
        self.pad_prefill = pad_prefill                  # fixed-shape prompt steps also without graphs (tests)
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None   # shared by prefill graphs
        self.buckets = [b for b in GRAPH_BUCKETS if b <= max_graph_batch]
        self.graphs: dict[int, DecodeGraph] = {}
        self.prefill_graphs: dict[tuple[int, int], PrefillGraph] = {}
        self.max_prefill_graph_tokens = 4096
        self.graph_steps = 0
        self.eager_steps = 0
        self.prefill_steps = 0          # whole-prompt steps at a fixed shape (graphed on CUDA)

    def _prefill(self, rows: list[Row], shape: tuple[int, int]) -> torch.Tensor:
        self.prefill_steps += 1
        if not self.cuda_graphs:                        # the same fixed-shape step, eagerly (tested on a CPU)
            tokens, inputs = build_prefill(rows, self.cache.layout, self.cache.device, *shape)
            self.eager_steps += 1
            return self.model.append(tokens, inputs, self.cache)
        graph = self.prefill_graphs.get(shape)
        if graph is None:
            graph = self.prefill_graphs[shape] = PrefillGraph(self.model, self.cache, *shape, pool=self._pool)
        self.graph_steps += 1
        return graph.run(rows)

    def capture_graphs(self) -> int:
        """Capture the decode graph of every bucket now (a server does it before it says it is ready, so
        that no request waits for a capture). Returns the number of graphs."""
        if self.cuda_graphs:
            for bucket in self.buckets:
                if bucket not in self.graphs:
                    self.graphs[bucket] = DecodeGraph(self.model, self.cache, bucket)
            for length in PREFILL_LENGTHS:                 # the common prompt shapes (others: on first use)
                for slots in PREFILL_ROWS:
                    if length <= 512 and slots * length <= self.max_prefill_graph_tokens and \
                            (slots, length) not in self.prefill_graphs:
                        self.prefill_graphs[(slots, length)] = PrefillGraph(self.model, self.cache, slots, length,
                                                                            pool=self._pool)
        return len(self.graphs) + len(self.prefill_graphs)

    def run_hidden(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """An eager step that also returns the hidden states [T, hc, dim] (the MTP draft's input):
        (logits [n, vocab] of the rows that want them, hidden)."""
        tokens, inputs = build_inputs(rows, self.cache.layout, self.cache.device)
        self.eager_steps += 1
        return self.model.append(tokens, inputs, self.cache, return_hidden=True)

    def run(self, rows: list[Row], feed=None) -> torch.Tensor:
        """Logits [n, vocab] of the rows that want them, in row order.

        feed = (tokens on the device, [(row, index)]): those rows' (single) input token is tokens[index],
        the token an earlier step sampled and the host has not read yet.

        On CUDA: decode rows replay a decode graph; a step whose other rows are all whole prompts (from
        position 0, within the largest slot) replays a prefill graph for those (two replays, no eager
        step); anything else runs eagerly."""
        if self.cuda_graphs or self.pad_prefill:
            k = next((i for i, r in enumerate(rows) if len(r.tokens) > 1), len(rows))
            shape = prefill_shape(rows[k:])
            if k < len(rows) and shape is not None and shape[0] * shape[1] <= self.max_prefill_graph_tokens and \
                    all(len(r.tokens) == 1 and r.want_logits for r in rows[:k]):
                parts = [self.run(rows[:k], feed)] if k else []
                parts.append(self._prefill(rows[k:], shape))
                return torch.cat(parts) if len(parts) > 1 else parts[0]
        decode = all(len(r.tokens) == 1 and r.want_logits for r in rows)
        if self.cuda_graphs and decode and len(rows) <= self.buckets[-1]:
            bucket = next(b for b in self.buckets if b >= len(rows))
            graph = self.graphs.get(bucket)
            if graph is None:
                graph = self.graphs[bucket] = DecodeGraph(self.model, self.cache, bucket)
            self.graph_steps += 1
            return graph.run(rows, feed)
        tokens, inputs = build_inputs(rows, self.cache.layout, self.cache.device)
        _feed(tokens, rows, feed)
        self.eager_steps += 1
        return self.model.append(tokens, inputs, self.cache)
