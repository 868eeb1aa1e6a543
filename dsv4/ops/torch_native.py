"""Fast backends written with torch ops only (no Triton).

- `moe_experts` backend "grouped": tokens sorted by expert (the routing plan of `dsv4.ops.moe_shared`),
  then `torch._grouped_mm` runs every local expert in one call per projection (CUTLASS grouped GEMM on
  sm90+ GPUs, a C++ loop on CPU).
- `linear_fp32` backend "bf16x3": when x holds bf16 values (activations of a bf16 model or under bf16
  autocast), `x @ W^T` with an fp32 W equals `x @ (W_hi + W_mid + W_lo)^T` for the exact three-way bf16
  split of W; the three products are bf16 x bf16 (exact in fp32) and run as one tensor-core GEMM over
  the concatenated K axis with fp32 accumulation and output. Same products as the fp32 matmul, other
  summation order: agrees to fp32 rounding, at the bf16 GEMM rate instead of the fp32 SIMT rate.
  The backward splits the fp32 output gradient three ways as well and keeps the six products of the two
  splits that matter at fp32 precision (the other three are below 2^-24 relative), for the input's
  gradient as one GEMM over the six pairs laid side by side (smallest first) where the weight's output
  side is not much wider than its input side, else as six GEMMs whose fp32 outputs are added.
- `linear_bf16_fp32` backend "bf16_mm" (CUDA): the reference's bf16 products summed in fp32, as three
  cuBLAS GEMMs with fp32 output (forward, input gradient, weight gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import fp8_round_trip, register
from .moe_shared import act_round_trip, build_plan, clamped_swiglu, combine_rows, gate_dtype, gather_rows, mask_rows
from .precision import is_exact


# ----------------------------------------------------------------------------- grouped backend
def _grouped_can_run(x, weights, indices, w1, w2, w3, swiglu_limit, expert_offset=0, act=None) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if x.dim() != 2 or w1.dim() != 3:
        return "expects x [T, D] and stacked expert weights [E, I, D]"
    if x.dtype != w1.dtype or w1.dtype != w2.dtype or w1.dtype != w3.dtype:
        return f"x and expert weights must share a dtype (got {x.dtype}, {w1.dtype})"
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            return f"torch._grouped_mm on CUDA needs bf16, got {x.dtype}"
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return "torch._grouped_mm needs an sm90+ GPU"
    elif x.device.type != "cpu":
        return f"device {x.device.type} is not supported"
    align = 16 // x.element_size()
    if x.size(1) % align or w1.size(1) % align:
        return f"dim and inter dim must be multiples of {align} (16-byte strides)"
    return None


def grouped_moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int = 0,
    act: str | None = None,
) -> torch.Tensor:
    """`moe_experts` with one `torch._grouped_mm` per projection over all local experts."""
    plan = build_plan(weights, indices, w1.size(0), expert_offset)
    xs = gather_rows(act_round_trip(x, act, fp8_round_trip), plan)  # [M, D]
    wide = gate_dtype(x.dtype)  # fp16: gate and up in fp32 (fp16 operands are exact there)
    xg, w1g, w3g = (t.to(wide) for t in (xs, w1, w3))
    # rows past the last group are not computed: mask them before anything reads them (also in backward)
    gate = mask_rows(torch._grouped_mm(xg, w1g.transpose(1, 2), offs=plan.ends), plan)  # [M, I]
    up = mask_rows(torch._grouped_mm(xg, w3g.transpose(1, 2), offs=plan.ends), plan)  # [M, I]
    h = mask_rows(clamped_swiglu(gate, up, swiglu_limit) * plan.weight.unsqueeze(-1), plan).to(x.dtype)
    out = torch._grouped_mm(act_round_trip(h, act, fp8_round_trip), w2.transpose(1, 2), offs=plan.ends)  # [M, D]
    return combine_rows(out, plan)


# Explicit use only (priority below the reference): on CPU torch._grouped_mm is a slow fallback loop, and
# on CUDA the Triton backend is the default.
register("moe_experts", "grouped", grouped_moe_experts, can_run=_grouped_can_run, deterministic=True, priority=-1)


# ----------------------------------------------------------------------------- fp32 projections
# When bf16x3 is the default on CUDA (`prefers_split`), from `python3 scripts/bench_linear_fp32.py` on an H200
# (BENCHMARKS.md): at one row the fp32 GEMV is faster (it reads 4 bytes per weight, the split 6); from two
# rows the split's tensor-core GEMM is faster for weights up to 4096 x 4096 and more (cuBLAS's fp32 kernels
# for 2-32 rows took 2-11x longer there, 34-55 us at 8-16 rows of a 256 x 256 weight); a weight the size of
# a vocabulary head stays faster in fp32 up to 4 rows, where reading it is the whole cost.
BF16X3_MIN_ROWS = 8  # the split from this many rows whatever the weight
BF16X3_SMALL_ROWS = 2  # ... and from this many where the weight has at most BF16X3_SMALL_WEIGHT elements
BF16X3_SMALL_WEIGHT = 1 << 24


def prefers_split(rows: int, weight_elements: int) -> bool:
    """Whether `linear_fp32`'s default on CUDA is the bf16x3 split for a call of `rows` rows of x."""
    if rows >= BF16X3_MIN_ROWS:
        return True
    return rows >= BF16X3_SMALL_ROWS and weight_elements <= BF16X3_SMALL_WEIGHT


def bf16_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 -> (hi, mid, lo) bf16 with hi + mid + lo == t (exact for normal fp32 values)."""
    t = t.float()
    hi = t.to(torch.bfloat16)
    rest = t - hi  # exact in fp32 (hi widened inside the kernel: no fp32 copy of it)
    mid = rest.to(torch.bfloat16)
    lo = rest.sub_(mid).to(torch.bfloat16)  # (in place on rest, exact again)
    return hi, mid, lo


def split_bf16x3(w: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] -> bf16 [N, 3K] = [hi | mid | lo] with hi + mid + lo == w (exact for normal fp32 values)."""
    return torch.cat(bf16_parts(w), dim=1)


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 a @ bf16 b with fp32 accumulation and output (tensor cores on CUDA; the same products on CPU)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


# the input gradient's six part products run as one GEMM over their concatenation where N < this times K (the
# concatenation's traffic, 24 bytes per [M, N] element, against six GEMM outputs and five adds, some 84 per
# [M, K] element: 3.5 by that count, taken lower), else as six GEMMs and five adds
CONCAT_MAX_N_PER_K = 2

# the products of two three-way splits kept for fp32 accuracy: part i carries about 2^(-8 i) of the
# value, so (i, j) with i + j <= 2 (six of nine) leave out terms below 2^-24 relative; smallest first
_PAIRS = ((2, 0), (0, 2), (1, 1), (1, 0), (0, 1), (0, 0))


# fp32 matrices that stay as they are while a serving engine or a graphed decoder uses them (`keep_splits`):
# weight -> None, then ((version, storage address), its [N, 3K] split) from its first split
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def keep_splits(module: torch.nn.Module) -> int:
    """Mark the fp32 matrices of `module` as fixed while it serves, so that the bf16x3 projection splits each
    once instead of at every call (eight kernels over the weight per call; the head's weight is the size of
    the vocabulary). The split is made at a marked weight's first bf16x3 call with autograd off for it,
    outside a CUDA graph capture, and kept (1.5x the fp32 matrix in bf16 parts, 0.5x for a matrix of bf16
    values: `weight_split`); a graph captured after that replays the kept split. A CUDA matrix of bf16
    values has its one-part split made here, so that every call takes it, one row too (`_bf16x3_prefer`:
    it reads 2 bytes a weight against the fp32 GEMV's 4). A weight written in place (its version counter
    moves) or given other storage is split again at its next call outside a capture; a write that
    bypasses the version counter (`param.data.copy_`) is not seen, and neither is any change after a graph
    was captured: the weights of a serving engine are fixed. Weights made under `torch.inference_mode` have
    no version counter and are split at every call. -> the number of matrices newly marked."""
    n = 0
    for p in module.parameters():
        if p.dtype == torch.float32 and p.dim() == 2 and p not in _KEPT:
            _KEPT[p] = None
            if p.is_cuda and not p.is_inference() and not torch.cuda.is_current_stream_capturing():
                hi = _bf16_values(p.detach())
                if hi is not None:
                    _KEPT[p] = ((p._version, p.data_ptr()), hi)
            n += 1
    return n


def _bf16_values(w: torch.Tensor, rows: int = 8192) -> torch.Tensor | None:
    """w (fp32) as bf16 where every value of w is a bf16 value (checked a block of rows at a time), else None."""
    hi = w.to(torch.bfloat16)
    for i in range(0, w.size(0), rows):
        if not torch.equal(hi[i : i + rows].float(), w[i : i + rows]):
            return None
    return hi


def one_part_split(weight: torch.Tensor) -> bool:
    """Whether `weight`'s kept split, still valid, is its first part alone (a matrix of bf16 values)."""
    kept = _KEPT.get(weight)
    return (
        kept is not None
        and kept[1].size(1) == weight.size(1)
        and not weight.is_inference()
        and kept[0] == (weight._version, weight.data_ptr())
    )


def _reuse(weight: torch.Tensor, kept, store: Callable[[tuple], None], make: Callable[[torch.Tensor], object]):
    """The rule of a kept derivation of a marked weight: `kept` ((version, storage address), value) or None is
    reused while the key matches; otherwise make(weight) now, stored by `store` outside a capture (a
    capture's tensors are its pool's). Unmarked, autograd-tracked and inference weights: made every call."""
    if weight not in _KEPT or (torch.is_grad_enabled() and weight.requires_grad) or weight.is_inference():
        return make(weight.detach())  # (an inference tensor has no version counter to check)
    key = (weight._version, weight.data_ptr())
    if kept is not None and kept[0] == key:
        return kept[1]
    value = make(weight.detach())
    if not (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        store((key, value))
    return value


# fp32 matrices a trainer keeps split for its optimizer step (`keep_step_split`): weight -> [split, version]
_STEP: WeakIdKeyDictionary = WeakIdKeyDictionary()


def keep_step_split(weight: torch.Tensor) -> None:
    """Keep `weight`'s [N, 3K] bf16 split for a training step (`dsv4.train.casts.StepCasts`): its bf16x3
    calls, forward and backward, read the kept split instead of splitting the weight at each call (the
    vocabulary head: a pass over the weight per call, forward and backward, at every micro-batch). Made now;
    `refresh_step_split` makes it again in place (a CUDA graph of the optimizer step replays that), and,
    outside a capture, a call that finds the weight's version counter moved since makes it again first."""
    _STEP[weight] = [split_bf16x3(weight.detach()), weight._version]


def drop_step_split(weight: torch.Tensor) -> None:
    _STEP.pop(weight, None)


@torch.no_grad()
def refresh_step_split(weight: torch.Tensor) -> None:
    entry = _STEP[weight]
    torch.cat(bf16_parts(weight.detach()), dim=1, out=entry[0])
    entry[1] = weight._version


def step_copy_stale(weight: torch.Tensor, version: int) -> bool:
    """Whether a copy of `weight` kept for a training step (made at `version`) must be made again before a
    use: the weight changed since, and this is not a CUDA graph capture (there the update's refresh, which
    the graph replays, keeps it current)."""
    return version != weight._version and not (weight.is_cuda and torch.cuda.is_current_stream_capturing())


def _step_split(weight: torch.Tensor) -> torch.Tensor | None:
    entry = _STEP.get(weight)
    if entry is None:
        return None
    if step_copy_stale(weight, entry[1]):
        refresh_step_split(weight)
    return entry[0]


def weight_split(weight: torch.Tensor) -> torch.Tensor:
    """The [N, 3K] bf16 split of an fp32 weight: the kept one where `keep_splits` marked the weight, autograd
    is off for it and it is unchanged since; else made now (and kept, for a marked weight outside a capture).
    A kept split whose two smaller parts are all zero (a weight that holds bf16 values, as a checkpoint's
    BF16 head loaded into fp32) is kept as its [N, K] first part alone: the same products, a third of the
    work and of the bytes read."""

    def keep(kv: tuple) -> None:
        key, split = kv
        k = weight.size(1)
        _KEPT[weight] = (key, split[:, :k].contiguous() if not split[:, k:].any() else split)

    step = _step_split(weight)
    if step is not None:
        return step
    # (split_bf16x3 looked up at the call: the tests count splits by replacing it)
    return _reuse(weight, _KEPT.get(weight), keep, lambda w: split_bf16x3(w))


# other derivations of marked weights that kernels multiply (the mHC mix weight's bf16 parts):
# weight -> {name: ((version, storage address), value)}
_DERIVED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def kept_derived(weight: torch.Tensor, name: str, make: Callable[[torch.Tensor], object]):
    """make(weight) kept under `name` for a weight `keep_splits` marked, by `weight_split`'s rule: reused while
    the weight is unchanged and autograd does not track it, made again after an in-place write or new
    storage, never kept from inside a CUDA graph capture; an unmarked weight's is made at every call."""
    slot = _DERIVED.setdefault(weight, {}) if weight in _KEPT else {}
    return _reuse(weight, slot.get(name), lambda kv: slot.__setitem__(name, kv), make)


class _Bf16x3Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        """w3: `weight_split(weight)`, taken before autograd's forward (which runs with autograd off)."""
        k, n = x.size(-1), weight.size(0)
        x2 = x.reshape(-1, k)  # [M, K] bf16
        if w3.size(1) == k:  # a kept split of a weight that holds bf16 values: its first part is the weight
            y = _mm_fp32_out(x2, w3.t())
        else:
            x3 = torch.cat([x2, x2, x2], dim=1)  # [M, 3K]
            y = _mm_fp32_out(x3, w3.t())  # one GEMM over the concatenated K
        kept = _STEP.get(weight)
        # a split kept for the step is the backward's too (a per-call one is not kept alive for it)
        ctx.save_for_backward(x, weight, *([w3] if kept is not None and kept[0] is w3 else []))
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        """fp32 gradients from bf16 products: g [M, N] (fp32, not bf16-exact) is split three ways too."""
        x, weight, *w3 = ctx.saved_tensors
        gs = bf16_parts(g.reshape(-1, weight.size(0)))  # 3 x [M, N]
        gx = gw = None
        if ctx.needs_input_grad[0]:
            n, k = weight.shape
            ws = (w3[0][:, :k], w3[0][:, k : 2 * k], w3[0][:, 2 * k :]) if w3 else bf16_parts(weight.detach())
            if n < CONCAT_MAX_N_PER_K * k:
                # the six products as one GEMM over the pairs' concatenated N axis, smallest first (a
                # compressor's or the router's N against a dim of 384; CONCAT_MAX_N_PER_K says why)
                g6 = torch.cat([gs[i] for i, _ in _PAIRS], dim=1)  # [M, 6N]
                w6 = torch.cat([ws[j] for _, j in _PAIRS], dim=0)  # [6N, K]
                acc = _mm_fp32_out(g6, w6)
            else:  # wide N (a vocabulary head): six GEMMs, their fp32 outputs added smallest first
                acc = None
                for i, j in _PAIRS:
                    term = _mm_fp32_out(gs[i], ws[j])
                    acc = term if acc is None else acc + term
            gx = acc.view(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            xb = x.reshape(-1, x.size(-1))  # bf16: exact, one part
            acc = None
            for i in (2, 1, 0):
                term = _mm_fp32_out(gs[i].t(), xb)
                acc = term if acc is None else acc + term
            gw = acc.to(weight.dtype)
        return gx, gw, None


def bf16x3_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _Bf16x3Linear.apply(x, weight, weight_split(weight))


def _bf16x3_can_run(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}: the split is exact only for bf16 activations"
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return f"weight must be a 2-D fp32 matrix, got {weight.dtype} {tuple(weight.shape)}"
    if x.device != weight.device:
        return f"x on {x.device}, weight on {weight.device}"
    if is_exact():
        return "exact_accumulation() asks for float64 sums"
    return None


def _bf16x3_prefer(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """On CUDA: from the row counts of `prefers_split`, and at any rows for a kept one-part split (a BF16
    head in fp32: 355 us a call at one row against the fp32 GEMV's 679 on an H100, BENCHMARKS.md)."""
    return x.is_cuda and (prefers_split(x.numel() // x.size(-1), weight.numel()) or one_part_split(weight))


register(
    "linear_fp32",
    "bf16x3",
    bf16x3_linear,
    can_run=_bf16x3_can_run,
    deterministic=True,
    priority=5,
    prefer=_bf16x3_prefer,
)


# ----------------------------------------------------------------------------- bf16 products into fp32
class _Bf16MmLinear(torch.autograd.Function):
    """`linear_bf16_fp32` as three cuBLAS GEMMs (forward, input and weight gradients), each on bf16 operands
    with fp32 accumulation and output (`torch.mm(..., out_dtype=torch.float32)`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.size(-1)).bfloat16()  # [M, K]
        wb = weight.bfloat16()  # [N, K]
        ctx.save_for_backward(x2, wb)
        ctx.meta = (x.shape, x.dtype, weight.dtype)
        return _mm_fp32_out(x2, wb.t()).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x2, wb = ctx.saved_tensors
        shape, x_dtype, w_dtype = ctx.meta
        gb = g.reshape(-1, wb.size(0)).bfloat16()  # [M, N]: the one rounding of backward
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _mm_fp32_out(gb, wb).to(x_dtype).view(shape)
        if ctx.needs_input_grad[1]:
            gw = _mm_fp32_out(gb.t(), x2).to(w_dtype)
        return gx, gw


def bf16_mm_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _Bf16MmLinear.apply(x, weight)


def _bf16_mm_can_run(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if not x.is_cuda:
        return (
            "CUDA only: bf16 GEMMs with fp32 output on tensor cores (elsewhere the reference's are the same products)"
        )
    if weight.dim() != 2 or x.device != weight.device:
        return f"needs a 2-D weight on x's device, got {tuple(weight.shape)} on {weight.device}"
    if is_exact():
        return "exact_accumulation() asks for float64 sums"
    return None


register("linear_bf16_fp32", "bf16_mm", bf16_mm_linear, can_run=_bf16_mm_can_run, deterministic=True, priority=5)
