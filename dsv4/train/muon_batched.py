"""Muon over batches of same-shape matrices: the step of `MuonAdamW` with `OptimConfig(fast=True)`.

`MuonPlan` is built once for the set of Muon matrices that have gradients (rebuilt only when that set or
the optimizer's state object changes, e.g. after a checkpoint load). It groups every matrix by shape - plain
2-D weights and the experts of every layer alike - into chunks of at most `max_elems` elements and gives
each chunk one contiguous momentum buffer [N, rows, cols]; torch's Muon state keeps, under each 2-D
parameter, the slice of that buffer, so checkpoints see the layout they always did. A step is then, per
chunk: each weight's momentum lerp, Nesterov mix and rounding to bf16 (`ops.muon_momentum`, one pass over
its momentum and gradient), one batched bf16 Newton-Schulz on the [N, rows, cols] stack, and each weight's
decay and update (`ops.muon_apply`, one pass over it). The learning rate is a device scalar (`lr`), so the
step reads nothing on the host, branches on no device value and can be captured in a CUDA graph
(`graphed.py`).

The arithmetic per matrix is torch.optim.Muon's (`reference_muon_step` is that per-matrix computation,
written plainly); only the batching (the order of the fp32 sums inside the products) differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import ops

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment for one [rows, cols] matrix."""
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr


@torch.no_grad()
def batched_newton_schulz(g: torch.Tensor, coeffs, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's bf16 quintic Newton-Schulz on each matrix of g [E, m, n] at once -> bf16 [E, m, n].

    torch's Muon runs a tall matrix (m > n) transposed and transposes the result back; here a tall stack keeps
    its layout and each iteration multiplies from the other side (`ns_iteration(tall=True)`): the same
    products, with no transposed copies of the stack."""
    a, b, c = coeffs
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    # the fp32 norm of the bf16 matrix (no fp32 copy of it), rounded to bf16 as torch's bf16 norm is
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    x = x / norm.bfloat16().clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        x = ns_iteration(x, a, b, c, tall)
    return x


def newton_schulz_flops(shapes: list[tuple[int, int]], steps: int = NS_STEPS) -> int:
    """Floating-point operations of `batched_newton_schulz` on matrices of these [rows, cols] shapes: per
    iteration, with m <= n the two sides, x x^T (2 m^2 n), G G (2 m^3) and (b G + c G G) x (2 m^2 n)."""
    total = 0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def ns_iteration(x: torch.Tensor, a: float, b: float, c: float, tall: bool = False) -> torch.Tensor:
    """One quintic Newton-Schulz iteration on each matrix of x [E, m, n] (m <= n), in x's dtype:
    G = x x^T, x <- a x + (b G + c G G) x (fp32 sums inside the matmuls, one rounding per product).

    tall: x is [E, n, m] (n > m), the transpose of the matrix iterated, and so is the result: G = x^T x and
    x <- a x + x (b G + c G G)^T, element for element the products of the iteration on x^T.

    On a CPU a bf16 x is multiplied as fp32 and each product rounded to bf16 once: the same exact products
    and fp32 sums as a bf16 GEMM (which most CPUs emulate, 6x slower than fp32 on the 2-core test machine),
    in another order."""
    cpu = x.dtype == torch.bfloat16 and x.device.type == "cpu"
    y = x.float() if cpu else x
    gram = y.mT @ y if tall else y @ y.mT  # [E, m, m]
    if cpu:
        gram = gram.bfloat16().float()
    inner = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    if cpu:
        inner = inner.bfloat16().float()
    out = torch.baddbmm(y, y, inner.mT, beta=a) if tall else torch.baddbmm(y, inner, y, beta=a)
    return out.bfloat16() if cpu else out


def chunk_runs(sizes: list[int], rows: int, cols: int, max_elems: int) -> list[range]:
    """How `MuonPlan` batches the weights of one [rows, cols] shape (sizes: each weight's matrices, in
    order): consecutive runs of whole tensors of at most max_elems elements, or one tensor alone."""
    per_chunk = max(1, max_elems // (rows * cols))
    runs, start = [], 0
    while start < len(sizes):
        end, n = start, 0
        while end < len(sizes) and (n == 0 or n + sizes[end] <= per_chunk):
            n += sizes[end]
            end += 1
        runs.append(range(start, end))
        start = end
    return runs


@dataclass
class _Chunk:
    rows: int
    cols: int
    members: list[int]  # indices into the plan's weights, whole tensors
    sizes: list[int]  # matrices of each member
    buf: torch.Tensor  # [N, rows, cols] momentum of the chunk's matrices, N = sum(sizes)
    adjust: float  # adjust_lr(1, ...): the update's scale is lr * adjust


class MuonPlan:
    """The batched Muon step over fixed weights.

    weights: each a [k, rows, cols] view of a Muon weight (k = 1 for a plain matrix, E for stacked experts);
    views: for each weight, its k 2-D parameters registered with torch's Muon (whose state holds the
    momentum slices); state: torch's Muon state; group: its param group (momentum, nesterov, coefficients,
    steps, eps, adjust_lr_fn, weight_decay)."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        views: list[list[torch.nn.Parameter]],
        state: dict,
        group: dict,
        max_elems: int = 1 << 27,
    ):
        self.weights = weights
        self.group = group
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, w in enumerate(weights):
            by_shape.setdefault((w.size(-2), w.size(-1)), []).append(i)
        self.chunks: list[_Chunk] = []
        for (rows, cols), idx in by_shape.items():
            for run in chunk_runs([weights[i].size(0) for i in idx], rows, cols, max_elems):
                members = idx[run.start : run.stop]
                self.chunks.append(
                    _Chunk(
                        rows,
                        cols,
                        members,
                        [weights[i].size(0) for i in members],
                        self._bind(members, views, state),
                        adjust_lr(1.0, group.get("adjust_lr_fn"), rows, cols),
                    )
                )

    def _bind(self, members: list[int], views: list[list[torch.nn.Parameter]], state: dict) -> torch.Tensor:
        """One [N, rows, cols] buffer holding the chunk's momentum (the state's values, or zeros where none);
        the state then keeps each 2-D parameter's slice of it."""
        vs = [v for i in members for v in views[i]]
        old = [state[v].get("momentum_buffer") if v in state else None for v in vs]
        buf = torch.stack([torch.zeros_like(v) if b is None else b.reshape(v.shape) for b, v in zip(old, vs)])
        for i, v in enumerate(vs):
            state.setdefault(v, {})["momentum_buffer"] = buf[i]
        return buf

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: torch.Tensor) -> None:
        """One Muon step: grads like self.weights ([k, rows, cols] each), lr a 0-dim tensor on their device.

        Per chunk: each weight's momentum and bf16 update (`ops.muon_momentum`, written into the chunk's
        [N, rows, cols] stack), one batched Newton-Schulz, then each weight decayed and updated
        (`ops.muon_apply`): one read of each tensor per pass on a GPU."""
        g = self.group
        momentum, wd = g["momentum"], g["weight_decay"]
        decay = (lr * -wd).add_(1) if wd else torch.ones_like(lr)
        for ch in self.chunks:
            update = torch.empty(ch.buf.shape, dtype=torch.bfloat16, device=ch.buf.device)  # [N, rows, cols]
            for i, buf, u in zip(ch.members, ch.buf.split(ch.sizes), update.split(ch.sizes), strict=True):
                ops.muon_momentum(buf, grads[i], momentum, g["nesterov"], out=u)
            ortho = batched_newton_schulz(update, g["ns_coefficients"], g["ns_steps"], g["eps"])  # [N, rows, cols]
            scale = lr * -ch.adjust
            for i, o in zip(ch.members, ortho.split(ch.sizes), strict=True):
                ops.muon_apply(self.weights[i], o, decay, scale)


@torch.no_grad()
def reference_muon_step(w: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
    """The plain per-matrix Muon step (torch.optim.Muon's arithmetic) on one 2-D weight, in place:
    buf <- lerp(buf, grad, 1 - m); u = lerp(grad, buf, m) (Nesterov) or buf; w <- w (1 - lr wd) -
    lr' NS_bf16(u) with lr' = adjust_lr(lr). The reference the batched plan is tested against."""
    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    a, b, c = group["ns_coefficients"]
    x = update.bfloat16()
    wide = x.size(0) > x.size(1)
    if wide:
        x = x.T
    x = x / x.norm().clamp(min=group["eps"])
    for _ in range(group["ns_steps"]):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if wide:
        x = x.T
    w.mul_(1 - lr * wd)
    w.add_(x.to(w.dtype), alpha=-adjust_lr(lr, group.get("adjust_lr_fn"), w.size(0), w.size(1)))
