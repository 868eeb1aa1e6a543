"""The compiled hc_pre and hc_head backward on a CUDA GPU (training shapes: several token splits and column
tiles) against their formula in float64 and against the reference's autograd. Skipped without a CUDA GPU;
the CPU suite runs the same kernels on the Triton interpreter (tests/ops/test_triton_moe_mhc.py, whose
bounds these reuse)."""

from __future__ import annotations

import pytest
import torch

import dsv4.ops as ops
from dsv4.ops import reference as R

pytestmark = pytest.mark.gpu
pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
from test_triton_moe_mhc import _hc_inputs, check_head_backward, check_projection_kernel, rel  # noqa: E402

DEV = torch.device("cuda")


def test_hc_pre_projection_kernel_against_its_formula_in_float64():
    check_projection_kernel(DEV, t=3000, d=384)


def test_hc_pre_backward_matches_reference_at_a_training_shape():
    """4 x 512 tokens of dim 384 (the shipped-model recipe's width), the bounds of the CPU test
    (`test_hc_pre_projection_grads_over_several_token_splits`): g_x within 1e-2 in norm (the reference's
    autograd rounds the gradients of x's two uses to bf16 and adds them in bf16), g_fn, scale and base
    fp32 sums of the same products in another order."""
    inputs = [v.to(DEV) for v in _hc_inputs(seed=40, b=4, s=512, d=384)]
    g = torch.Generator(device=DEV).manual_seed(41)
    gs = [torch.randn(4, 512, 384, device=DEV, generator=g).bfloat16()]
    gs += [torch.randn(4, 512, 4, device=DEV, generator=g), torch.randn(4, 512, 4, 4, device=DEV, generator=g)]
    grads = []
    for fwd in (R.hc_pre, lambda *a: ops.hc_pre(*a, backend="triton")):
        leaves = [t.clone().requires_grad_() for t in inputs]
        grads.append(torch.autograd.grad(fwd(*leaves, 1e-6, 1e-6, 20), leaves, gs))
    (gx0, *rest0), (gx1, *rest1) = grads
    assert gx1.dtype == torch.bfloat16 and rel(gx1, gx0) < 1e-2, rel(gx1, gx0)
    for name, a, b in zip(["fn", "scale", "base"], rest1, rest0):
        assert rel(a, b) < 1e-4, (name, rel(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hc_head_backward_at_a_training_shape(dtype):
    """The head's backward compiled, 4 x 512 tokens of dim 384, with the CPU test's per-element bounds."""
    check_head_backward(DEV, dtype, b=4, s=512, d=384, seed=42)
