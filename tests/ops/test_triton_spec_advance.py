"""`spec_advance`, what a fixed-shape speculative step derives from its acceptance: the reference by hand (the
tokens the MTP block catches up on, the rows its head reads, the next drafts' positions and draw indices), the
Triton kernel's integers against the reference's exactly (the CPU interpreter here, compiled on CUDA) with the
step's integers as the strided columns the engine hands over, and the refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import DEV, interpret_unless_cuda  # noqa: E402

import dsv4.ops as ops  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()


def test_reference_by_hand():
    """Two rows, w = 2: row 0 kept one draft, row 1 none."""
    accepted, bonus = torch.tensor([1, 0]), torch.tensor([40, 50])
    drafts, start, counters = torch.tensor([[41, 42], [51, 52]]), torch.tensor([10, 20]), torch.tensor([3, 7])
    nxt, out, positions, indices = ops.spec_advance(accepted, bonus, drafts, start, counters, backend="reference")
    # after position 10 comes draft 1 (41, kept); after 11 the bonus; past the last accepted, the bonus again
    assert nxt.tolist() == [[41, 40, 40], [50, 50, 50]]
    assert out.tolist() == [1, 3]  # rows of 3 tokens: row 0's position 1, row 1's position 0
    assert positions.tolist() == [[12, 21], [13, 22], [14, 23]]  # c + accepted + 1 + j
    assert indices.tolist() == [[5, 8], [6, 9]]  # counters + accepted + 1 + j
    assert ops.spec_advance(accepted, bonus, drafts, start, backend="reference")[3] is None


def step(B: int, w: int, seed: int) -> tuple:
    """A step's arguments as the engine's: start and counters strided columns of one integer table, drafts a
    strided slice of the verified tokens, accepted at every count from 0 to w."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 2**40, (B, w + 9), generator=g)
    tokens = ints[:, : w + 1]
    accepted = torch.arange(B) % (w + 1)
    bonus = torch.randint(0, 129_280, (B,), generator=g)
    args = (accepted, bonus, tokens[:, 1:], ints[:, w + 2], ints[:, w + 5])
    return tuple(t.to(DEV) for t in args)


@pytest.mark.parametrize("B,w", [(1, 1), (5, 2), (9, 3), (4, 8), (70, 2)])
def test_kernel_equals_the_reference(B, w):
    for seed in range(2):
        args = step(B, w, seed)
        for counters in (True, False):
            a = args if counters else args[:4]
            want = ops.spec_advance(*a, backend="reference")
            with ops.which_ran() as ran:
                got = ops.spec_advance(*a)
            assert ran == {"spec_advance": ["triton"]}
            for g, x in zip(got, want):
                if x is None:
                    assert g is None
                    continue
                assert g.shape == x.shape and g.dtype == torch.int64 and g.is_contiguous()
                assert torch.equal(g, x)


def test_no_rows():
    args = step(0, 2, 0)
    nxt, out, positions, indices = ops.spec_advance(*args, backend="triton")
    assert nxt.shape == (0, 3) and out.shape == (0,) and positions.shape == (3, 0) and indices.shape == (2, 0)


def test_refusals_name_the_reason():
    args = list(step(3, 2, 0))
    bad = args.copy()
    bad[0] = bad[0].int()
    assert "accepted" in ops.refusal("spec_advance", "triton", *bad)
    bad = args.copy()
    bad[3] = bad[3][:2]
    assert "start" in ops.refusal("spec_advance", "triton", *bad)
    bad = args.copy()
    bad[2] = bad[2][:, 0]
    assert "drafts" in ops.refusal("spec_advance", "triton", *bad)
