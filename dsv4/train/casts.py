"""The routed experts' bf16 weights, cast once per optimizer step instead of at every forward.

Under bf16 autocast the experts' fp32 master weights are cast to bf16 for the grouped GEMMs. Cast at each
use, that is one pass over every expert weight per forward, another per recomputation (activation
checkpointing) and again for every micro-batch of a step (gradient accumulation): at `medium`, 4.8B expert
parameters, about a sixth of an eager step's GPU time. `ExpertCasts` keeps one bf16 copy of each and
refreshes it where the weights change:

- `refresh()` after every optimizer step (the trainer calls it inside the update, so a CUDA graph of the
  update replays the casts with it);
- and, outside a CUDA graph capture, `get` re-casts a weight whose version counter moved since its copy
  was made (a checkpoint load, any in-place write), so an eager step never reads a stale copy.

The copy holds the values `w.to(bf16)` gives (the same rounding), and `get` returns it through an autograd
function whose backward is the cast's (the gradient in fp32 to the master weight): losses and gradients
are bit for bit those of casting at each use. Memory: every routed expert's bf16 copy stays allocated
(`dsv4.memory.TrainState.copies` of one process), where casting at each use holds one block's at a time under
activation checkpointing. For one process: sharded (FSDP2) weights are gathered at each forward and are
not cached.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary


class _FromCopy(torch.autograd.Function):
    """The bf16 copy of `w` as if cast now: its values forward, the cast's backward (the gradient in w's
    dtype) to w."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.w_dtype = w.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.to(ctx.w_dtype), None


class ExpertCasts:
    """bf16 copies of the routed experts' weights of `model` (module docstring)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        from ..model.moe import Experts

        self.dtype = dtype
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> [copy, version at the cast]
        for m in model.modules():
            if isinstance(m, Experts):
                for w in (m.w1, m.w2, m.w3):
                    if type(w) is torch.nn.Parameter and w.dtype == torch.float32:  # (not a DTensor shard)
                        self._copies[w] = [torch.empty_like(w, dtype=dtype), -1]
        self.refresh()

    def __len__(self) -> int:
        return len(self._copies)

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c, _ in self._copies.values())

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast every weight into its copy (inside a CUDA graph capture: captured, replayed with it)."""
        for w, entry in self._copies.items():
            entry[0].copy_(w)
            entry[1] = w._version

    def get(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """w's copy in `dtype` (cast again first where w changed since, outside a capture), or None for a
        weight or dtype this cache does not hold (the caller casts)."""
        entry = self._copies.get(w) if dtype == self.dtype else None
        if entry is None:
            return None
        if entry[1] != w._version and not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            with torch.no_grad():
                entry[0].copy_(w)
            entry[1] = w._version
        return _FromCopy.apply(w, entry[0]) if torch.is_grad_enabled() and w.requires_grad else entry[0]
