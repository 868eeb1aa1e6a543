"""Derived copies of fp32 master weights made once per optimizer step instead of at every use.

Under bf16 autocast two kinds of weight derive a bf16 form at every call. The routed experts' fp32 weights
are cast to bf16 for the grouped GEMMs: one pass over every expert weight per forward, another per
recomputation (activation checkpointing) and again for every micro-batch of a step (gradient
accumulation); at `medium`, 4.8B expert parameters. The fp32 vocabulary head is split into its three bf16
parts (`ops.linear_fp32`'s "bf16x3") at each call, forward and backward, main head and MTP head alike.
`StepCasts` keeps one copy of each and makes it again where the weights change:

- `refresh()` after every optimizer step (the trainer calls it inside the update, so a CUDA graph of the
  update replays it);
- and, outside a CUDA graph capture, a use that finds the weight's version counter moved since its copy was
  made (a checkpoint load, any in-place write) makes it again first, so an eager step never reads a stale
  copy.

The copies hold the values the per-use casts and splits give (the same functions): losses and gradients
are bit for bit those of making them at each use. The experts read their copy through an autograd function
whose backward is the cast's (the gradient in fp32 to the master weight); the head's bf16x3 backward reads
the kept split. Memory: the copies stay allocated (`dsv4.memory.TrainState.copies` of one process: every
expert's bf16 copy, 1.5x the head in bf16 parts), where casting at each use holds one block's experts at a
time under activation checkpointing. One process only: sharded (FSDP2) weights are gathered at each
forward and are not kept.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..ops.torch_native import drop_step_split, keep_step_split, refresh_step_split, step_copy_stale


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


class StepCasts:
    """The routed experts' bf16 copies of `model` (unless `experts` is False: FP4 fake quantization computes
    with its own rounding of the fp32 weights) and, with `head_split`, its fp32 head's bf16x3 split, kept for
    an optimizer step (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype = torch.bfloat16,
        head_split: bool = False,
        experts: bool = True,
    ):
        from ..model.moe import Experts

        self.dtype = dtype
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> [copy, version at the cast]
        for m in model.modules():
            if experts and isinstance(m, Experts):
                for w in (m.w1, m.w2, m.w3):
                    if type(w) is torch.nn.Parameter and w.dtype == torch.float32:  # (not a DTensor shard)
                        self._copies[w] = [torch.empty_like(w, dtype=dtype), -1]
        head = getattr(getattr(model, "head", None), "weight", None)
        self.split = [head] if head_split and type(head) is torch.nn.Parameter and head.dtype == torch.float32 else []
        for w in self.split:
            keep_step_split(w)
        self.refresh()

    @classmethod
    def attach(
        cls, model: torch.nn.Module, device: torch.device, head_precision: str, experts: bool = True
    ) -> StepCasts:
        """The copies of a one-process training step of `model` on `device`, installed as its experts'
        `cast_cache`: the head's split where bf16x3 computes the fp32 head (CUDA, head_precision "fp32")."""
        casts = cls(model, head_split=device.type == "cuda" and head_precision == "fp32", experts=experts)
        model.set_options(expert_casts=casts)
        return casts

    def __len__(self) -> int:
        return len(self._copies) + len(self.split)

    @staticmethod
    @torch.no_grad()
    def _cast(w: torch.Tensor, entry: list) -> None:
        entry[0].copy_(w)
        entry[1] = w._version

    def refresh(self) -> None:
        """Make every copy again in place (inside a CUDA graph capture: captured, replayed with it)."""
        for w, entry in self._copies.items():
            self._cast(w, entry)
        for w in self.split:
            refresh_step_split(w)

    def close(self) -> None:
        """Stop keeping the head's split (the expert copies go with this object)."""
        for w in self.split:
            drop_step_split(w)
        self.split = []

    def get(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """An expert weight's copy in `dtype` (cast again first where w changed since, outside a capture), or
        None for a weight or dtype this object does not hold (the caller casts)."""
        entry = self._copies.get(w) if dtype == self.dtype else None
        if entry is None:
            return None
        if step_copy_stale(w, entry[1]):
            self._cast(w, entry)
        return _FromCopy.apply(w, entry[0]) if torch.is_grad_enabled() and w.requires_grad else entry[0]
