"""Scale-out on torch.distributed: FSDP2 data parallelism plus expert parallelism for the routed experts.

Layout with W processes (launched by `torchrun`; gloo on CPU, NCCL on CUDA):
- dense parameters (attention, norms, router, shared expert, embedding, head, mHC) are sharded with FSDP2
  (`fully_shard`) over the data-parallel mesh; every rank trains on its own slice of the global batch;
- the routed experts of every MoE layer are split into W contiguous ranges: rank r keeps experts
  [r*E/W, (r+1)*E/W). Each MoE layer's experts module is swapped for its expert-parallel form (same
  parameter names), which sends every (token, expert) pair to the rank holding the expert (all-to-all),
  runs the local experts there and sends the results back (`dsv4.parallel.expert`, shared with serving,
  which moves the tokens by all-reduce or all-gather).
  Expert parameters are left out of FSDP (each rank owns distinct experts); their gradients already
  sum every rank's tokens, so they are scaled by 1/W to match FSDP's data-parallel mean.

The rank that decides a layer's expert range is read from the live process group at sharding time and
checked again on every call (docs/bugzoo.md Z08: a rank cached as 0 made every process serve experts 0..E/W-1;
`dsv4.parallel.expert._ep_rank`).

Entry points: `setup_distributed`, `shard_model` (training), `shard_experts(..., mode="all_reduce")`
(inference with replicated tokens), `clip_grad_norm_`, `all_reduce_expert_load`, `full_state_dict` /
`load_full_state_dict`, `full_optimizer_state` / `load_full_optimizer_state` (checkpoints hold both in
the single-process layout), `unsharded_copy`. The parity self-test against a single-process replica is
`dsv4.train.parity` (`python -m dsv4.train.parity --selftest`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UserError
from ..parallel import expert as _ep
from ..parallel.expert import (  # noqa: F401  (the expert-parallel core lives in dsv4.parallel; re-exported)
    ExpertParallel,
    all_to_all,
    expert_range,
    is_expert_param,
    moe_layers,
    shard_experts,
)


# ----------------------------------------------------------------------------- process group
def setup_distributed(
    backend: str | None = None, device: str | None = None, timeout_s: float = 1800.0
) -> tuple[int, int, torch.device]:
    """Join the process group described by torchrun's environment -> (rank, world, device).

    Without torchrun variables (WORLD_SIZE unset or 1) nothing is initialized and (0, 1, device) is
    returned. The device is cuda:LOCAL_RANK when CUDA is available (unless device="cpu"), else cpu; the
    backend defaults to NCCL on CUDA and gloo on CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"process {local_rank} of this machine needs cuda:{local_rank}, and it has "
                f"{torch.cuda.device_count()} CUDA device(s): start at most that many processes per "
                "node, or pass --device cpu to train on the CPU (gloo)"
            )
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if use_cuda else "gloo")
        # device_id binds the NCCL communicator to this rank's GPU up front (without it NCCL guesses the
        # device from the rank and warns); gloo takes none
        kw = {"device_id": dev} if use_cuda and backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kw)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, dev


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shard_model(
    model: nn.Module,
    ep: bool = True,
    dp_mesh=None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    ep_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """FSDP2 over the data-parallel mesh for dense weights, expert parallelism for the routed experts.

    Call on every rank with the same full model (e.g. `DeepSeekV4.from_config(cfg, seed=s)`), after moving
    it to the rank's device. Each main block is an FSDP unit; the root unit holds the rest (embedding,
    head, norms, MTP blocks).
    Expert parallelism uses its own process group over all ranks (created here unless given), so its
    all-to-alls never interleave with FSDP's collectives. Single process: returns the model unchanged.
    Returns the model (modified in place).
    """
    if not is_distributed():
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if isinstance(model, FSDPModule):  # fully_shard gave the model its FSDP class
        raise RuntimeError("model is already sharded")
    device_type = next(model.parameters()).device.type
    if dp_mesh is None:
        dp_mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if ep:
        if ep_group is None:
            ep_group = dist.new_group(list(range(dist.get_world_size())))
        shard_experts(model, ep_group, mode="all_to_all")
        dp = dp_mesh.size()
        if dp != dist.get_world_size(ep_group):
            raise ValueError("expert parallelism expects data-parallel and expert-parallel groups to match")
    expert_params = {p for p in model.parameters() if is_expert_param(p)}
    scale = 1.0 / dp_mesh.size()
    for p in expert_params:
        # sum over every rank's tokens of d(local mean loss) -> the data-parallel mean, like FSDP's reduce
        p.register_hook(lambda g: g * scale)
    kw = {
        "mesh": dp_mesh,
        "ignored_params": expert_params or None,
        "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
    }
    # MTP blocks stay in the root unit: the model calls their `combine` outside the block's forward
    for block in getattr(model, "layers", []):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, **kw)
    # incremental decoding (sampling during training, held-out generation) enters through these methods,
    # not forward: let FSDP gather the root unit's weights around them too. Under expert parallelism every
    # rank must decode the same number of steps (the exchange is collective).
    # (prefill and decode_step call append)
    if hasattr(model, "append"):
        register_fsdp_forward_method(model, "append")
    return model


# ----------------------------------------------------------------------------- training helpers
def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@torch.no_grad()
def grad_norm(model: nn.Module) -> torch.Tensor:
    """Global L2 norm of all gradients (FSDP shards, rank-local experts, replicated tensors), fp32 scalar on
    the device: per-tensor norms in foreach kernels, one all-reduce, no host sync."""
    from torch.distributed.tensor import Shard

    params = [p for p in model.parameters() if p.grad is not None]
    dev = params[0].device if params else torch.device("cpu")
    world = dist.get_world_size() if is_distributed() else 1
    own, shared = [], []  # summed over ranks as they are / replicated: counted once (1/world each)
    for p in params:
        g = p.grad
        if _is_dtensor(g):
            if all(isinstance(pl, Shard) for pl in g.placements):
                own.append(g.to_local())  # disjoint shards
            else:
                shared.append(g.full_tensor())
        elif is_expert_param(p):
            own.append(g)  # distinct experts per rank
        else:
            shared.append(g)  # identical on every rank
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for ts, w in ((own, 1.0), (shared, 1.0 / world)):
        ts = [t for t in ts if t.numel()]
        if ts:
            norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in ts])
            sq = sq + torch.stack(norms).square().sum() * w
    if world > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


@torch.no_grad()
def scale_grads_(model: nn.Module, max_norm: float, total: torch.Tensor, eps: float = 1e-6) -> None:
    """Multiply every (local) gradient by min(1, max_norm / (total + eps)), total a device scalar: no host sync."""
    coef = (max_norm / (total + eps)).clamp(max=1.0)
    grads = [p.grad.to_local() if _is_dtensor(p.grad) else p.grad for p in model.parameters() if p.grad is not None]
    by_dev: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            by_dev.setdefault(g.device, []).append(g)
    for d, gs in by_dev.items():
        torch._foreach_mul_(gs, coef.to(d))


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients so the global norm is at most max_norm; returns the norm before clipping."""
    total = grad_norm(model)
    scale_grads_(model, max_norm, total, eps)
    return total


@torch.no_grad()
def all_reduce_expert_load(model: nn.Module) -> list[torch.Tensor]:
    """Sum each MoE layer's measured expert load ([E] token counts) over the data-parallel ranks in place,
    so the load-balancing bias update sees the global batch and stays identical on every rank."""
    loads = [m.load for m in moe_layers(model) if m.load is not None]
    if is_distributed() and loads:
        if len({(t.dtype, t.device) for t in loads}) == 1:  # one all-reduce over all layers' loads
            flat = torch.cat([t.reshape(-1) for t in loads])
            dist.all_reduce(flat)
            torch._foreach_copy_(loads, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in loads]), loads)])
        else:
            for load in loads:
                dist.all_reduce(load)
    return loads


def _full(t: torch.Tensor, expert: bool, group) -> torch.Tensor:
    if _is_dtensor(t):
        return t.full_tensor()
    if expert:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, 0)
    return t


def _ep_group_of(model: nn.Module):
    for moe in moe_layers(model):
        if isinstance(moe.experts, ExpertParallel):
            return moe.experts.group
    return None


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (same names and shapes as the single-process model) on every rank.

    A collective: call on all ranks (rank 0 typically writes it)."""
    group = _ep_group_of(model)
    experts = {n for n, p in model.named_parameters() if is_expert_param(p)}
    return {n: _full(t, n in experts, group).detach().clone() for n, t in model.state_dict().items()}


@torch.no_grad()
def unsharded_copy(model: nn.Module) -> nn.Module:
    """A plain single-process replica of a sharded DeepSeekV4 with the full weights, on every rank.

    A collective (call on all ranks); afterwards rank 0 may sample or evaluate with it alone, which the
    sharded model cannot do (its FSDP gathers and expert exchanges need every rank)."""
    from ..model.transformer import DeepSeekV4

    copy = DeepSeekV4(model.cfg, device="meta")
    copy.load_state_dict(full_state_dict(model), assign=True)
    return copy.train(model.training)


@torch.no_grad()
def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name (dense parameters without a gradient omitted). A collective."""
    group = _ep_group_of(model)
    out = {}
    for n, p in model.named_parameters():
        if is_expert_param(p):
            # a rank whose experts got no tokens has no gradient there; gather zeros so that every rank
            # joins the same collectives
            out[n] = _full(p.grad if p.grad is not None else torch.zeros_like(p), True, group).clone()
        elif p.grad is not None:
            out[n] = _full(p.grad, False, group).clone()
    return out


def local_part(full: torch.Tensor, p: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's part of `full`, a whole tensor shaped like parameter p, in p's form: a DTensor with p's
    mesh and placements (FSDP), the rank's expert slice (expert parallelism) or `full` itself. No comms."""
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=p.device, dtype=p.dtype)
    if _is_dtensor(p):
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)  # slice, no comms
    if is_expert_param(p):
        n_local = p.size(0)
        lo = _ep._ep_rank(group) * n_local
        return full[lo : lo + n_local]
    return full


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full (single-process layout) state dict into a sharded model: each rank takes its shard."""
    params = dict(model.named_parameters())
    group = _ep_group_of(model)
    for name, t in model.state_dict().items():
        p = params.get(name, t)
        part = local_part(state[name], p, group)
        (p.to_local() if _is_dtensor(p) else p if is_expert_param(p) else t).copy_(
            part.to_local() if _is_dtensor(part) else part
        )


@torch.no_grad()
def full_optimizer_state(opt, model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The trainer's MuonAdamW state as full CPU tensors by parameter name (the single-process layout of
    `checkpoint.optimizer_tensors`): FSDP-sharded moments gathered, expert-parallel momenta concatenated
    over ranks. A collective (call on all ranks); keep=False returns {} on ranks that do not write it."""
    from .checkpoint import optimizer_tensors

    group = _ep_group_of(model)
    return optimizer_tensors(opt, model, full=lambda t, p: _full(t, is_expert_param(p), group), keep=keep)


@torch.no_grad()
def load_full_optimizer_state(opt, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `full_optimizer_state`: every rank takes its shard of each moment. No comms."""
    from .checkpoint import load_optimizer_tensors

    group = _ep_group_of(model)
    load_optimizer_tensors(opt, model, tensors, local=lambda t, p: local_part(t, p, group))
