"""Muon's elementwise passes (`muon_momentum`, `muon_apply`): the reference is torch.optim.Muon's arithmetic
written plainly; the Triton kernels (CPU interpreter here, compiled on CUDA) against it. A whole batched
Muon step through either backend: `tests/train/test_optim.py::test_plan_chunks_and_mixes_stacks_and_matrices`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import DEV, interpret_unless_cuda  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.ops.triton import optim as to  # noqa: E402, F401  (a missing kernel module is an error, not a skip)

U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff of fp32 and bf16


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(shape, generator=g) * torch.empty(shape).uniform_(0.01, 10, generator=g)
    grad = torch.randn(shape, generator=g) * torch.empty(shape).uniform_(0.01, 10, generator=g)
    return buf.to(dtype).to(DEV), grad.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum,nesterov", [(0.95, True), (0.95, False), (0.3, True)])
def test_momentum_matches_the_reference(dtype, momentum, nesterov):
    """The new momentum and the bf16 update, elementwise: both evaluate lerp by torch's formula in fp32; a
    fused multiply-add (torch's CPU and CUDA lerp make one) saves one rounding of a product of magnitude at
    most |buf| + |grad| (an fp32 unit of it, per lerp), and a value that lands on the other side of a
    rounding boundary of the stored dtype moves by one of its units (at most 2u of the value, bf16 u = 2^-8).
    The update is lerped from the new momentum with weight `momentum` (else it is the momentum), so it
    carries that weight times the momentum's difference, plus its own bf16 unit."""
    buf, grad = _inputs((3, 37, 41), dtype)  # 4551 elements: not a multiple of the kernel's block
    out = torch.full((5, 37, 41), float("nan"), dtype=torch.bfloat16, device=DEV)  # writes stay in out[1:4]
    want_buf = buf.clone()
    want = ops.muon_momentum(want_buf, grad, momentum, nesterov, backend="reference")
    got_buf = buf.clone()
    got = ops.muon_momentum(got_buf, grad, momentum, nesterov, out=out[1:4], backend="triton")
    assert ops.last_backend("muon_momentum") == "triton" and got.data_ptr() == out[1].data_ptr()
    assert out[0].isnan().all() and out[4].isnan().all() and not got.isnan().any()
    assert got.dtype == torch.bfloat16 and got.shape == buf.shape
    fma = (buf.float().abs() + grad.float().abs()) * 2 * U32
    unit = U16 if dtype == torch.bfloat16 else U32
    bound_buf = fma + 2 * unit * want_buf.float().abs()
    assert ((got_buf.float() - want_buf.float()).abs() <= bound_buf).all()
    carried = (momentum if nesterov else 1.0) * bound_buf
    bound = carried + fma + 2 * U16 * want.float().abs()
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_gives_the_reference_bits(dtype):
    """w * decay and ortho * scale each rounded to w's dtype, then added: the same three roundings in both
    (the kernel contracts nothing), so the same bits; decay and scale are read from the device."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2, 33, 65, generator=g) * 3).to(dtype).to(DEV)
    ortho = torch.randn(2, 33, 65, generator=g).bfloat16().to(DEV)
    decay, scale = torch.tensor(1 - 0.02 * 0.1).to(DEV), torch.tensor(-0.02 * 0.2 * 8).to(DEV)
    want = ops.muon_apply(w.clone(), ortho, decay, scale, backend="reference")
    got = w.clone()
    assert ops.muon_apply(got, ortho, decay, scale, backend="triton") is got
    assert ops.last_backend("muon_apply") == "triton"
    assert torch.equal(got, want)


def test_refusals_name_the_reason():
    buf, grad = _inputs((4, 6), torch.float32)
    with pytest.raises(ops.BackendUnavailable, match="non-contiguous"):
        ops.muon_momentum(buf.T, grad.T, 0.95, True, backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="one shape"):
        ops.muon_momentum(buf, grad.half(), 0.95, True, backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="one-element fp32"):
        ops.muon_apply(buf, grad.bfloat16(), torch.ones(2, device=DEV), torch.ones((), device=DEV), backend="triton")
