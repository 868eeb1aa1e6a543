"""What every grouped-GEMM MoE backend shares: the routing plan, the row gather / mask / combine around
it, the clamped SwiGLU and the activation round trip of W8A8. Below the backends (`torch_native`'s
"grouped", `triton.moe`, `triton.w8a8_gemm`), which import it; it imports none of them.

The routing plan (`moe_plan`) is built with device-side ops only (stable argsort + searchsorted), so no
data-dependent size reaches the host: every buffer has T*k rows, whatever the routing (docs/bugzoo.md
Z23/Z24). Slots routed to experts outside this rank's range sort to the end; the rows they occupy are
never computed by a grouped GEMM, so every consumer masks them with `torch.where` (docs/bugzoo.md Z09).

A backend may install a faster builder of the same plan for a device type (`register_plan_builder`: the
Triton counting sort on CUDA); `build_plan` takes it where it can run, else the sort.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import ACT_BLOCK, act_pow2


# ----------------------------------------------------------------------------- the routing plan
@dataclass
class MoEPlan:
    """Slots (token, k) sorted by local expert; slots of other ranks' experts go last."""

    order: torch.Tensor  # [T*k] int64: sorted position -> flat slot id (t*k + j)
    token: torch.Tensor  # [T*k] int64: sorted position -> token
    valid: torch.Tensor  # [T*k] bool: sorted position holds a local expert
    weight: torch.Tensor  # [T*k] fp32: routing weight of each sorted slot
    ends: torch.Tensor  # [E] int32: cumulative end row of each expert's group
    n_tokens: int
    topk: int


def moe_plan(weights: torch.Tensor, indices: torch.Tensor, n_local: int, expert_offset: int) -> MoEPlan:
    t, k = indices.shape
    local = indices.reshape(-1).long() - expert_offset  # [T*k]
    valid = (local >= 0) & (local < n_local)
    key = torch.where(valid, local, n_local)  # foreign experts -> bucket E
    sorted_key, order = torch.sort(key, stable=True)  # [T*k]
    bounds = torch.arange(n_local, device=key.device, dtype=sorted_key.dtype)
    ends = torch.searchsorted(sorted_key, bounds, right=True).to(torch.int32)  # [E]
    return MoEPlan(
        order=order,
        token=order // k,
        valid=sorted_key < n_local,
        weight=weights.reshape(-1).float()[order],
        ends=ends,
        n_tokens=t,
        topk=k,
    )


PlanBuilder = Callable[[torch.Tensor, torch.Tensor, int, int], MoEPlan]
_BUILDERS: dict[str, tuple[PlanBuilder, Callable[[torch.Tensor], str | None]]] = {}


def register_plan_builder(device_type: str, build: PlanBuilder, can_run: Callable[[torch.Tensor], str | None]) -> None:
    """Install `build(weights, indices, n_local, expert_offset)`, which must return `moe_plan`'s plan bit for
    bit, for indices on `device_type` where `can_run(indices)` is None."""
    _BUILDERS[device_type] = (build, can_run)


def build_plan(weights: torch.Tensor, indices: torch.Tensor, n_local: int, expert_offset: int) -> MoEPlan:
    """The plan from the builder installed for the indices' device (the Triton counting sort on CUDA: two
    launches instead of ~20) where it can run, else the sort. Inside torch.compile the sort is traced
    instead (measured on an H200: the graph that traced the Triton plan kernels under dynamic shapes handed
    `_grouped_mm` mismatched offsets)."""
    found = _BUILDERS.get(indices.device.type)
    if found is not None and not torch.compiler.is_compiling() and found[1](indices) is None:
        return found[0](weights, indices, n_local, expert_offset)
    return moe_plan(weights, indices, n_local, expert_offset)


class _GatherRows(torch.autograd.Function):
    """xs[i] = x[plan.token[i]]; backward sums each token's k slot gradients in slot order (no atomics)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.shape = (x.size(0), topk, x.size(1))
        return x[token]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        slots = torch.empty_like(grad).index_copy_(0, order, grad)  # [T*k, D] in slot order
        return slots.view(ctx.shape).sum(1), None, None, None


class _CombineRows(torch.autograd.Function):
    """y[t] = sum_j out[sorted position of slot (t, j)], summed in slot order (deterministic)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, token: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
        ctx.save_for_backward(token)
        slots = torch.empty_like(out).index_copy_(0, order, out)  # [T*k, D]
        return slots.view(-1, topk, out.size(1)).sum(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token,) = ctx.saved_tensors
        return grad[token], None, None, None


def gather_rows(x: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """[T, D] -> [T*k, D] in expert order; rows of foreign slots are zero (and pass zero gradient)."""
    xs = _GatherRows.apply(x, plan.token, plan.order, plan.topk)
    return torch.where(plan.valid.unsqueeze(-1), xs, torch.zeros((), dtype=xs.dtype, device=xs.device))


def mask_rows(t: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """Zero the rows of foreign slots (whatever they hold, even NaN); their gradient is zero too."""
    return torch.where(plan.valid.unsqueeze(-1), t, torch.zeros((), dtype=t.dtype, device=t.device))


def combine_rows(out: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """[T*k, D] expert-ordered expert outputs -> [T, D] fp32 sums; foreign rows are masked, never read."""
    out = torch.where(plan.valid.unsqueeze(-1), out.float(), torch.zeros((), device=out.device))
    return _CombineRows.apply(out, plan.token, plan.order, plan.topk)


def act_round_trip(t: torch.Tensor, act: str | None, round_trip: Callable[..., torch.Tensor]) -> torch.Tensor:
    """W8A8 on dequantized weights: the FP8 round trip of a projection's input, or t itself when act is None.
    round_trip: the backend passes the dispatched `dsv4.ops.fp8_round_trip` (so the fast backend runs where
    there is one); this module stays below the dispatcher."""
    if act is None:
        return t
    return round_trip(t, ACT_BLOCK, act_pow2(act))


def gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the experts' gate and up projections leave their GEMM in: the input dtype, except fp32 for
    fp16 inputs. The clamp at swiglu_limit exists because these pre-activations grow (in an FP16 port they
    reached FP16's maximum, docs/bugzoo.md Z05); rounded to fp16 first, a gate beyond -65504 becomes -inf and
    silu(-inf) = -inf * 0 = NaN. fp16 operands multiply exactly in fp32, so nothing else changes."""
    return torch.float32 if dtype == torch.float16 else dtype


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (limit 0 = no clamp)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up
