"""Gradient norm and clipping on the device: no host read, so they run inside a captured update."""

from __future__ import annotations

import torch


def foreach_ok(ts: list[torch.Tensor]) -> bool:
    """Whether torch's foreach kernels take these tensors (plain tensors on a device that has them)."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return all(type(t) is torch.Tensor and t.device.type in _get_foreach_kernels_supported_devices() for t in ts)


def total_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Global L2 norm of grads as a device scalar (foreach norms where the tensors allow)."""
    if not grads:
        return torch.zeros((), device=device)
    return torch.nn.utils.get_total_norm(grads, foreach=foreach_ok(grads))


def clip_(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient of params by min(1, max_norm / (total + 1e-6)), total a device scalar."""
    params = [p for p in params if p.grad is not None]
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach_ok([p.grad for p in params]))


def read_host(*ts: torch.Tensor | None) -> list[float]:
    """The values of the given device tensors (scalars or vectors; None skipped) in one device -> host copy."""
    flat = [t.detach().float().reshape(-1) for t in ts if t is not None]
    return torch.cat(flat).to("cpu", copy=True).tolist() if flat else []
