"""V4 MoE: sqrtsoftplus router with a selection-only bias, hash-routed first layers, clamped SwiGLU experts.

Routed experts are stored stacked per layer (`experts.w1` [E, inter, dim] ...) so a grouped GEMM can
run them at once; `dsv4.checkpoint` maps these to the official per-expert names. They dispatch
(`ops.moe_experts`). The shared expert is three dense matmuls for every token, through its `Linear`
modules (torch's GEMMs, or the weights' own quantized numerics), with the clamped SwiGLU between them as
one op (`ops.clamped_swiglu`: a single kernel on a GPU instead of seven elementwise ones).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..ops.moe_shared import gate_dtype
from .layers import Linear, autocast_dtype, linear_fp32, record, recording_active


def expert_slice(n_experts: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi): the routed experts rank `rank` of `world` holds under expert parallelism - contiguous
    equal ranges, rank r holding [r*E/N, (r+1)*E/N) (as the official inference layout splits them)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of {world} ranks")
    if n_experts % world:
        raise ValueError(f"{n_experts} routed experts cannot be split evenly over {world} ranks")
    n = n_experts // world
    return rank * n, (rank + 1) * n


class Gate(nn.Module):
    """Router. scores = f(x W^T) in fp32; `bias` shifts scores for selection only; weights are the
    unbiased scores of the chosen experts, normalized to sum 1 (not for softmax), times route_scale once.
    Hash layers choose experts by `tid2eid[token]` (a frozen table) and still weight them by the router.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.topk, self.score_func, self.route_scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale
        self.hash = layer_id < cfg.n_hash_layers
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.int32))
            self.bias = None
        else:
            # updated by the auxiliary-loss-free balancing rule, not by gradients
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] fp32 router scores (computed in float64 under exact accumulation: `ops.reference.route`)."""
        return ops.reference.router_scores(linear_fp32(x, self.weight), self.score_func)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim], token_ids [T] -> (weights [T, k] fp32, indices [T, k] int64, scores [T, E]).

        Everything after the projection is one op (`ops.route`: the scores, the top-k or the hash table's
        row, the normalization in the accumulation dtype - under exact accumulation a token's weights then
        do not depend on how many tokens share the call)."""
        logits = linear_fp32(x, self.weight)  # [T, E] fp32
        table, ids = (self.tid2eid, token_ids) if self.hash else (None, None)
        return ops.route(logits, self.bias, self.topk, self.score_func, self.route_scale, table, ids)


class Experts(nn.Module):
    """The routed experts of one layer, stacked: w1, w3 [E, inter, dim]; w2 [E, dim, inter]; experts
    offset .. offset + E - 1 of the layer (all of them, or one rank's range under expert parallelism).

    `stored_format` / `act_format` (`dsv4.model.quant`: `mark_stored` records how a checkpoint stored the
    experts, `set_quant_mode` chooses the numerics): stored as FP8 / FP4 and dequantized at load, W8A8 -
    the input of every projection is quantized as `ops.moe_experts(act=...)` describes.

    Training options (`DeepSeekV4.set_options` sets them):
    - `fp4_fake_quant`: the experts compute with their weights rounded to FP4 (MXFP4-style, blocks of 32:
      `ops.fp4_round_trip`) and gradients pass straight through to the full-precision weights;
    - `eager_under_compile`: the experts stay eager inside a torch.compile'd block (their loop over
      experts is data-dependent, so tracing it only adds graph breaks and recompilations);
    - `cast_cache`: under autocast, where it holds a copy of a weight in the autocast dtype
      (`cast_cache.get(weight, dtype)`, e.g. `dsv4.train.casts.StepCasts`), the experts compute with it
      instead of casting the weight at every forward (the same values; gradients flow to the weight).
    """

    stored_format: str | None = None
    act_format: str | None = None
    fp4_fake_quant: bool = False
    cast_cache = None
    _eager_under_compile: bool = False

    @property
    def eager_under_compile(self) -> bool:
        return self._eager_under_compile

    @eager_under_compile.setter
    def eager_under_compile(self, on: bool) -> None:
        if on:
            _eager_experts()  # made now, before any trace reaches `forward`
        self._eager_under_compile = bool(on)

    def __init__(self, cfg: ModelConfig, n_experts: int | None = None, offset: int = 0):
        super().__init__()
        e = cfg.n_routed_experts if n_experts is None else n_experts
        self.offset, self.swiglu_limit = offset, cfg.swiglu_limit
        self.w1 = nn.Parameter(torch.empty(e, cfg.moe_inter_dim, cfg.dim))
        self.w3 = nn.Parameter(torch.empty(e, cfg.moe_inter_dim, cfg.dim))
        self.w2 = nn.Parameter(torch.empty(e, cfg.dim, cfg.moe_inter_dim))

    @torch.no_grad()
    def narrow(self, lo: int, hi: int) -> Experts:
        """Keep only experts [lo, hi) of the layer (global ids; they must be held here). In place: the
        projections become new parameters [hi - lo, ...] (copies), with the same requires_grad."""
        n = self.w1.size(0)
        a, b = lo - self.offset, hi - self.offset
        if not 0 <= a < b <= n:
            raise ValueError(f"experts [{lo}, {hi}) are not all held here ([{self.offset}, {self.offset + n}))")
        for name in ("w1", "w2", "w3"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full[a:b].clone(), requires_grad=full.requires_grad))  # [hi-lo, ...]
        self.offset = lo
        return self

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> fp32 [T, dim] (sum over the token's experts held here)."""
        if self._eager_under_compile:
            return _eager_experts()(self, x, weights, indices)
        return self._compute(x, weights, indices)

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.fp4_fake_quant:
            q = ops.fp4_round_trip
            return ops.moe_experts(x, weights, indices, q(w1, 32), q(w2, 32), q(w3, 32), self.swiglu_limit, self.offset)
        low = autocast_dtype(x.device.type)
        if low is not None:  # mixed precision: the grouped GEMMs take bf16 operands, as autocast would
            x, w1, w2, w3 = x.to(low), *(self._cast(w, low) for w in (w1, w2, w3))
        if self.act_format is not None:
            return ops.moe_experts(x, weights, indices, w1, w2, w3, self.swiglu_limit, self.offset, act=self.act_format)
        return ops.moe_experts(x, weights, indices, w1, w2, w3, self.swiglu_limit, self.offset)

    def _cast(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        kept = self.cast_cache.get(w, dtype) if self.cast_cache is not None else None
        return kept if kept is not None else w.to(dtype)


def _experts_compute(experts: Experts, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return experts._compute(x, weights, indices)


_EAGER: list = []  # [torch.compiler.disable(_experts_compute)] once wanted: disable imports torch._dynamo (~2 s)


def _eager_experts() -> Callable[..., torch.Tensor]:
    """`_experts_compute` that torch.compile leaves eager, made on first use, so that importing the model
    (every command line that loads one) does not import the compiler."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_experts_compute))
    return _EAGER[0]


class Expert(nn.Module):
    """One dense clamped-SwiGLU expert (the shared expert). Each projection is its module's forward, so a
    weight stored as FP8 / FP4 computes with its own numerics (W8A8 or W8A16, dequantized or kept
    quantized)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu_limit = cfg.swiglu_limit
        self.w1 = Linear(cfg.dim, cfg.moe_inter_dim)
        self.w2 = Linear(cfg.moe_inter_dim, cfg.dim)
        self.w3 = Linear(cfg.dim, cfg.moe_inter_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = {1: self.w1, 2: self.w2, 3: self.w3}
        wide = gate_dtype(x.dtype)  # fp16: gate and up leave their matmul in fp32 (moe_shared.gate_dtype)

        def project(t: torch.Tensor, i: int) -> torch.Tensor:
            return proj[i](t, out_dtype=wide) if i != 2 and wide != t.dtype else proj[i](t)

        gate, up = project(x, 1), project(x, 3)
        return project(ops.clamped_swiglu(gate, up, self.swiglu_limit, x.dtype), 2)


class MoE(nn.Module):
    """Router, routed experts and the optional shared expert of one layer.

    `experts` is whatever computes the routed experts, (x [T, dim], weights [T, k], indices [T, k]) ->
    fp32 [T, dim]: `Experts`, or a module a pass swapped in (kept quantized, INT8, or split over ranks by
    expert parallelism, `dsv4.parallel.expert`). `load` is the expert load ([E] token counts) the last
    forward measured in training mode or with autograd on; the load-balancing bias update reads it
    (`dsv4.train.balance`). An inference forward (eval mode under no_grad) measures none: None."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.n_experts, self.topk = cfg.n_routed_experts, cfg.n_activated_experts
        self.gate = Gate(cfg, layer_id)
        self.experts = Experts(cfg)
        self.shared_experts = Expert(cfg) if cfg.n_shared_experts else None
        self.stage = f"layers.{layer_id}.ffn"
        self.load: torch.Tensor | None = None

    def set_load(self, load: torch.Tensor | None) -> None:
        """Take `load` ([E] token counts) as the measured load, as the forward that produced it elsewhere
        would have set it (a replayed CUDA graph's output; benchmarks of the bias update)."""
        if load is not None and tuple(load.shape) != (self.n_experts,):
            raise ValueError(f"an expert load has {self.n_experts} entries, got shape {tuple(load.shape)}")
        self.load = load

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        losses: dict[str, torch.Tensor] | None = None,
        balance_alpha: float = 0.0,
    ) -> torch.Tensor:
        """x [b, s, dim], token_ids [b, s] -> [b, s, dim]. balance_alpha > 0 (in training mode): the
        sequence-wise balance loss goes into losses["balance"] (a dict the caller gives, a block's training
        forward; the module keeps nothing)."""
        if balance_alpha > 0 and losses is None:
            raise ValueError("balance_alpha > 0 needs a losses dict to put the balance loss into")
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, dim]
        weights, indices, scores = self.gate(flat, token_ids.reshape(-1))
        indices = record(f"{self.stage}.router_indices", indices)
        weights = record(f"{self.stage}.router_weights", weights)
        self.load = None  # (an inference step skips the count's three kernels: nothing reads it)
        if self.training or torch.is_grad_enabled():
            flat_idx = indices.flatten().detach()  # no host sync
            self.load = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
                0, flat_idx, torch.ones_like(flat_idx)
            )
        if balance_alpha > 0 and self.training:
            losses["balance"] = self._balance_loss(scores, indices, shape[0], balance_alpha)
        y = record(f"{self.stage}.routed", self.experts(flat, weights, indices))  # fp32 [T, dim]
        if self.shared_experts is not None:
            shared = record(f"{self.stage}.shared", self.shared_experts(flat))
            if y.dtype == torch.float32 and not torch.is_grad_enabled() and not recording_active():
                # (y + shared.float()).to(x.dtype) in one kernel: the fp32 sum rounded once, into the shared
                # expert's own output (nothing else reads it; each element reads and writes its own place)
                return torch.add(y, shared, out=shared).view(shape)
            y = y + shared.float()
        return record(f"{self.stage}.out", y.to(x.dtype).view(shape))

    def _balance_loss(self, scores: torch.Tensor, indices: torch.Tensor, b: int, alpha: float) -> torch.Tensor:
        """Sequence-wise balance loss: alpha * sum_i f_i * P_i per sequence, averaged over sequences.

        f_i = E/(k*s) * (tokens of the sequence routed to i); P_i = mean over the sequence of the
        normalized scores s_i / sum_j s_j.
        """
        e, k = self.n_experts, self.topk
        t = scores.size(0) // b
        probs = (scores / scores.sum(-1, keepdim=True)).view(b, t, e)
        counts = F.one_hot(indices.view(b, t * k), e).sum(1).float()  # [b, E]
        f = counts * e / (k * t)
        return alpha * (f * probs.mean(1)).sum(-1).mean()
