"""The fixed-plan GEMM (`ops.linear` and `ops.linear_fp32`, backend "triton"): deterministic mode's
dense projections on a GPU.

Two properties: each output is the float64 product of the operands within fp32 accumulation error
(2K * 2^-24 of the sum of |x_k w_k|, one ulp per addition) plus the final rounding to the output dtype;
and a row's output has the same bits whatever rows share its call, and wherever it sits in its tile. On a
machine without CUDA the kernel runs on the Triton CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import CUDA, DEV, interpret_unless_cuda, poison_allocator  # noqa: E402

import dsv4.ops as ops  # noqa: E402
import dsv4.ops.triton.fixed_gemm as fg  # noqa: E402  (a missing kernel module is an error, not a skip)
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.precision import exact_accumulation  # noqa: E402
from dsv4.ops.triton._common import interpreter_defect  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not CUDA and interpreter_defect():
        pytest.skip(interpreter_defect())
    interpret_unless_cuda(monkeypatch)
    poison_allocator(monkeypatch, fg)  # every output element must be written
    ops.reset_calls()


def within_accumulation_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - x @ w^T (float64)| <= 2K 2^-24 sum|x_k w_k| (K fp32 additions, each off by at most one ulp of
    the running sum: tensor cores may truncate) + half an ulp of the output dtype at the largest value the
    fp32 sum can take (the final rounding)."""
    k = x.size(-1)
    xd, wd = x.double().cpu(), w.double().cpu()
    exact = xd @ wd.T
    acc_err = 2 * k * 2.0**-24 * (xd.abs() @ wd.abs().T)
    mant = {torch.bfloat16: 8, torch.float16: 11}[y.dtype]  # significand bits
    top = exact.abs() + acc_err
    half_ulp = torch.exp2(torch.floor(torch.log2(top.clamp_min(torch.finfo(y.dtype).tiny))) - mant)
    err = (y.double().cpu() - exact).abs()
    bad = err > acc_err + half_ulp
    assert not bad.any(), f"{int(bad.sum())} outputs off, worst {float((err - acc_err - half_ulp).max()):.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (37, 200, 96), (130, 128, 70), (3, 1, 5)])
def test_outputs_are_the_float64_product_within_fp32_accumulation(dtype, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEV)
    y = ops.linear(x, w, backend="triton")
    assert y.shape == (m, n) and y.dtype == dtype
    within_accumulation_error(y, x, w)
    # structured rows: zeros, huge and tiny magnitudes, cancelling terms; x with leading dims
    s = torch.zeros(2, 3, k, dtype=torch.float32)
    s[0, 1] = 2.0**10
    s[0, 2] = 2.0**-10
    s[1, 0, ::2], s[1, 0, 1::2] = 1.0, -1.0
    s[1, 1] = torch.arange(k) % 7 - 3.0
    s = s.to(dtype).to(DEV)
    ys = ops.linear(s, w, backend="triton")
    assert ys.shape == (2, 3, n)
    assert torch.equal(ys[0, 0], torch.zeros_like(ys[0, 0]))
    within_accumulation_error(ys.reshape(-1, n), s.reshape(-1, k), w)


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (37, 200, 96), (130, 128, 70)])
def test_fp32_weights_split_three_ways_keep_fp32_accuracy(m, k, n):
    """`linear_fp32`: bf16 x times fp32 w as w's three bf16 parts (each product exact in fp32): within the
    error bound of 3K fp32 additions of at most one ulp each (6K * 2^-24 of the sum of |x_k w_k|, plus the
    fp32 output's half ulp), which a bf16 weight's products exceed; fp32 out."""
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV)  # fp32: most values need all three parts
    y = ops.linear_fp32(x, w, backend="triton")
    assert y.dtype == torch.float32 and y.shape == (m, n)
    xd, wd = x.double().cpu(), w.double().cpu()
    exact = xd @ wd.T
    bound = 6 * k * 2.0**-24 * (xd.abs() @ wd.abs().T) + 2.0**-24 * exact.abs()
    assert ((y.double().cpu() - exact).abs() <= bound).all()
    hi_only = (xd @ wd.bfloat16().double().T - exact).abs()  # the bound rejects a bf16 weight's products
    assert (hi_only > bound).float().mean() > 0.5
    # one-hot rows pick weight columns: one exact product each, so the three parts must give w's bits
    cols = torch.arange(min(m, k)) * 7 % k
    onehot = torch.zeros(len(cols), k).index_put_((torch.arange(len(cols)), cols), torch.tensor(1.0))
    picked = ops.linear_fp32(onehot.bfloat16().to(DEV), w, backend="triton")
    assert torch.equal(picked.cpu(), w.T[cols].cpu())


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """The same rows alone, in calls of other sizes and at other places in their tiles: same bits. Two
    rows make the order of the K sum visible in the output: +-2^24 products 32 columns apart with small
    ones between, which an fp32 sum keeps or loses depending on where its partial sums start."""
    gen = torch.Generator().manual_seed(3)
    k, n = 160, 80
    w = torch.randn(n, k, generator=gen)
    w[:, 0] = w[:, 32] = 2.0**12
    w[:, 1:32] = 0.25 * (torch.arange(n) % 4 + 1).unsqueeze(1)
    w = w.bfloat16().to(DEV)
    rows = torch.randn(4, k, generator=gen)
    for r in (2, 3):
        rows[r, 0], rows[r, 32], rows[r, 1:32] = 2.0**12, -(2.0**12), 1.0 + r
    rows = rows.bfloat16().to(DEV)
    alone = [ops.linear(r[None], w, backend="triton")[0] for r in rows]
    for m, at in ((5, [0, 1, 2, 4]), (70, [0, 63, 64, 69]), (150, [17, 100, 128, 149])):
        batch = (torch.randn(m, k, generator=gen) * 100).bfloat16().to(DEV)
        batch[at] = rows
        got = ops.linear(batch, w, backend="triton")
        for i, j in enumerate(at):
            assert torch.equal(got[j], alone[i]), (m, j)
    wf = w.float().cpu().to(DEV) * (1 + 2.0**-12)  # fp32 weights that need their lower parts
    alone = [ops.linear_fp32(r[None], wf, backend="triton")[0] for r in rows]
    batch = torch.randn(150, k, generator=gen).bfloat16().to(DEV)
    batch[[3, 64, 100, 149]] = rows
    got = ops.linear_fp32(batch, wf, backend="triton")
    assert all(torch.equal(got[j], alone[i]) for i, j in enumerate([3, 64, 100, 149]))


def test_split_k_sums_follow_the_weight_not_the_rows():
    """A narrow weight with a long K is split (`k_splits`: from N and K alone): the splits' fp32 partial sums
    added in split order stay within the accumulation bound, a row has the same bits alone and in calls of
    other sizes (the split rows of +-2^24 products make another order visible), and the fp32 weights' path
    splits the same way."""
    assert fg.k_splits(40, 200) == (1, 256)  # short K: one split, the plain plan
    splits, per = fg.k_splits(40, 1000)
    assert splits == 3 and per % fg.BLOCK_K == 0 and (splits - 1) * per < 1000 <= splits * per
    assert fg.k_splits(8192, 1024)[0] == 1  # wide weights fill the GPU with column tiles alone
    gen = torch.Generator().manual_seed(11)
    k, n = 1000, 40
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    w[:, 0], w[:, per] = 2.0**8, 2.0**8  # one large product at the start of each of the first two splits
    w = w.to(DEV)
    rows = torch.randn(3, k, generator=gen)
    rows[1, 0], rows[1, per] = 2.0**16, -(2.0**16)
    rows = rows.bfloat16().to(DEV)
    alone = [ops.linear(r[None], w, backend="triton")[0] for r in rows]
    for m, at in ((4, [0, 2, 3]), (70, [1, 64, 69])):
        batch = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
        batch[at] = rows
        got = ops.linear(batch, w, backend="triton")
        within_accumulation_error(got, batch, w)
        assert all(torch.equal(got[j], alone[i]) for i, j in enumerate(at)), m
    wf = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV)  # fp32: three parts per split
    x = torch.randn(70, k, generator=gen).bfloat16().to(DEV)
    y = ops.linear_fp32(x, wf, backend="triton")
    xd, wd = x.double().cpu(), wf.double().cpu()
    exact = xd @ wd.T
    bound = 6 * k * 2.0**-24 * (xd.abs() @ wd.abs().T) + 2.0**-24 * exact.abs()
    assert ((y.double().cpu() - exact).abs() <= bound).all()
    assert torch.equal(ops.linear_fp32(x[5:6], wf, backend="triton")[0], y[5])


def test_the_default_under_exact_accumulation_only():
    """Deterministic mode (exact accumulation) picks the fixed plan; otherwise torch's GEMM stays the default;
    a model's `Linear` and fp32 projections dispatch through the ops; where the fixed plan cannot run (fp32
    activations) the fp32 projection is the reference's float64 product."""
    from dsv4.model.layers import Linear, linear_fp32

    x = torch.randn(4, 32).bfloat16().to(DEV)
    w = torch.randn(16, 32).bfloat16().to(DEV)
    assert ops.resolve("linear", None, x, w).name == "reference"
    with exact_accumulation(True):
        assert ops.resolve("linear", None, x, w).name == "triton"
        assert ops.resolve("linear", None, x.float(), w.float()).name == "reference"  # fp32: float64 stays
        lin = Linear(32, 16, dtype=torch.bfloat16).to(DEV)
        with torch.no_grad(), ops.which_ran() as ran:
            y = lin(x)
        assert ran == {"linear": ["triton"]}
        want = ref.linear(x, lin.weight)  # float64, rounded once
        within_accumulation_error(y, x, lin.weight.detach())
        assert (y.float() - want.float()).abs().max() <= 2.0**-7 * want.float().abs().max()
        wf = torch.randn(16, 32).to(DEV)
        with ops.which_ran() as ran:
            linear_fp32(x, wf)
            y64 = linear_fp32(x.float(), wf)
        assert ran == {"linear_fp32": ["reference", "triton"]}
        exact = x.double() @ wf.double().T  # float64 sums (2K * 2^-53 at most), rounded once to fp32
        bound = 2.0**-24 * exact.abs() + 64 * 2.0**-53 * (x.double().abs() @ wf.double().abs().T)
        assert ((y64.double() - exact).abs() <= bound).all()
    assert ops.resolve("linear_fp32", None, x, wf).name != "triton"


def test_refusals(monkeypatch):
    x = torch.randn(4, 32).bfloat16().to(DEV)
    w = torch.randn(16, 32).bfloat16().to(DEV)
    with pytest.raises(ops.BackendUnavailable, match="bf16 or fp16"):
        ops.linear(x, w.float(), backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="bf16 or fp16"):
        ops.linear(x.float(), w.float(), backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="shapes"):
        ops.linear(x, w[:, :31], backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="forward only"):
        ops.linear(x, w.clone().requires_grad_(), backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="needs bf16 x with fp32 w"):
        ops.linear_fp32(x.float(), w.float(), backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="needs bf16 x with fp32 w"):
        ops.linear_fp32(x.half(), w.float(), backend="triton")
    y = ops.linear_fp32(x, w, backend="triton")  # a half-precision weight: its products as they are
    assert y.dtype == torch.float32
    within_accumulation_error(y.bfloat16(), x, w)
    with exact_accumulation(True):  # the default then falls back to the differentiable reference
        assert ops.resolve("linear", None, x, w.clone().requires_grad_()).name == "reference"
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ops.BackendUnavailable, match="CUDA"):
            ops.linear(x, w, backend="triton")
