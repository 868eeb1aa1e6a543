"""Decode steps replayed from a CUDA graph.

`DeepSeekV4.decode_step` is a fixed sequence of kernels that reads the position from `cache.pos_t` on the
device and never synchronizes with the host, so one step can be captured once and replayed for every
new token: the per-step cost drops from thousands of kernel launches from Python to one graph launch.
"""

from __future__ import annotations

import dataclasses

import torch

from .transformer import DeepSeekV4, ModelCache


def _cache_tensors(cache: ModelCache) -> list[torch.Tensor]:
    out = [cache.pos_t]
    for layer in cache.layers:
        for f in dataclasses.fields(layer):
            v = getattr(layer, f.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif v is not None:
                out.extend(getattr(v, g.name) for g in dataclasses.fields(v))
    return out


class GraphedDecoder:
    """Captures `model.decode_step(tokens, cache)` for one cache; `step(tokens)` replays it.

    The returned logits tensor is reused by every replay (copy it to keep it). The cache must not be
    replaced or resized afterwards; capture after the prefill.
    """

    def __init__(self, model: DeepSeekV4, cache: ModelCache, warmup: int = 2):
        dev = cache.pos_t.device
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, this one is on {dev}")
        self.model, self.cache = model, cache
        batch = cache.layers[0].kv.size(0)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        state = [t.clone() for t in _cache_tensors(cache)]
        host_pos = cache.pos
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):                        # compile / autotune kernels outside the graph
            for _ in range(warmup):
                model.decode_step(self.tokens, cache)
                cache.pos = host_pos
        torch.cuda.current_stream(dev).wait_stream(side)
        for saved, live in zip(state, _cache_tensors(cache)):
            live.copy_(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.decode_step(self.tokens, cache)
        cache.pos = host_pos                                 # capture records, it does not run

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, 1] -> logits [b, 1, vocab] (the graph's output buffer)."""
        if self.cache.pos >= self.cache.max_len:
            raise ValueError(f"cache is full at max_len={self.cache.max_len}")
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.cache.pos += 1
        return self.logits
