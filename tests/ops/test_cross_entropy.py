"""The training losses' cross entropy (`cross_entropy`, backend "triton") against its reference in float64.

Bounds, first order in u = 2^-24 (fp32), each exp / log within FUNC_ULPS ulp (libdevice on CUDA, numpy on the
interpreter): a lane's running sum of exp(x - max) over n steps (ceil(V / BV)) gains at most (2 + 2 F) u
relative a step (the rescale's product and exp, the new term's exp, the add); an argument x - max rounded
in fp32 moves its exp by |x - max| u relative, at most V u / e of the sum over all terms (|d| e^-d <= 1/e,
the sum >= 1); the lanes' combine adds gamma(BV) and one more product and exp. So the sum S is within
delta_S of its value, and lse = max + log S within delta_S + F u log V + u |lse|. A row's loss lse - x_t
adds u |loss|; the mean over N rows gamma(N) of the rows' magnitudes and the division u. The gradient
(exp(x - lse) - onehot) * g / count: p's relative error is lse's error plus u |x - lse| + F u; the
subtraction, the scale and its own division add u each.
"""

from __future__ import annotations

import math

import bounds
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import CUDA, DEV, interpret_unless_cuda, poison_allocator  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.precision import exact_accumulation  # noqa: E402
from dsv4.ops.triton import cross_entropy as ce_module  # noqa: E402

U, F = bounds.U32, bounds.FUNC_ULPS
IGNORE = -100


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    poison_allocator(monkeypatch, ce_module)
    ops.reset_calls()
    yield


def exact(x: torch.Tensor, t: torch.Tensor):
    """(loss, d loss / d x, lse per row) in float64 by the reference (exact accumulation)."""
    xd = x.detach().double().requires_grad_()
    with exact_accumulation(True):
        loss = ref.cross_entropy(xd, t, IGNORE)
    # (the reference rounds its float64 mean to fp32 at the end: take the float64 one)
    valid = t != IGNORE
    lse = torch.logsumexp(xd.detach(), dim=1)
    rows = torch.where(valid, lse - xd.detach().gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
    loss64 = rows.sum() / valid.sum()
    (g,) = torch.autograd.grad(loss, xd)
    return loss64, g, lse, rows


def check(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's loss and gradient within the module docstring's bounds of float64; returns them."""
    xl = x.clone().requires_grad_()
    loss = ops.cross_entropy(xl, t, IGNORE, backend="triton")
    assert ops.last_backend("cross_entropy") == "triton"
    (gx,) = torch.autograd.grad(loss, xl)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and gx.dtype == torch.float32
    want, gwant, lse, rows = exact(x, t)
    n, v = x.shape
    count = int((t != IGNORE).sum())
    bv = ce_module._blocks()[0]
    steps = math.ceil(v / bv)
    delta_s = (steps + 1) * (2 + 2 * F) * U + v * U / math.e + bounds.gamma(bv) + (1 + F) * U
    lse_err = delta_s + F * U * math.log(v) + U * lse.abs()  # [N]
    row_err = torch.where(t != IGNORE, lse_err + U * rows.abs(), 0.0)
    loss_bound = (row_err.sum() + bounds.gamma(max(n, 1)) * rows.abs().sum()) / count + U * want.abs()
    ok, msg = bounds.within(loss.detach(), want, loss_bound)
    assert ok, "loss: " + msg
    xd = x.double()
    p = torch.exp(xd - lse[:, None])
    scale = 1.0 / count
    p_rel = lse_err[:, None] + U * (xd - lse[:, None]).abs() + F * U
    onehot = torch.zeros_like(p).scatter_(1, t.clamp(min=0)[:, None], 1.0)
    g_bound = scale * (torch.where(p > 0, p * p_rel, 0.0) + U * (p - onehot).abs()) + 2 * U * gwant.abs()
    g_bound = torch.where((t != IGNORE)[:, None], g_bound, 0.0)
    ok, msg = bounds.within(gx, gwant, g_bound)
    assert ok, "gradient: " + msg
    return loss, gx


@pytest.mark.parametrize("n, v", [(1, 1), (5, 7), (17, 64), (23, 197), (9, 1000)])
def test_random_rows_match_the_reference(n, v):
    g = torch.Generator().manual_seed(n * 1000 + v)
    x = (torch.randn(n, v, generator=g) * 4).to(DEV)
    t = torch.randint(0, v, (n,), generator=g)
    if n > 1:  # every fourth row takes no part (none when there is one row)
        t[::4] = IGNORE
    check(x, t.to(DEV))


def test_structured_rows():
    """A row with -inf logits (a masked vocabulary) but a finite target; a row whose target is 10^4 above the
    rest (loss 0, exp underflows); a uniform row (loss log V); a row whose largest logit sits in the last
    block; logits shifted by 10^3 (lse far from 0)."""
    v = 150
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, v, generator=g)
    x[0, :] = float("-inf")
    x[0, [3, 77, 149]] = torch.tensor([1.0, 2.0, -1.0])
    x[1, 40] = 1e4
    x[2, :] = 0.5
    x[3, v - 1] = 30.0
    x[4] += 1e3
    t = torch.tensor([77, 40, 11, v - 1, 5, 0])
    loss, gx = check(x.to(DEV), t.to(DEV))
    assert torch.isfinite(loss) and torch.isfinite(gx).all()
    assert (gx[0, [i for i in range(v) if i not in (3, 77, 149)]] == 0).all()  # exp(-inf) = 0 exactly


def test_every_row_ignored_gives_nan_and_zero_gradients_like_the_reference():
    """(And a row of -inf logits: NaN as the reference's.)"""
    x = torch.randn(4, 10).to(DEV)
    x_inf = torch.full((2, 10), float("-inf"), device=DEV)
    t_inf = torch.tensor([3, IGNORE], device=DEV)
    assert ops.cross_entropy(x_inf, t_inf, IGNORE, backend="triton").isnan()
    assert ref.cross_entropy(x_inf, t_inf, IGNORE).isnan()
    t = torch.full((4,), IGNORE, device=DEV)
    xl = x.clone().requires_grad_()
    loss = ops.cross_entropy(xl, t, IGNORE, backend="triton")
    loss.backward()
    want = ref.cross_entropy(x.clone().requires_grad_(), t, IGNORE)
    assert loss.isnan() and want.isnan()
    assert torch.equal(xl.grad, torch.zeros_like(x))


def test_a_target_outside_the_vocabulary_gives_nan():
    """(The reference raises, or asserts on the device; the kernel cannot stop the host without a sync, so the
    row's loss is NaN and so is the mean: loud, not silently wrong.)"""
    x = torch.randn(3, 10).to(DEV)
    for bad in (10, -1):
        t = torch.tensor([1, bad, 2], device=DEV)
        assert ops.cross_entropy(x, t, IGNORE, backend="triton").isnan()


def test_rows_of_a_wider_tensor_and_bitwise_repeats():
    """Logits whose rows are strided (a slice of a wider buffer) give the contiguous copy's bits; repeats of a
    call are bit-identical (fixed orders, no atomics)."""
    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(11, 260, generator=g) * 3).to(DEV)
    t = torch.randint(0, 200, (11,), generator=g).to(DEV)
    runs = []
    for x in (wide[:, :200], wide[:, :200].contiguous(), wide[:, :200].contiguous()):
        xl = x.detach().requires_grad_()  # (the strided slice stays strided)
        assert xl.is_contiguous() == x.is_contiguous()
        loss = ops.cross_entropy(xl, t, IGNORE, backend="triton")
        runs.append((loss, torch.autograd.grad(loss, xl)[0]))
    for loss, gx in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and torch.equal(gx, runs[0][1])


def test_refusals():
    x = torch.randn(3, 10).to(DEV)
    t = torch.tensor([1, 2, 3], device=DEV)
    assert "fp32" in ops.refusal("cross_entropy", "triton", x.bfloat16(), t)
    assert "[N, V]" in ops.refusal("cross_entropy", "triton", x[None], t)
    assert "target" in ops.refusal("cross_entropy", "triton", x, t.float())
    assert "contiguous" in ops.refusal("cross_entropy", "triton", x.t(), torch.tensor([1] * 10, device=DEV))
    if not CUDA:
        assert ops.refusal("cross_entropy", "triton", x, t) is None


def test_the_training_losses_take_the_op():
    """next_token_loss and mtp_loss go through `ops.cross_entropy` (here its triton backend) on the shifted
    targets: the op called directly on the same rows gives the same bits."""
    from dsv4.train.losses import IGNORE as LOSS_IGNORE
    from dsv4.train.losses import mtp_loss, next_token_loss, shifted_targets

    assert LOSS_IGNORE == IGNORE
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 9, 50, generator=g).to(DEV)
    tokens = torch.randint(0, 50, (2, 9), generator=g).to(DEV)
    with ops.use_backend({"cross_entropy": "triton"}), ops.which_ran() as ran:
        lm = next_token_loss(logits, tokens)
        mtp = mtp_loss([logits[:, :-1]], tokens)
        lm0 = ops.cross_entropy(logits.reshape(-1, 50), shifted_targets(tokens, 1, 9).reshape(-1), IGNORE)
        mtp0 = ops.cross_entropy(logits[:, :-1].reshape(-1, 50), shifted_targets(tokens, 2, 8).reshape(-1), IGNORE)
    assert ran["cross_entropy"] == ["triton"]
    assert torch.equal(lm, lm0) and torch.equal(mtp, mtp0)
