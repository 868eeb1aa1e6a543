"""Expert parallelism: the routed experts of every MoE layer split over the ranks of a process group.

Rank r of N holds experts [r*E/N, (r+1)*E/N) (`expert_range`, `dsv4.model.moe.expert_slice`). `shard_experts`
is a pass that swaps each MoE layer's experts module for its parallel form (`ExpertParallel`): the same
module - the same parameters under the same names, the same options - whose forward brings every
(token, expert) pair to the rank holding the expert and the results back; the MoE layer just calls its
`experts`. Three ways to move the tokens, one per situation:

- "all_to_all" (training: every rank holds its own tokens and gradients flow): each pair travels to the
  rank owning its expert, runs there, and its fp32 result travels back and is summed per token
  (differentiable; the exchange sizes are read on the host).
- "all_reduce" (serving with replicated attention: every rank runs the same step, so every rank already
  holds every token): each rank runs its own experts on all tokens and the results are summed over the
  ranks (one all-reduce of [T, dim] fp32 per layer; no host read).
- "all_gather" (serving with data-parallel attention: each rank runs its own sequences): the tokens of
  every rank are gathered (padded to the largest count), each rank runs its own experts on all of them,
  and each rank's rows are sent back to it (all-to-all) and summed there in rank order.

Exact mode (inference under `dsv4.ops.precision.exact_accumulation`, what a deterministic engine runs):
the serving modes then reproduce the single-process sum bit for bit. The single-process experts add each
token's routed outputs one expert after the other in increasing expert id (`ops.reference.moe_experts`);
a sum of per-rank partial sums would associate them differently. So each (token, slot) pair is computed
as its own row (the same rows the expert sees in one process: its tokens, in token order), the rows are
combined over the ranks - each slot is non-zero on exactly one rank, and x + 0 is exact - and every rank
then adds a token's slots in increasing expert id (`ordered_sum`). The cost is k times the exchange.
Outside exact mode the partial sums are combined: the same k terms added in another order, within
2 gamma(k) of their absolute sum (fp32).

The rank that decides a layer's expert range is read from the live process group at sharding time and
checked again on every call (docs/bugzoo.md Z08: a rank cached as 0 made every process serve experts
0..E/W-1). Works on float experts (`dsv4.model.moe.Experts`) and kept-quantized ones
(`dsv4.checkpoint.quantized.QuantExperts`, FP8 or MXFP4), whole models or models loaded per rank.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..model.moe import MoE, expert_slice
from ..ops.precision import is_exact

_EP_ATTR = "_dsv4_expert_parallel"
MODES = ("all_to_all", "all_reduce", "all_gather")


def _ep_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in the expert-parallel group, read from the live group on every call."""
    return dist.get_rank(group)


def expert_range(n_experts: int, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """[lo, hi) of the global expert ids this rank holds."""
    return expert_slice(n_experts, _ep_rank(group), dist.get_world_size(group))


def is_expert_param(p: torch.Tensor) -> bool:
    """True for routed-expert parameters split by expert parallelism (distinct on every rank)."""
    return bool(getattr(p, _EP_ATTR, False))


def moe_layers(model: nn.Module) -> Iterator[nn.Module]:
    """Every MoE feed-forward of the model (main layers and MTP blocks)."""
    for mod in model.modules():
        if isinstance(mod, MoE):
            yield mod


def held(experts: nn.Module) -> tuple[int, int]:
    """(first global expert id, number of experts) a float or kept-quantized experts module holds."""
    n = experts.n if hasattr(experts, "n") else experts.w1.size(0)
    return int(experts.offset), int(n)


# ----------------------------------------------------------------------------- all-to-all
class _AllToAll(torch.autograd.Function):
    """Rows of x go to ranks by `send` counts; `recv` rows arrive. The backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gx = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group=None) -> torch.Tensor:
    """Differentiable variable-size all-to-all along dim 0: x [sum(send), ...] -> [sum(recv), ...]."""
    return _AllToAll.apply(x, recv, send, group)


def gather_rows(t: torch.Tensor, counts: list[int], group=None) -> torch.Tensor:
    """Every rank's rows of t, concatenated in rank order: [sum(counts), ...] (t has counts[rank] rows).
    Padded to the largest count for the collective (equal sizes: gloo and NCCL alike)."""
    top = max(counts)
    pad = t.new_zeros((top, *t.shape[1:]))
    pad[: t.size(0)] = t
    parts = [torch.empty_like(pad) for _ in counts]
    dist.all_gather(parts, pad, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def ordered_sum(per_slot: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """per_slot [T, k, D] fp32 (slot j of token t: its routed expert's weighted output) -> [T, D] fp32,
    each token's slots added one after the other in increasing expert id, from zero: the order in which
    `ops.reference.moe_experts` adds them in one process (ties in slot order)."""
    order = indices.argsort(dim=1, stable=True)  # [T, k]
    per_slot = per_slot.gather(1, order.unsqueeze(-1).expand_as(per_slot))
    y = torch.zeros(per_slot.shape[0], per_slot.shape[2], dtype=torch.float32, device=per_slot.device)
    for j in range(per_slot.size(1)):
        y = y + per_slot[:, j]
    return y


class ExpertParallel(nn.Module):
    """The routed experts of one MoE layer split across the ranks of `group`: an experts module in its
    parallel form, built by `ExpertParallel.of(experts, ...)` (`shard_experts` swaps it in).

    Its class derives from this one and from the experts module's own class (`dsv4.model.moe.Experts`,
    `dsv4.checkpoint.quantized.QuantExperts`), as FSDP2 derives the class of a module it shards, and it
    takes over that module's tensors and settings: parameter and buffer names (`...ffn.experts.w1`), the
    parameter objects, and every option (FP4 fake-quant, act_format, eager under compile) stay as they
    were. Its forward moves the (token, expert) pairs; the experts held here compute through the base
    class's forward.

    mode: "all_to_all" (training), "all_reduce" (serving, replicated tokens), "all_gather" (serving,
    per-rank tokens); see the module docstring. ordered: combine per slot in expert order (bit-equal to
    one process), None = in exact mode only. The serving modes run under torch.no_grad().
    """

    n_experts: int
    group: dist.ProcessGroup | None
    mode: str
    ordered: bool | None

    @classmethod
    def of(
        cls,
        experts: nn.Module,
        n_experts: int,
        group: dist.ProcessGroup | None,
        mode: str = "all_to_all",
        ordered: bool | None = None,
    ) -> ExpertParallel:
        """The parallel form of `experts` (a module holding experts [offset, offset + n) of a layer of
        n_experts): a new module sharing its parameters and buffers; `experts` itself is left unchanged."""
        if mode not in MODES:
            raise ValueError(f"unknown expert-parallel mode {mode!r}; one of {MODES}")
        if isinstance(experts, ExpertParallel):
            raise RuntimeError("experts are already sharded")
        kind = _parallel_class(type(experts))
        new = kind.__new__(kind)
        for k, v in vars(experts).items():  # containers copied (own dicts of parameters, hooks ...)
            new.__dict__[k] = copy.copy(v) if isinstance(v, (dict, set)) else v
        new._setup(n_experts, group, mode, ordered)
        return new

    def _setup(self, n_experts: int, group: dist.ProcessGroup | None, mode: str, ordered: bool | None) -> None:
        self.n_experts, self.group, self.mode, self.ordered = n_experts, group, mode, ordered

    def extra_repr(self) -> str:
        return ", ".join(r for r in (super().extra_repr(), f"expert_parallel={self.mode}") if r)

    def _live_offset(self) -> tuple[int, int]:
        lo, hi = expert_range(self.n_experts, self.group)
        start, n = held(self)
        if lo != start or hi - lo != n:
            raise RuntimeError(
                f"expert-parallel rank {_ep_rank(self.group)} should hold "
                f"experts [{lo}, {hi}) but holds {n} from {start}: the process group "
                "changed after sharding"
            )
        return lo, hi - lo

    def _local(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        # the experts class's own forward (so its options, e.g. FP4 fake-quant, still apply); the offset
        # was just checked against the live rank, and ids outside its range are skipped
        return super().forward(x, weights, indices)  # fp32 [T, dim]

    def _per_slot(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """fp32 [T, k, D]: each (token, slot) pair as its own row through the local experts (zero where
        another rank holds the slot's expert)."""
        t, k = indices.shape
        rows = x.unsqueeze(1).expand(t, k, x.size(-1)).reshape(t * k, -1)  # [T*k, D]
        out = self._local(rows, weights.reshape(-1, 1), indices.reshape(-1, 1))  # [T*k, D]
        return out.view(t, k, -1)

    @torch.compiler.disable  # host-sized exchanges: stays eager inside a torch.compile'd block
    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, dim], weights [T, k] fp32, indices [T, k] global expert ids -> fp32 [T, dim]."""
        _, n_local = self._live_offset()
        if self.mode == "all_to_all":
            return self._exchange(x, weights, indices, n_local)
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise RuntimeError(
                f"{self.mode} expert parallelism is for inference: run under "
                "torch.no_grad(), or shard with mode='all_to_all' for training"
            )
        ordered = is_exact() if self.ordered is None else self.ordered
        if self.mode == "all_reduce":
            y = self._per_slot(x, weights, indices) if ordered else self._local(x, weights, indices)
            dist.all_reduce(y, group=self.group)
            return ordered_sum(y, indices) if ordered else y
        return self._gathered(x, weights, indices, ordered)

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ordered: bool) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        t = x.size(0)
        count = torch.tensor([t], dtype=torch.long, device=x.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=self.group)
        counts = [int(c) for c in counts]  # host read
        xa, wa, ia = (gather_rows(a, counts, self.group) for a in (x, weights, indices))  # [sum T, ...]
        out = self._per_slot(xa, wa, ia) if ordered else self._local(xa, wa, ia)  # [sum T, (k,) D]
        back = out.new_empty((world * t, *out.shape[1:]))
        dist.all_to_all_single(back, out.contiguous(), [t] * world, counts, group=self.group)
        parts = back.view(world, t, *out.shape[1:])  # every rank's share
        y = parts[0]
        for r in range(1, world):  # rank order: fixed
            y = y + parts[r]
        return ordered_sum(y, indices) if ordered else y

    def _exchange(self, x, weights, indices, n_local: int) -> torch.Tensor:
        t, k = indices.shape
        world = dist.get_world_size(self.group)
        ids = indices.reshape(-1)  # [T*k]
        dest = torch.div(ids, n_local, rounding_mode="floor")  # owner rank per pair
        order = torch.argsort(dest, stable=True)  # grouped by rank
        send_counts = torch.bincount(dest, minlength=world)  # [W]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        tok = torch.div(order, k, rounding_mode="floor")  # [N] pair -> token

        xs = all_to_all(x[tok], recv, send, self.group)  # [M, dim]
        ws = all_to_all(weights.reshape(-1)[order], recv, send, self.group)  # [M] fp32
        ids_in = ids.new_empty(sum(recv))
        dist.all_to_all_single(ids_in, ids[order].contiguous(), recv, send, group=self.group)
        y = self._local(xs, ws.unsqueeze(-1), ids_in.unsqueeze(-1))  # fp32 [M, dim]
        # keep both exchanges in the graph even when nothing arrived here, so every rank runs the same
        # backward collectives (a sum over an empty slice is an exact zero, also next to inf/nan rows)
        y = y + (xs[:0].sum() + ws[:0].sum())
        back = all_to_all(y, send, recv, self.group)  # fp32 [N, dim]
        out = torch.zeros(t, x.size(-1), dtype=torch.float32, device=x.device)
        return out.index_add(0, tok, back)  # fp32 [T, dim]


_PARALLEL_CLASSES: dict[type, type] = {}


def _parallel_class(base: type) -> type:
    """The parallel form of an experts class: ExpertParallel first (its forward), then `base` (the state
    and the local computation). One class per base, made on first use."""
    cls = _PARALLEL_CLASSES.get(base)
    if cls is None:
        cls = _PARALLEL_CLASSES[base] = type(
            f"ExpertParallel{base.__name__}", (ExpertParallel, base), {"__module__": __name__}
        )
    return cls


# ----------------------------------------------------------------------------- sharding
def _keep_experts(ex: nn.Module, lo: int, hi: int) -> None:
    """Cut experts holding a whole layer down to [lo, hi), through the module's own `narrow` (float
    parameters: `dsv4.model.moe.Experts`; kept-quantized buffers: `QuantExperts`)."""
    if not hasattr(ex, "narrow"):
        raise TypeError(f"{type(ex).__name__} experts cannot be split over ranks (no narrow)")
    ex.narrow(lo, hi)


def shard_experts(
    model: nn.Module, group: dist.ProcessGroup | None = None, mode: str = "all_to_all", ordered: bool | None = None
) -> int:
    """Keep only this rank's routed experts in every MoE layer and swap each layer's experts module for
    its parallel form (`ExpertParallel.of`; parameter names unchanged).

    Works on a full model (every rank built or loaded the same weights: each keeps its range) and on a model
    loaded per rank (`load_pretrained(..., rank=, world_size=)`: its range is checked against the live
    group's). Returns the number of MoE layers sharded.
    """
    if mode not in MODES:
        raise ValueError(f"unknown expert-parallel mode {mode!r}; one of {MODES}")
    n = 0
    for path, moe in [(p, m) for p, m in model.named_modules() if isinstance(m, MoE)]:
        ex = moe.experts
        if isinstance(ex, ExpertParallel) or any(is_expert_param(p) for p in ex.parameters()):
            raise RuntimeError("experts are already sharded")
        lo, hi = expert_range(moe.n_experts, group)
        start, count = held(ex)
        if (start, count) == (0, moe.n_experts):
            _keep_experts(ex, lo, hi)
        elif (start, count) != (lo, hi - lo):
            raise RuntimeError(
                f"a MoE layer holds experts [{start}, {start + count}), but rank "
                f"{_ep_rank(group)} of {dist.get_world_size(group)} owns [{lo}, {hi}): load it "
                "with this rank and world size"
            )
        for t in [*ex.parameters(), *ex.buffers()]:
            setattr(t, _EP_ATTR, True)
        model.set_submodule(
            f"{path}.experts" if path else "experts", ExpertParallel.of(ex, moe.n_experts, group, mode, ordered)
        )
        n += 1
    return n


__all__ = [
    "MODES",
    "ExpertParallel",
    "all_to_all",
    "expert_range",
    "gather_rows",
    "held",
    "is_expert_param",
    "moe_layers",
    "ordered_sum",
    "shard_experts",
]
