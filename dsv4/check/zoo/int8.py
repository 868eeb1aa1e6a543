"""Conformance checks of the INT8 W8A8 path (`quant_mode="int8"`, `dsv4.model.int8`): the scales are
per weight row and per token, as the recipe says (docs/bugzoo.md Z26, Z27).

Both run on the context's device with each op's default backend there (`torch._int_mm` on a CPU, Triton on
a GPU), so they exercise the fast paths as well as the module code around them.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from torch import nn

from ...config import ModelConfig
from ...model.int8 import Int8Experts, Int8Linear, quantize_int8
from ..inputs import moe_inputs
from ..result import CheckResult

# |dequantized - weight| <= half a step of the row's own scale, amax_row / 127: the rounding to nearest,
# plus fp32 rounding of the scale, of w / s and of q * s (a few 2^-24 relative, far below 2^-16)
HALF_STEP = 0.5 + 2.0**-16


class _Context(Protocol):  # what these checks read of `dsv4.check.zoo.Context`
    cfg: ModelConfig
    model: nn.Module
    seed: int
    device: torch.device

    @property
    def model_dtype(self) -> torch.dtype: ...


def _row_steps(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per row of w [..., N, K]: max |q * s - w| in units of the row's own step amax / 127."""
    wf = w.detach().float()
    step = wf.abs().amax(-1).clamp_min(1e-30) / 127
    return (q.float() * s.float().unsqueeze(-1) - wf).abs().amax(-1) / step


def int8_weight_rows(ctx: _Context) -> CheckResult:
    """Every weight INT8 mode requantizes in the check model, and a weight whose rows span six decades,
    is within half a step of its own row's scale (amax_row / 127) after quantization: one scale per output
    row. A scale shared by the whole tensor sends the small rows to a few codes, or to zero."""
    g = torch.Generator().manual_seed(ctx.seed)
    spread = torch.randn(64, ctx.cfg.dim, generator=g) * torch.logspace(-6, 0, 64).unsqueeze(1)
    lin = Int8Linear.from_weight(spread.to(ctx.device))
    pairs = [("spread rows", spread.to(ctx.device), lin.weight_q, lin.scale)]
    src = dict(ctx.model.named_modules())
    model = quantize_int8(copy.deepcopy(ctx.model))
    for path, m in model.named_modules():
        if isinstance(m, Int8Linear) and path in src:
            pairs.append((path, src[path].weight, m.weight_q, m.scale))
        elif isinstance(m, Int8Experts):
            pairs += [
                (f"{path}.{w}", getattr(src[path], w), getattr(m, f"{w}_q"), getattr(m, f"{w}_scale"))
                for w in ("w1", "w2", "w3")
            ]
    worst, where = 0.0, ""
    for name, w, q, s in pairs:
        if tuple(s.shape) != tuple(q.shape[:-1]):
            return CheckResult(False, None, f"{name}: scales {tuple(s.shape)} are not one per row of {tuple(q.shape)}")
        err = float(_row_steps(w, q, s).max())
        if err > worst:
            worst, where = err, name
    if worst > HALF_STEP:
        return CheckResult(
            False,
            worst,
            f"{where}: a row is off by {worst:.3g} steps of its own scale (at most "
            f"{HALF_STEP:.5f}): its scale is not its own",
        )
    return CheckResult(True, worst, f"{len(pairs)} weights: every row within {worst:.4f} of a step of its own scale")


def _bitwise_gap(alone: torch.Tensor, batch: torch.Tensor) -> float:
    """Largest |alone - batch| relative to the token's own max |alone| (0 when equal bit for bit)."""
    a, b = alone.double(), batch.double()
    return float(((a - b).abs().amax(-1) / a.abs().amax(-1).clamp_min(1e-30)).max())


@torch.no_grad()
def int8_per_token(ctx: _Context) -> CheckResult:
    """An INT8 linear and the INT8 routed experts give each token the same output bit for bit alone and in
    a batch with tokens of 10^-2 to 10^2 its size: activation scales are one per token and the INT32 sums
    are exact, so nothing depends on the batch. A scale taken over the whole batch quantizes the small
    tokens with the large ones' step."""
    cfg, dev, dtype = ctx.cfg, ctx.device, ctx.model_dtype
    mags = torch.logspace(-2, 2, 8)
    inp = moe_inputs(cfg, tokens=8, seed=ctx.seed, device=dev, dtype=dtype)
    x = inp["x"] * mags.to(dev, dtype).unsqueeze(1)  # [8, dim]
    lin = Int8Linear.from_weight(inp["w1"][0])
    experts = Int8Experts.from_weights(inp["w1"], inp["w2"], inp["w3"], cfg.swiglu_limit)
    w, idx = inp["weights"], inp["indices"]
    gaps = {
        "INT8 linear": _bitwise_gap(torch.cat([lin(x[i : i + 1]) for i in range(8)]), lin(x)),
        "INT8 experts": _bitwise_gap(
            torch.cat([experts(x[i : i + 1], w[i : i + 1], idx[i : i + 1]) for i in range(8)]), experts(x, w, idx)
        ),
    }
    what, gap = max(gaps.items(), key=lambda kv: kv[1])
    if gap > 0:
        return CheckResult(
            False,
            gap,
            f"{what}: a token's output changes with the batch it runs in "
            f"(relative {gap:.3g}): its activation scale is not its own",
        )
    return CheckResult(True, 0.0, "INT8 linear and experts: every token's output is the same alone and in a batch")


__all__ = ["int8_per_token", "int8_weight_rows"]
