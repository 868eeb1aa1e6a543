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
    return [
        m
        for m in model.modules()
        if hasattr(m, "gate") and hasattr(m, "load") and getattr(m.gate, "bias", None) is not None
    ]


@torch.no_grad()
def update_bias(model: nn.Module, gamma: float, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Apply one bias update from each router's last measured load. Returns the number of routers updated.

    The routers' loads are stacked ([layers, E], one stack per expert count, bias dtype and device) and the
    update is one computation over the stack, written back with one foreach add: the same numbers as the
    rule applied router by router (the loads are token counts, so every mean is the same exact sum / E)."""
    if gamma <= 0:
        return 0
    groups: dict[tuple, list[nn.Module]] = {}
    for moe in routers(model):
        if moe.load is not None:
            b = moe.gate.bias
            groups.setdefault((b.numel(), b.dtype, b.device), []).append(moe)
    for (_, dtype, _), moes in groups.items():
        loads = torch.stack([moe.load.detach() for moe in moes]).float()  # [layers, E]
        if reduce is not None:
            loads = reduce(loads)
        step = (gamma * torch.sign(loads.mean(-1, keepdim=True) - loads)).to(dtype)
        torch._foreach_add_([moe.gate.bias for moe in moes], list(step.unbind(0)))
    return sum(len(m) for m in groups.values())


def load_ratio_tensor(model: nn.Module) -> torch.Tensor | None:
    """max/min expert load (min counted as at least 1 token) of every MoE layer in the last forward, as one
    device tensor [layers] (None if no layer measured a load): read to the host with the step's other values."""
    loads = [m.load for m in model.modules() if hasattr(m, "gate") and getattr(m, "load", None) is not None]
    if not loads:
        return None
    if len({t.numel() for t in loads}) == 1 and len({t.device for t in loads}) == 1:
        stacked = torch.stack(loads).float()
        return stacked.amax(-1) / stacked.amin(-1).clamp_min(1)
    return torch.stack([t.float().max() / t.float().min().clamp_min(1) for t in loads])


def load_ratios(model: nn.Module) -> list[float]:
    """max/min expert load of every MoE layer in the last forward (min counted as at least 1 token)."""
    t = load_ratio_tensor(model)
    return [] if t is None else [round(v, 3) for v in t.tolist()]
