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
            out.append(seg[b] + n - 1)
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


def _clone_inputs(inp: StepInputs) -> StepInputs:
    return StepInputs(tokens=inp.tokens.clone(), positions=inp.positions.clone(), rows=inp.rows.clone(),
                      seg_start=inp.seg_start.clone(), start=inp.start.clone(), length=inp.length.clone(),
                      wtable=inp.wtable.clone(), ctable=inp.ctable.clone(), state=inp.state.clone(),
                      groups=dict(inp.groups), index_maps=[m.clone() for m in inp.index_maps],
                      index_rows=[r.clone() for r in inp.index_rows], out=None)


class Runner:
    """Runs steps of the model on one paged cache."""

    def __init__(self, model: DeepSeekV4, cache: PagedKVCache, cuda_graphs: bool = False,
                 max_graph_batch: int = 64):
        self.model, self.cache = model, cache
        self.cuda_graphs = cuda_graphs and cache.device.type == "cuda"
        self.buckets = [b for b in GRAPH_BUCKETS if b <= max_graph_batch]
        self.graphs: dict[int, DecodeGraph] = {}
        self.graph_steps = 0
        self.eager_steps = 0

    def capture_graphs(self) -> int:
        """Capture the decode graph of every bucket now (a server does it before it says it is ready, so
        that no request waits for a capture). Returns the number of graphs."""
        if self.cuda_graphs:
            for bucket in self.buckets:
                if bucket not in self.graphs:
                    self.graphs[bucket] = DecodeGraph(self.model, self.cache, bucket)
        return len(self.graphs)

    def run(self, rows: list[Row], feed=None) -> torch.Tensor:
        """Logits [n, vocab] of the rows that want them, in row order.

        feed = (tokens on the device, [(row, index)]): those rows' (single) input token is tokens[index],
        the token an earlier step sampled and the host has not read yet."""
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
