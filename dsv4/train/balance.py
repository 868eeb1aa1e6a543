"""Auxiliary-loss-free load balancing (DeepSeek-V3/V4).

Each learned router has a per-expert `bias` buffer that shifts the scores for expert *selection*
only. After every optimizer step, each bias moves by a fixed `gamma` towards balance:
`bias_i += gamma * sign(mean_load - load_i)` - overloaded experts become less likely to be picked,
underloaded ones more. Loads are token counts measured in the step's forward (summed over
data-parallel ranks when a `reduce` is given). Hash-routed layers have no bias and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """Every MoE with a learned selection bias (main layers and MTP blocks), in module order."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "load")
            and getattr(m.gate, "bias", None) is not None]


@torch.no_grad()
def update_bias(model: nn.Module, gamma: float,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Apply one bias update from each router's last measured load. Returns the number of routers updated."""
    n = 0
    if gamma <= 0:
        return 0
    for moe in routers(model):
        if moe.load is None:
            continue
        load = moe.load.detach().float()
        if reduce is not None:
            load = reduce(load)
        moe.gate.bias.add_(gamma * torch.sign(load.mean() - load).to(moe.gate.bias.dtype))
        n += 1
    return n


def load_ratios(model: nn.Module) -> list[float]:
    """max/min expert load of every MoE layer in the last forward (min counted as at least 1 token)."""
    out = []
    for m in model.modules():
        if hasattr(m, "gate") and getattr(m, "load", None) is not None:
            load = m.load.float()
            out.append(round(float(load.max() / load.min().clamp_min(1)), 3))
    return out
