"""Optimizers as in the V4 report: Muon for hidden weight matrices, AdamW for everything else.

Muon (`torch.optim.Muon`, Newton-Schulz coefficients (3.4445, -4.7750, 2.0315), 5 steps) takes the
2-D projections of attention, compressors, indexer, router, shared experts and MTP projections, and the
routed experts. The experts are stacked `[E, out, in]`; torch's Muon accepts 2-D matrices only, so each
expert is registered with Muon as its own 2-D parameter that *aliases* its slice of the stacked tensor
(momentum and orthogonalization per expert, exactly as if the experts were separate matrices). The
stacked tensors are then stepped together by `stacked_muon_step`, torch's Muon update written over a batch
of matrices (one batched Newton-Schulz for all E experts instead of E separate ones: a layer of 32 experts
x 3 projections is ~20 launches instead of ~2000); their momentum buffers are slices of one stacked buffer,
kept in Muon's own state under each expert's 2-D parameter.
AdamW takes the embedding, the output head, RMSNorm weights, biases, attention sinks, compressor `ape`,
every mHC parameter (`hc_*`) and any other 1-D tensor.

Under FSDP2 (`dsv4.train.distributed`) a 2-D weight is a DTensor holding this rank's rows. Newton-Schulz
must see the whole matrix (orthogonalizing a block of rows is a different map), and torch's Muon run on a
DTensor does each of its ~40 small ops as a distributed op - correct, but seconds per step. Such weights
are stepped by `sharded_muon_step`: momentum on the local rows (elementwise), one all-gather of the
update, Newton-Schulz on the whole matrix (batched over weights of one shape, repeated on every rank),
and each rank keeps its own rows. The momentum stays in torch's Muon state, so checkpoints see no change.

Muon's update is rescaled to AdamW's RMS (`adjust_lr_fn="match_rms_adamw"`) so one learning rate and
schedule serves both groups.

`OptimConfig(fast=True)` (the default) steps every whole matrix - each plain 2-D weight and the experts of
every layer - through one `MuonPlan` (`muon_batched.py`): one bf16 Newton-Schulz per shape over all matrices
of that shape (in chunks of at most `ns_batch_elems` elements), momentum, Nesterov mix, weight decay and update
as foreach ops over contiguous per-chunk momentum buffers whose slices torch's Muon state keeps (checkpoints
are unchanged). AdamW is fused where the device has the kernel (else foreach). The learning rates are device
scalars (`set_lr_factor` fills them), so a fast step of unsharded weights reads nothing on the host and can
be replayed from a CUDA graph (`graphed.GraphedUpdate`). `fast=False` is the previous step and the
reference: torch's Muon matrix by matrix (the stacked experts batched per tensor) and torch's default
AdamW. Sharded weights take `sharded_muon_step` either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from .muon_batched import (  # noqa: F401  (re-exported)
    NS_COEFFICIENTS,
    NS_STEPS,
    MuonPlan,
    adjust_lr,
    batched_newton_schulz,
    ns_iteration,
    reference_muon_step,
)


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
    # True: every Muon matrix of one shape (2-D weights and the experts of every layer) in one batched bf16
    # Newton-Schulz, momentum and weight updates as foreach ops; AdamW fused where the device has the kernel
    # (else foreach). False: the previous step, torch.optim.Muon matrix by matrix (experts batched per layer)
    # and torch.optim.AdamW with its default implementation.
    fast: bool = True
    ns_batch_elems: int = 1 << 27  # fast: at most this many matrix elements per batched Newton-Schulz


class MuonAdamW:
    """One optimizer object over both groups (step / zero_grad / state_dict / lr control)."""

    def __init__(self, model: nn.Module, cfg: OptimConfig):
        self.cfg = cfg
        muon_named, adamw_named = split_params(model)
        self.muon_names = [n for n, _ in muon_named]
        self.adamw_names = [n for n, _ in adamw_named]
        self._stacked: list[tuple[nn.Parameter, list[nn.Parameter]]] = []
        self._stacked_bufs: dict[nn.Parameter, torch.Tensor] = {}  # stacked p -> its [E, out, in] momentum
        views: list[nn.Parameter] = []
        for _, p in muon_named:
            vs = _matrix_views(p)
            if vs[0] is not p:
                self._stacked.append((p, vs))
            views.extend(vs)
        self.muon_params = views
        self.muon = _make_muon(views, cfg) if views else None
        self._sharded = [v for v in views if _is_dtensor(v)]  # FSDP2 rows: stepped by sharded_muon_step
        no_decay = [p for n, p in adamw_named if p.dim() < 2 or n.startswith("embed.")]
        decay = [p for n, p in adamw_named if not (p.dim() < 2 or n.startswith("embed."))]
        groups = [
            g
            for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]
        ]
        impl = _adamw_impl([p for g in groups for p in g["params"]]) if cfg.fast else {}
        # fused AdamW takes its lr as a device scalar (capturable on CUDA): a step reads no Python float that
        # changes, so a captured step follows set_lr_factor
        self._adamw_lr: list[torch.Tensor] = []
        if impl.get("fused"):
            dev = groups[0]["params"][0].device
            self._adamw_lr = [torch.tensor(cfg.lr, dtype=torch.float32, device=dev) for _ in groups]
            for g, t in zip(groups, self._adamw_lr):
                g["lr"] = t
            impl["capturable"] = dev.type == "cuda"
        self.adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **impl)
        stacked_views = {id(v) for _, vs in self._stacked for v in vs}
        sharded_ids = {id(v) for v in self._sharded}
        # fast: the whole (unsharded) Muon weights - plain 2-D matrices and stacked experts - with their 2-D views,
        # stepped by one MuonPlan instead of torch's Muon
        self._whole: list[tuple[nn.Parameter, list[nn.Parameter]]] = [
            (v, [v]) for v in views if id(v) not in stacked_views and id(v) not in sharded_ids
        ] + [(p, vs) for p, vs in self._stacked if not _is_dtensor(p)]
        self._plan: MuonPlan | None = None
        self._plan_key: tuple | None = None
        self._plan_state: dict | None = None
        self._muon_lr = (
            torch.tensor(cfg.lr, dtype=torch.float32, device=self._whole[0][0].device) if self._whole else None
        )
        self.optimizers = [o for o in (self.muon, self.adamw) if o is not None]
        for o in self.optimizers:
            for g in o.param_groups:
                g["base_lr"] = cfg.lr

    def set_lr_factor(self, factor: float) -> float:
        """Sets every group's lr to base * factor (device scalars are filled in place: no host sync, and a
        captured step reads the new value); -> the base lr times factor."""
        for o in self.optimizers:
            for i, g in enumerate(o.param_groups):
                lr = g["base_lr"] * factor
                if o is self.adamw and self._adamw_lr:
                    self._adamw_lr[i].fill_(lr)
                    g["lr"] = self._adamw_lr[i]  # the same tensor again after a load_state_dict
                else:
                    g["lr"] = lr
        if self._muon_lr is not None:
            self._muon_lr.fill_(self.cfg.lr * factor)
        return self.cfg.lr * factor

    def _stacked_buffer(self, p: nn.Parameter, views: list[nn.Parameter]) -> torch.Tensor:
        """The [E, out, in] momentum buffer of stacked p; Muon's state holds its per-expert slices."""
        state = self.muon.state
        bufs = [state[v].get("momentum_buffer") if v in state else None for v in views]
        stacked = self._stacked_bufs.get(p)
        if stacked is not None and all(
            b is not None and b.data_ptr() == stacked[i].data_ptr() for i, b in enumerate(bufs)
        ):
            return stacked
        # first step, or state loaded from a checkpoint as separate tensors: (re)build one stacked buffer
        stacked = torch.stack([torch.zeros_like(v) if b is None else b for b, v in zip(bufs, views)])
        for i, v in enumerate(views):
            state[v]["momentum_buffer"] = stacked[i]
        self._stacked_bufs[p] = stacked
        return stacked

    @torch.no_grad()
    def step(self) -> None:
        if self.cfg.fast:
            self._fast_step()
            return
        for _, views in self._stacked:  # stepped below, batched: torch's Muon skips grad-less views
            for v in views:
                v.grad = None
        sharded = [(p, p.grad) for p in self._sharded if p.grad is not None]
        for p, _ in sharded:  # stepped below on whole matrices; torch's Muon skips them
            p.grad = None
        for o in self.optimizers:
            o.step()
        if self.muon is not None:
            group = self.muon.param_groups[0]
            if sharded:
                sharded_muon_step([p for p, _ in sharded], [g for _, g in sharded], self.muon.state, group)
            for p, views in self._stacked:
                if p.grad is not None:
                    stacked_muon_step(
                        p.data.view(-1, *p.shape[-2:]),
                        p.grad.reshape(-1, *p.shape[-2:]),
                        self._stacked_buffer(p, views),
                        group,
                    )

    def _fast_step(self) -> None:
        """`fast=True`: AdamW as configured; every whole Muon weight (plain 2-D matrices and the experts of
        every layer) through one `MuonPlan`; FSDP2 row shards through `sharded_muon_step` as before. With
        unsharded weights nothing here reads the device from the host."""
        self.adamw.step()
        if self.muon is None:
            return
        state = self.muon.state
        sharded = [p for p in self._sharded if p.grad is not None]
        if sharded:
            sharded_muon_step(sharded, [p.grad for p in sharded], state, self.muon.param_groups[0])
        whole = [(p, vs) for p, vs in self._whole if p.grad is not None]
        if not whole:
            return
        key = tuple(id(p) for p, _ in whole)
        if self._plan is None or key != self._plan_key or self._plan_state is not state:
            # first step, another set of gradients, or the state replaced (a load_state_dict)
            self._plan = MuonPlan(
                [p.data.view(-1, *p.shape[-2:]) for p, _ in whole],
                [vs for _, vs in whole],
                state,
                self.muon.param_groups[0],
                self.cfg.ns_batch_elems,
            )
            self._plan_key, self._plan_state = key, state
        self._plan.step([p.grad.reshape(-1, *p.shape[-2:]) for p, _ in whole], self._muon_lr)

    @property
    def implementation(self) -> dict[str, str]:
        """Which implementation each part of the step runs (reported by the benches)."""
        adamw = (
            "fused"
            if self.adamw.defaults.get("fused")
            else "foreach"
            if self.adamw.defaults.get("foreach")
            else "default"
        )
        muon = "batched" if self.cfg.fast else "per-matrix"
        out = {"muon": muon + (" + sharded" if self._sharded else ""), "adamw": adamw}
        if self.cfg.fast and self._plan is not None:  # the backend of its elementwise passes, as it last ran
            out["muon_passes"] = ops.last_backend("muon_apply") or "not run"
        return out

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        for p, vs in self._stacked:  # the stacked tensor belongs to no torch optimizer: clear it here
            p.grad = None
            for v in vs:
                v.grad = None

    def state_dict(self) -> dict:
        return {
            "muon": self.muon.state_dict() if self.muon else None,
            "adamw": self.adamw.state_dict(),
            "muon_names": self.muon_names,
            "adamw_names": self.adamw_names,
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("muon_names") != self.muon_names or d.get("adamw_names") != self.adamw_names:
            raise ValueError("optimizer state was saved for a different set of parameters")
        if self.muon is not None:
            self.muon.load_state_dict(d["muon"])
        self.adamw.load_state_dict(d["adamw"])
        self._plan = None  # rebinds the momentum buffers at the next step


def _make_muon(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    kw = dict(
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=True,
        ns_coefficients=NS_COEFFICIENTS,
        ns_steps=NS_STEPS,
    )
    try:
        return torch.optim.Muon(params, adjust_lr_fn="match_rms_adamw", **kw)
    except TypeError:  # older torch without adjust_lr_fn: Keller's original scaling
        return torch.optim.Muon(params, **kw)


@torch.no_grad()
def stacked_muon_step(w: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
    """torch.optim.Muon's update applied to each matrix of w [E, out, in] (momentum buf [E, out, in])."""
    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    update = batched_newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
    w.mul_(1 - lr * wd)
    w.add_(update.to(w.dtype), alpha=-adjust_lr(lr, group.get("adjust_lr_fn"), w.size(-2), w.size(-1)))


def _adamw_impl(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's fused kernel where every parameter's device has one (and no parameter is a DTensor), else the
    foreach implementation."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    plain = all(type(p) is torch.Tensor or type(p) is nn.Parameter for p in params)
    fused_ok = plain and all(
        p.is_floating_point() and p.device.type in _get_fused_kernels_supported_devices() for p in params
    )
    return {"fused": True} if fused_ok else {"foreach": True}


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


@torch.no_grad()
def sharded_muon_step(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict, group: dict) -> None:
    """torch.optim.Muon's update for row-sharded DTensor matrices, with Newton-Schulz on whole matrices.

    Every rank calls it with the same parameters in the same order (one all-gather each). The momentum
    buffer `state[p]["momentum_buffer"]` is a DTensor like p, as torch's Muon would keep it."""
    from torch.distributed.tensor import distribute_tensor

    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    by_shape: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for p, g in zip(params, grads):
        st = state[p]
        if st.get("momentum_buffer") is None:
            st["momentum_buffer"] = torch.zeros_like(g)
        buf = st["momentum_buffer"]
        buf.to_local().lerp_(g.to_local(), 1 - momentum)  # elementwise: local rows suffice
        update = g.lerp(buf, momentum) if group["nesterov"] else buf
        by_shape.setdefault(tuple(p.shape), []).append((p, update.full_tensor()))
    for (rows, cols), items in by_shape.items():
        ortho = batched_newton_schulz(
            torch.stack([u for _, u in items]), group["ns_coefficients"], group["ns_steps"], group["eps"]
        )
        step = adjust_lr(lr, group.get("adjust_lr_fn"), rows, cols)
        for (p, _), u in zip(items, ortho):
            mine = distribute_tensor(u.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            local = p.to_local()
            local.mul_(1 - lr * wd)
            local.add_(mine.to_local(), alpha=-step)


# ------------------------------------------------------------------------------------------ schedule
def lr_factor(
    step: int, total: int, warmup: int, schedule: str = "cosine", min_ratio: float = 0.1, decay_frac: float = 0.2
) -> float:
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
