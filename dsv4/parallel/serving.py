"""Serving on N worker processes: the pass that makes a built model run across them, and the pieces each
worker needs per step (the step's inputs from the scheduler, an idle step).

A worker builds its model (`load_pretrained(..., rank=r, world_size=N)` reads only its experts, or any
full model), joins the group (`dsv4.parallel.workers.init_workers`) and applies
`parallelize_for_serving(model)`; then, every step, it runs `model.append(tokens, inputs, cache)` on its
own paged cache - all workers the same number of `append` (and `draft`) calls in the same order, since
every MoE layer is a collective. What the step is depends on the attention split:

- attention="replicated": every worker runs the same step on the same sequences (the scheduler's step,
  sent to all with `broadcast_step`), its own copy of the caches; each MoE layer ends in one all-reduce,
  and every worker gets the same logits (rank 0's are the ones to sample from).
- attention="data_parallel": each worker runs its own sequences in its own caches (a scheduler assigns
  each sequence to one worker); each MoE layer gathers every worker's tokens and returns each worker its
  rows. A worker with nothing to run in a step runs `idle_inputs` (one padding token written to the
  trash page) so that it still joins the layers' collectives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from ..model.paged import CacheLayout, StepInputs, uniform_inputs
from .expert import shard_experts

ATTENTION = ("replicated", "data_parallel")


@dataclass(frozen=True)
class ServingLayout:
    """How a model was parallelized for serving (`serving_layout(model)`)."""

    rank: int
    world_size: int
    attention: str
    expert_parallel: bool = True


# the layout of every model this process parallelized, kept here rather than on the model (whose modules
# are set by the model alone); weak keys: a model that is dropped leaves its entry with it
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, ServingLayout] = weakref.WeakKeyDictionary()


def serving_layout(model: nn.Module) -> ServingLayout | None:
    """How `parallelize_for_serving` parallelized `model` (None if it did not)."""
    return _LAYOUTS.get(model)


def parallelize_for_serving(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    expert_parallel: bool = True,
    attention: str = "replicated",
    ordered: bool | None = None,
) -> nn.Module:
    """Apply the serving passes to a built model, in place; returns it (in eval mode).

    expert_parallel: the routed experts are split by expert over the ranks of `group` (the default group
    when None): each worker keeps (or, loaded per rank, already holds) experts [r*E/N, (r+1)*E/N); the
    only split of the routed experts dsv4 has. Everything else - attention, its compressors and indexer,
    the shared expert, embedding, head, mHC - stays whole on every worker.
    attention: "replicated" or "data_parallel" (module docstring): how the MoE layers move tokens
    ("all_reduce" or "all_gather", `dsv4.parallel.expert`).
    ordered: combine the experts' outputs in the single-process order (bit-equal results); None = under
    exact accumulation only (a deterministic engine).
    Outside a process group, or in a group of one, the model is left as it is.
    """
    if not expert_parallel:
        raise ValueError(
            "dsv4 splits the routed experts by expert only: pass expert_parallel=True (--enable-expert-parallel)"
        )
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if model in _LAYOUTS:
        raise RuntimeError("the model is already parallelized for serving")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    if world > 1:
        shard_experts(model, group, mode="all_reduce" if attention == "replicated" else "all_gather", ordered=ordered)
    _LAYOUTS[model] = ServingLayout(rank, world, attention, expert_parallel)
    return model.eval()


def idle_inputs(layout: CacheLayout, device: torch.device | str) -> tuple[torch.Tensor, StepInputs]:
    """(tokens [1, 1], inputs) of a step that changes no cache: one padding token at position 0 of a row
    with no pages, every write of it going to the trash page and ring row. A data-parallel worker with no
    sequence in a step runs `append` on it to join the MoE collectives; its logits mean nothing."""
    tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
    none = torch.full((1, layout.table_width()), -1, dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return tokens, uniform_inputs(tokens, zero, none, none.clone(), zero.clone(), layout, last_only=True)


# ----------------------------------------------------------------------------- one step, every worker
def _describe(x, tensors: list[torch.Tensor]):
    """A picklable description of x with its tensors replaced by their place in `tensors`."""
    if isinstance(x, torch.Tensor):
        tensors.append(x.contiguous())
        return ("tensor", len(tensors) - 1, tuple(x.shape), str(x.dtype).removeprefix("torch."))
    if isinstance(x, dict):
        return ("dict", [(k, _describe(v, tensors)) for k, v in x.items()])
    if isinstance(x, list):
        return ("list", [_describe(v, tensors) for v in x])
    return ("value", x)


def _build(desc, tensors: list[torch.Tensor]):
    kind, body = desc[0], desc[1]
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {k: _build(v, tensors) for k, v in body}
    if kind == "list":
        return [_build(v, tensors) for v in body]
    return body


def broadcast_step(
    tokens: torch.Tensor | None,
    inputs: StepInputs | None,
    *,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> tuple[torch.Tensor, StepInputs]:
    """The scheduler's step, from worker `src` to every worker: (tokens, inputs) on `device` everywhere.

    On `src` pass the step (its tensors on `device`); elsewhere pass None, None. One small object
    broadcast (the structure: shapes, dtypes, the host values), then one broadcast per tensor.
    """
    rank = dist.get_rank(group)
    root = dist.get_global_rank(group, src) if group is not None else src
    tensors: list[torch.Tensor] = []
    meta: list = [None]
    if rank == src:
        if tokens is None or inputs is None:
            raise ValueError("the source worker must pass the step's tokens and inputs")
        step = {"step_tokens": tokens, **{f.name: getattr(inputs, f.name) for f in fields(inputs)}}
        meta = [_describe(step, tensors)]
    dev = torch.device(device)
    dist.broadcast_object_list(meta, src=root, group=group, device=dev if dev.type == "cuda" else None)
    if rank != src:
        specs: list[tuple[int, tuple, str]] = []

        def collect(desc) -> None:
            if desc[0] == "tensor":
                specs.append(desc[1:])
            elif desc[0] in ("dict", "list"):
                for item in desc[1]:
                    collect(item[1] if desc[0] == "dict" else item)

        collect(meta[0])
        tensors = [torch.empty(shape, dtype=getattr(torch, dt), device=dev) for _, shape, dt in sorted(specs)]
    for t in tensors:
        dist.broadcast(t, src=root, group=group)
    step = _build(meta[0], tensors)
    tok = step.pop("step_tokens")
    if isinstance(step.get("shape"), list):
        step["shape"] = tuple(step["shape"])
    return tok, StepInputs(**step)


__all__ = ["ATTENTION", "ServingLayout", "broadcast_step", "idle_inputs", "parallelize_for_serving"]
