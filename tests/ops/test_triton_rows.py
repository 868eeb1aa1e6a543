"""`write_rows`, the paged cache's row writes: the reference by hand, the Triton kernel's bits against it
(the CPU interpreter here, compiled kernels on CUDA), and the refusals that send a call to the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import DEV, interpret_unless_cuda  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.ops.triton import rows as tr  # noqa: E402  (a missing kernel module is an error, not a skip)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_reference_writes_each_listed_row_by_hand():
    src = torch.arange(12.0).view(4, 3)
    dst = torch.zeros(6, 3)
    ops.write_rows((src,), torch.tensor([3, 0]), (dst,), torch.tensor([5, 1]), backend="reference")
    assert dst[5].tolist() == [9.0, 10.0, 11.0] and dst[1].tolist() == [0.0, 1.0, 2.0]
    assert dst[[0, 2, 3, 4]].abs().sum() == 0
    a, b = torch.zeros(3, 3), torch.zeros(3, 3)
    ops.write_rows((src[:2], src[2:]), None, (a, b), torch.tensor([2, 0]), backend="reference")
    assert a[2].tolist() == src[0].tolist() and a[0].tolist() == src[1].tolist()
    assert b[2].tolist() == src[2].tolist() and b[0].tolist() == src[3].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [3, 512, 1500])  # one block, one full block, a masked second block
@pytest.mark.parametrize("picked", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_triton_writes_the_references_bits(dtype, width, picked, index_dtype):
    g = torch.Generator().manual_seed(width)
    t, n = 9, 20
    srcs = tuple(torch.randn(t, width, generator=g).to(dtype) for _ in range(2))
    srcs[0][1, 0] = float("nan")  # payloads move as they are
    pool = torch.randn(n + 4, width, generator=g).to(dtype)
    dsts = (pool[4:], torch.randn(n, width, generator=g).to(dtype))  # the first at a row offset, as entries
    index = torch.tensor([7, 0, 19, 3, 11], dtype=index_dtype)  # distinct rows: the bits are defined
    pick = torch.tensor([8, 1, 1, 0, 5], dtype=index_dtype) if picked else None
    if not picked:
        srcs = tuple(s[:5] for s in srcs)
    want = [d.clone() for d in dsts]
    ops.write_rows(srcs, pick, tuple(want), index, backend="reference")
    srcs, dsts = tuple(s.to(DEV) for s in srcs), tuple(d.to(DEV) for d in dsts)
    head = pool[:4].clone()
    for pairs in (1, 2):  # the first pair alone, then both in one launch
        got = tuple(d.clone() for d in dsts)
        ops.write_rows(srcs[:pairs], None if pick is None else pick.to(DEV), got[:pairs], index.to(DEV))
        assert ops.last_backend("write_rows") == "triton"
        for i in range(pairs):
            assert torch.equal(_bits(got[i].cpu()), _bits(want[i]))
        if pairs == 1:
            assert torch.equal(got[1], dsts[1])  # the second destination untouched
    assert torch.equal(pool[:4], head)


def test_triton_nothing_to_write():
    src, dst = torch.ones(0, 8, device=DEV), torch.zeros(4, 8, device=DEV)
    ops.write_rows((src,), None, (dst,), torch.zeros(0, dtype=torch.long, device=DEV))
    assert ops.last_backend("write_rows") == "triton" and dst.abs().sum() == 0


def test_refusals_say_why():
    a, b = torch.zeros(4, 8, device=DEV), torch.zeros(6, 8, device=DEV)
    idx = torch.tensor([0, 1, 2, 3], device=DEV)
    cases = [
        ((a, a, a), None, (b, b, b), idx, "pairs"),
        ((a,), None, (b.half(),), idx, "one width and dtype"),
        ((a,), None, (torch.zeros(6, 9, device=DEV),), idx, "one width and dtype"),
        ((a,), None, (b.t(),), idx, "unit column stride"),
        ((a,), None, (b,), idx.float(), "int32 or int64"),
        ((a,), None, (b,), idx[:3], "one row per index entry"),
        ((a,), idx[:2], (b,), idx, "pick has 2 entries"),
    ]
    for srcs, pick, dsts, index, why in cases:
        reason = tr._can_run(srcs, pick, dsts, index)
        assert reason is not None and why in reason, (why, reason)
    assert tr._can_run((a,), None, (b,), idx) is None
    w = torch.zeros(4, 8, device=DEV, requires_grad=True)
    assert "autograd" in tr._can_run((w,), None, (b,), idx)
    with torch.no_grad():
        assert tr._can_run((w,), None, (b,), idx) is None
