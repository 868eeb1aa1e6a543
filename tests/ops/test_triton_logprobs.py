"""`token_logprobs`: the reference by hand, the Triton kernel against it (the CPU interpreter here, compiled on
CUDA) on random and structured rows, its special values, a row's number independent of its batch, and the
refusals."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import DEV, interpret_unless_cuda  # noqa: E402

import dsv4.ops as ops  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()


def tolerance(want: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each sums V float64 exponentials (each within an ulp) in its own order: the sum's relative error is at
    most (V + 4) units of 2^-53 in each, an absolute error of its log, so 2 (V + 4) between them; the
    logsumexp's addition of the max and the final subtraction round at most twice more in each, relative
    to the larger operand."""
    V = x.size(1)
    big = x.double().abs().amax(1)
    return 2 * (V + 4) * 2.0**-53 + 4 * 2.0**-53 * (want.abs() + 2 * big)


def test_reference_by_hand():
    x = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    got = ops.token_logprobs(x, torch.tensor([1, 0]), backend="reference")
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor([math.log(0.75), math.log(0.5)], dtype=torch.float64), atol=1e-15)


@pytest.mark.parametrize("V", [1, 7, 1023, 1024, 1025, 4096, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference_within_float64_rounding(V, dtype):
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(6, V, generator=g) * 4).to(dtype)
    x[1] = x[1].round()  # ties of the max
    x[2] = 0.0  # a flat row
    x[3, : V // 2] = -1e4  # most of the row far below
    x[4] *= 30  # peaked
    tok = torch.randint(0, V, (6,), generator=g)
    tok[5] = int(x[5].float().argmax())
    x, tok = x.to(DEV), tok.to(DEV)
    want = ops.token_logprobs(x, tok, backend="reference")
    with ops.which_ran() as ran:
        got = ops.token_logprobs(x, tok)
    assert ran == {"token_logprobs": ["triton"]}
    assert got.dtype == torch.float64 and got.shape == (6,)
    assert ((got - want).abs() <= tolerance(want, x)).all(), (got - want).abs().max()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's numpy on log(0) and inf - inf)
def test_special_values_are_the_references():
    """A row of -inf: logsumexp -inf, the token's log p NaN; an infinite logit: not subtracted (torch's rule);
    a NaN anywhere in a row: NaN; a row of one finite logit among -inf: log p 0 there, -inf elsewhere."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor(
        [
            [-inf, -inf, -inf],
            [0.0, inf, 1.0],
            [0.0, inf, 1.0],
            [0.0, nan, 1.0],
            [-inf, 2.0, -inf],
            [-inf, 2.0, -inf],
        ]
    ).to(DEV)
    tok = torch.tensor([0, 1, 0, 2, 1, 0]).to(DEV)
    want = ops.token_logprobs(x, tok, backend="reference").cpu()
    got = ops.token_logprobs(x, tok, backend="triton").cpu()
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok]), (got, want)
    assert want[4].item() == 0.0 and want[5].item() == -inf


def test_a_rows_number_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 3000, generator=g).to(DEV)
    tok = torch.randint(0, 3000, (9,), generator=g).to(DEV)
    whole = ops.token_logprobs(x, tok, backend="triton")
    for rows in (slice(0, 1), slice(4, 9), slice(2, 3)):
        assert torch.equal(ops.token_logprobs(x[rows], tok[rows], backend="triton"), whole[rows])


def test_refusals_name_the_reason():
    x, tok = torch.randn(3, 10).to(DEV), torch.zeros(3, dtype=torch.long).to(DEV)
    assert "contiguous rows" in ops.refusal("token_logprobs", "triton", x.t(), tok)
    assert "tokens" in ops.refusal("token_logprobs", "triton", x, tok.int())
    assert "tokens" in ops.refusal("token_logprobs", "triton", x, tok[:2])
    assert "dtype" in ops.refusal("token_logprobs", "triton", x.int(), tok)
    assert ops.refusal("token_logprobs", "triton", x, tok) is None
