"""Plain-torch references of the dense projections: in the activations' dtype, in fp32, and from bf16
products into fp32.

Part of `dsv4.ops.reference` (which re-exports every name here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .precision import acc_dtype


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in x's dtype (accumulated in float64 under exact accumulation)."""
    if acc_dtype() == torch.float64:
        return F.linear(x.double(), w.double()).to(x.dtype)
    return F.linear(x, w)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` in fp32 (router, compressor and head projections, kept in fp32 by the spec).

    x [..., K] any float dtype, weight [N, K] fp32 -> [..., N] fp32 (accumulated in float64 under exact
    accumulation). Differentiable in both.
    """
    acc = acc_dtype()
    return F.linear(x.to(acc), weight.to(acc)).float()


class _Bf16Products(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        acc = acc_dtype()
        xb, wb = x.bfloat16(), weight.bfloat16()
        ctx.save_for_backward(xb, wb)
        ctx.meta = (x.dtype, weight.dtype, acc)
        return F.linear(xb.to(acc), wb.to(acc)).float()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        xb, wb = ctx.saved_tensors
        x_dtype, w_dtype, acc = ctx.meta
        gb = g.bfloat16().to(acc)  # the output gradient's bf16 rounding: the one operand rounding of backward
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (gb @ wb.to(acc)).float().to(x_dtype)
        if ctx.needs_input_grad[1]:
            g2 = gb.reshape(-1, gb.size(-1))
            gw = (g2.t() @ xb.reshape(-1, xb.size(-1)).to(acc)).float().to(w_dtype)
        return gx, gw


def linear_bf16_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` from the bf16 roundings of both operands, their products summed in fp32 and returned in
    fp32: what a bf16 GEMM with an fp32 output computes on tensor cores (the vocabulary head of mixed-precision
    training under `head_precision="bf16"`: one product per term where `linear_fp32`'s exact split takes three
    forward and nine backward).

    x [..., K] any float dtype, weight [N, K] any float dtype -> [..., N] fp32 (float64 sums under exact
    accumulation). Backward: the output gradient rounded once to bf16, then the same bf16 products summed in
    fp32; the input gradient in x's dtype, the weight gradient in the weight's.
    """
    return _Bf16Products.apply(x, weight)
