"""`linear_bf16_fp32`: x @ W^T from the bf16 roundings of both operands, summed in fp32 (the vocabulary heads
under `head_precision="bf16"`), and its backward from the output gradient's bf16 rounding. Checked against
float64 sums of the same bf16 values, on the reference (CPU) and the "bf16_mm" backend (CUDA)."""

from __future__ import annotations

import pytest
import torch
from bounds import U, gamma, within

from dsv4 import ops
from dsv4.config import ModelConfig
from dsv4.model import DeepSeekV4
from dsv4.ops import reference


def _operands(m: int, k: int, n: int, device: str, structured: bool):
    gen = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    g = torch.randn(m, n, generator=gen)
    if structured:  # values that bf16 cannot hold, wide magnitudes, exact cancellations, zero rows
        x[0] = 1 + 2.0**-12
        w[: n // 2] *= 1e3
        x[1] = -x[2]
        g[3] = 0
    return x.to(device).bfloat16().requires_grad_(), w.to(device).requires_grad_(), g.to(device)


def _check(fn, m: int, k: int, n: int, device: str, structured: bool) -> None:
    x, w, g = _operands(m, k, n, device, structured)
    y = fn(x, w)
    y.backward(g)
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    xd, wd = x.detach().double(), w.detach().bfloat16().double()  # the bf16 operands, exactly
    gd = g.bfloat16().double()  # backward's one rounding
    # a K-term sum in fp32, in any order, is within gamma(K) * sum |term| of the exact sum; the fp32 result
    # itself is one more rounding
    want = xd @ wd.T
    ok, msg = within(y.detach(), want, gamma(k) * (xd.abs() @ wd.abs().T) + U[torch.float32] * want.abs())
    assert ok, "forward: " + msg
    want_gx = gd @ wd  # N-term sums, then rounded to bf16 (x's dtype)
    bound = gamma(n) * (gd.abs() @ wd.abs()) * (1 + U[torch.bfloat16]) + U[torch.bfloat16] * want_gx.abs()
    ok, msg = within(x.grad, want_gx, bound)
    assert ok, "input gradient: " + msg
    want_gw = gd.T @ xd  # M-term sums in fp32
    ok, msg = within(w.grad, want_gw, gamma(m) * (gd.abs().T @ xd.abs()) + U[torch.float32] * want_gw.abs())
    assert ok, "weight gradient: " + msg


@pytest.mark.parametrize("structured", [False, True])
def test_the_reference_sums_bf16_products_in_fp32(structured):
    _check(reference.linear_bf16_fp32, 24, 64, 80, "cpu", structured)


def test_the_reference_rounds_the_weight_and_the_gradient_to_bf16():
    """The definition is not fp32's: a weight entry between two bf16 values contributes its rounding, and so
    does the output gradient (a result that fp32 products would not give)."""
    x = torch.ones(1, 1, dtype=torch.bfloat16, requires_grad=True)
    w = torch.full((1, 1), 1 + 2.0**-10, requires_grad=True)  # bf16 rounds it to 1
    y = reference.linear_bf16_fp32(x, w)
    assert float(y.detach()) == 1.0
    y.backward(torch.full((1, 1), 1 + 2.0**-10))
    assert float(x.grad) == 1.0 and float(w.grad) == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("structured", [False, True])
@pytest.mark.parametrize("m,k,n", [(64, 384, 4096), (257, 2048, 1000)])
def test_the_bf16_mm_backend_matches_the_definition(m, k, n, structured):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with ops.which_ran() as ran:
        _check(ops.linear_bf16_fp32, m, k, n, "cuda", structured)
    assert ran["linear_bf16_fp32"] == ["bf16_mm"]


def test_the_bf16_mm_backend_refuses_the_cpu():
    x, w = torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(3, 4)
    assert "CUDA" in ops.refusal("linear_bf16_fp32", "bf16_mm", x, w)


def test_head_precision_bf16_changes_the_heads_under_autocast_only():
    """set_options(head_precision="bf16"): under bf16 autocast the logits (main head and MTP) are the bf16
    products of the normed hidden state and the head, fp32 sums; outside autocast (inference) the fp32 head
    is untouched, bit for bit."""
    torch.manual_seed(0)
    model = DeepSeekV4(ModelConfig.preset("tiny"), dtype=torch.float32).train()
    tokens = torch.randint(2, model.cfg.vocab_size, (2, 16))
    plain = model(tokens).logits
    model.set_options(head_precision="bf16")
    assert torch.equal(model(tokens).logits, plain)  # no autocast: unchanged
    with ops.which_ran() as ran, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, mtp=True)
    assert ran["linear_bf16_fp32"] == ["reference"]
    assert out.logits.dtype == torch.float32
    model.set_options(head_precision="fp32")
    with ops.which_ran() as ran, torch.autocast("cpu", dtype=torch.bfloat16):
        back = model(tokens, mtp=True)
    assert "linear_bf16_fp32" not in ran
    assert not torch.equal(back.logits, out.logits)  # the fp32 head's logits differ from the bf16 products'
    with pytest.raises(ValueError, match="head_precision must be one of"):
        model.set_options(head_precision="fp16")
