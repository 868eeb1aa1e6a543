"""Decode steps and fixed-shape prefills replayed from CUDA graphs.

`DeepSeekV4.decode_step` is a fixed sequence of kernels that reads the position from `cache.pos_t` on the
device and never synchronizes with the host, so one step can be captured once and replayed for every
new token: the per-step cost drops from thousands of kernel launches from Python to one graph launch.

`DeepSeekV4.prefill` is the same at a fixed [batch, seq] shape (the token-value check, the one host sync,
is skipped while capturing and done by `GraphedPrefill.run` instead), so a caller that pads prompts to a
few bucket lengths can capture one graph per bucket. (The serving engine's own decode graphs, over the
shared paged cache, are `dsv4.engine.runner.DecodeGraph`.)
"""

from __future__ import annotations

import torch

from .. import ops
from ..model import BatchCache, DeepSeekV4
from ..ops.cuda_graphs import capturing


class GraphedDecoder:
    """Captures `model.decode_step(tokens, cache)` for one cache; `step(tokens)` replays it.

    Two executable graphs of the step, replayed in turn (as the serving engine's, `BucketGraph`): a graph
    launched while its own previous launch still runs makes the driver wait for it and push every node
    again, the device idle meanwhile (about 0.4 ms of a 4-5 ms `small` step on an H200), and a caller that
    never waits for the device launches the next step while the last one runs. The returned logits
    tensor is its graph's: the step after next overwrites it (copy it to keep it). The cache must not be
    replaced or resized afterwards; capture after the prefill.
    """

    def __init__(self, model: DeepSeekV4, cache: BatchCache, warmup: int = 2):
        dev = cache.pos_t.device
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, this one is on {dev}")
        self.model, self.cache = model, cache
        ops.keep_splits(model)  # the graph replays fixed weights: fp32 projections split once
        batch = cache.batch_size
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        state = [t.clone() for t in cache.tensors()]
        host_pos = cache.pos
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile / autotune kernels outside the graph
            for _ in range(warmup):
                model.decode_step(self.tokens, cache)
                cache.pos = host_pos
        torch.cuda.current_stream(dev).wait_stream(side)
        for saved, live in zip(state, cache.tensors()):
            live.copy_(saved)
        self.graphs: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []
        pool = None  # (one memory pool: the two replay one after the other on one stream)
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool=pool):
                logits = model.decode_step(self.tokens, cache)
            cache.pos = host_pos  # capture records, it does not run
            pool = graph.pool()
            self.graphs.append((graph, logits))
        self.turn = 0

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, 1] -> logits [b, 1, vocab] (the output buffer of the graph that ran)."""
        if self.cache.pos >= self.cache.max_len:
            raise ValueError(f"cache is full at max_len={self.cache.max_len}")
        graph, logits = self.graphs[self.turn]
        self.turn ^= 1
        self.tokens.copy_(tokens)
        graph.replay()
        self.cache.pos += 1
        return logits


def _initial_state(cache: BatchCache) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(tensor, snapshot) for every distinct storage of a fresh cache: snapshot None when it is all zeros."""
    seen: set[int] = set()
    out = []
    for t in cache.tensors():
        base = t if t._base is None else t._base
        if id(base) in seen:
            continue
        seen.add(id(base))
        out.append((base, None if not bool(base.any()) else base.clone()))
    return out


class GraphedPrefill:
    """Captures `model.prefill(tokens [batch, seq], cache)` at one shape; `run(tokens)` replays it.

    The graph owns its cache (`self.cache`, max_len tokens) and first restores it to the state of a new
    cache, so every replay is a fresh prefill; after `run` the cache holds the prompt and decoding can go
    on from it (e.g. with `GraphedDecoder`). The returned logits tensor is reused by every replay.
    """

    def __init__(
        self,
        model: DeepSeekV4,
        batch: int,
        seq: int,
        max_len: int | None = None,
        last_only: bool = True,
        warmup: int = 2,
    ):
        dev = model.embed.weight.device
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, this one is on {dev}")
        max_len = seq if max_len is None else max_len
        self.model, self.shape = model, (batch, seq)
        ops.keep_splits(model)  # the graph replays fixed weights: fp32 projections split once
        self.cache = model.new_cache(batch, max_len)
        self.tokens = torch.zeros(batch, seq, dtype=torch.long, device=dev)
        self._initial = _initial_state(self.cache)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile / autotune kernels outside the graph
            for _ in range(warmup):
                self._reset()
                model.prefill(self.tokens, self.cache, last_only=last_only)
                self.cache.pos = 0
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with capturing(self.graph):
            self._reset()
            self.logits = model.prefill(self.tokens, self.cache, last_only=last_only)
        self.cache.pos = 0  # capture records, it does not run

    def _reset(self) -> None:
        for live, snapshot in self._initial:
            if snapshot is None:
                live.zero_()
            else:
                live.copy_(snapshot)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, 1 or seq, vocab] (the graph's output buffer)."""
        if tuple(tokens.shape) != self.shape or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"this graph was captured for integer tokens of shape {list(self.shape)}, got "
                f"{list(tokens.shape)} {tokens.dtype}"
            )
        self.model._check_tokens(tokens)
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.cache.pos = self.shape[1]
        return self.logits
