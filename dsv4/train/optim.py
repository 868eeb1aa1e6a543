"""Optimizers as in the V4 report: Muon for hidden weight matrices, AdamW for everything else.

Muon (`torch.optim.Muon`, Newton-Schulz coefficients (3.4445, -4.7750, 2.0315), 5 steps) takes the
2-D projections of attention, compressors, indexer, router, shared experts and MTP projections, and the
routed experts. The experts are stacked `[E, out, in]`; torch's Muon accepts 2-D matrices only, so each
expert is handed to Muon as its own 2-D parameter that *aliases* its slice of the stacked tensor
(momentum and orthogonalization per expert, exactly as if the experts were separate matrices).
AdamW takes the embedding, the output head, RMSNorm weights, biases, attention sinks, compressor `ape`,
every mHC parameter (`hc_*`) and any other 1-D tensor.

Muon's update is rescaled to AdamW's RMS (`adjust_lr_fn="match_rms_adamw"`) so one learning rate and
schedule serves both groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """Whether parameter `name` is a hidden weight matrix trained by Muon."""
    if p.dim() < 2:
        return False
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith(("embed.", "head.")) or leaf.startswith("hc_") or leaf == "ape":
        return False
    return True


def split_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if uses_muon(name, p) else adamw).append((name, p))
    return muon, adamw


def _matrix_views(p: nn.Parameter) -> list[nn.Parameter]:
    """2-D parameters aliasing the storage of p (p itself if 2-D; one per leading index if 3-D)."""
    if p.dim() == 2:
        return [p]
    data = p.data.reshape(-1, *p.shape[-2:])
    if data.data_ptr() != p.data.data_ptr():
        raise ValueError("stacked expert weights must be contiguous to alias them per expert")
    return [nn.Parameter(data[i], requires_grad=True) for i in range(data.size(0))]


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    muon_momentum: float = 0.95


class MuonAdamW:
    """One optimizer object over both groups (step / zero_grad / state_dict / lr control)."""

    def __init__(self, model: nn.Module, cfg: OptimConfig):
        self.cfg = cfg
        muon_named, adamw_named = split_params(model)
        self.muon_names = [n for n, _ in muon_named]
        self.adamw_names = [n for n, _ in adamw_named]
        self._stacked: list[tuple[nn.Parameter, list[nn.Parameter]]] = []
        views: list[nn.Parameter] = []
        for _, p in muon_named:
            vs = _matrix_views(p)
            if vs[0] is not p:
                self._stacked.append((p, vs))
            views.extend(vs)
        self.muon_params = views
        self.muon = _make_muon(views, cfg) if views else None
        no_decay = [p for n, p in adamw_named if p.dim() < 2 or n.startswith("embed.")]
        decay = [p for n, p in adamw_named if not (p.dim() < 2 or n.startswith("embed."))]
        groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        self.optimizers = [o for o in (self.muon, self.adamw) if o is not None]
        for o in self.optimizers:
            for g in o.param_groups:
                g["base_lr"] = cfg.lr

    def set_lr_factor(self, factor: float) -> float:
        for o in self.optimizers:
            for g in o.param_groups:
                g["lr"] = g["base_lr"] * factor
        return self.cfg.lr * factor

    def _share_grads(self) -> None:
        for p, vs in self._stacked:
            g = p.grad
            if g is None:
                for v in vs:
                    v.grad = None
                continue
            g = g.reshape(-1, *p.shape[-2:])
            for i, v in enumerate(vs):
                v.grad = g[i]

    @torch.no_grad()
    def step(self) -> None:
        self._share_grads()
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        for p, vs in self._stacked:          # the stacked tensor belongs to no torch optimizer: clear it here
            p.grad = None
            for v in vs:
                v.grad = None

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict() if self.muon else None, "adamw": self.adamw.state_dict(),
                "muon_names": self.muon_names, "adamw_names": self.adamw_names}

    def load_state_dict(self, d: dict) -> None:
        if d.get("muon_names") != self.muon_names or d.get("adamw_names") != self.adamw_names:
            raise ValueError("optimizer state was saved for a different set of parameters")
        if self.muon is not None:
            self.muon.load_state_dict(d["muon"])
        self.adamw.load_state_dict(d["adamw"])

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for o in self.optimizers for s in o.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))


def _make_muon(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=True,
              ns_coefficients=NS_COEFFICIENTS, ns_steps=NS_STEPS)
    try:
        return torch.optim.Muon(params, adjust_lr_fn="match_rms_adamw", **kw)
    except TypeError:  # older torch without adjust_lr_fn: Keller's original scaling
        return torch.optim.Muon(params, **kw)


# ------------------------------------------------------------------------------------------ schedule
def lr_factor(step: int, total: int, warmup: int, schedule: str = "cosine", min_ratio: float = 0.1,
              decay_frac: float = 0.2) -> float:
    """Multiplier of the base lr at optimizer step `step` (1-based).

    cosine: linear warmup, then cosine from 1 to min_ratio at `total`.
    wsd: linear warmup, constant, then linear decay to min_ratio over the last `decay_frac` of the steps.
    """
    if warmup > 0 and step <= warmup:
        return step / warmup
    if schedule == "cosine":
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    if schedule == "wsd":
        start = total - int(decay_frac * total)
        if step <= start:
            return 1.0
        return 1.0 - (1 - min_ratio) * min(1.0, (step - start) / max(1, total - start))
    if schedule == "constant":
        return 1.0
    raise ValueError(f"unknown schedule '{schedule}'")


# ------------------------------------------------------------------------------------------ diagnostics
def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, coeffs=NS_COEFFICIENTS, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration Muon applies to an update matrix (in fp32 here)."""
    a, b, c = coeffs
    x = g.float()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if transposed else x


def orthogonalization_error(g: torch.Tensor) -> float:
    """max |singular value - 1| of NS(g): how far Muon's update is from an exact orthogonal factor."""
    if g.abs().sum() == 0:
        return 0.0
    s = torch.linalg.svdvals(newton_schulz(g))
    return float((s - 1).abs().max())
