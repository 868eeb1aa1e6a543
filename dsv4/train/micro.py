"""Gradient accumulation: what a step of several micro-batches adds up.

A step of `--grad-accum N` runs forward + backward on N batches of `--batch-size` sequences before one
optimizer step, each loss weighted 1/N: the summed gradients are those of the mean loss over the N
batches, which (equal batches of full windows) is the mean over all their tokens, as one batch of
N x --batch-size sequences would give, at the activation memory of one. The step reports the mean of the
micro-batches' losses, and each router's expert load is the sum of theirs, so the bias update counts
every token of the step.
"""

from __future__ import annotations

import torch
from torch import nn

from .losses import LossParts


def routers_with_load(model: nn.Module) -> list[nn.Module]:
    """Every MoE that counts its expert load (learned and hash routers), in module order."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "load")]


class MicroSums:
    """Sums a step's micro-batches' loss parts and expert loads on the device (no host read)."""

    def __init__(self, routers: list[nn.Module]):
        self.routers = routers
        self.n = 0
        self.parts: dict[str, torch.Tensor] = {}
        self.loads: list[torch.Tensor | None] = [None] * len(routers)

    def add(self, parts: LossParts) -> None:
        """Adds one micro-batch's parts and the loads its forward measured (copied: a replayed graph
        overwrites its outputs at the next replay)."""
        self.n += 1
        for k, v in parts.tensors().items():
            v = v.detach().float()
            self.parts[k] = v.clone() if k not in self.parts else self.parts[k].add_(v)
        for i, m in enumerate(self.routers):
            if m.load is not None:
                self.loads[i] = m.load.clone() if self.loads[i] is None else self.loads[i].add_(m.load)

    def result(self) -> LossParts:
        """The step's loss parts (means over the micro-batches); sets every router's load to the step's sum."""
        for m, load in zip(self.routers, self.loads):
            m.set_load(load)
        mean = {k: v / self.n for k, v in self.parts.items()}
        return LossParts(
            total=mean["loss"],
            lm=mean["lm"],
            **{k: mean.get(k) for k in ("mtp", "indexer", "balance", "dspark", "dspark_tau")},
        )
