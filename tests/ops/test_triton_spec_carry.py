"""`write_carry`, the fixed-shape speculative step's carry: the reference by hand on the rule (how many drafts
a row keeps), the Triton kernel's rows against the reference's exactly (the CPU interpreter here, compiled
on CUDA), with the step's integers as the strided columns the engine hands over, and the refusals."""

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


def step(B: int, w: int, R: int, last: int, seed: int = 0) -> tuple:
    """A step's arguments: B rows on distinct table rows of a carry of R rows (other rows hold noise that must
    stay), starts spread around `last` so that rows keep w, fewer or no drafts, generated counts near their
    caps; ints as one [B, w + 4 + 3] table whose columns are views (cap the last one), as the engine's."""
    g = torch.Generator().manual_seed(seed)
    carry = torch.randint(-9, 9, (R, w + 4), generator=g)
    trows = torch.randperm(R, generator=g)[:B]
    tokens = torch.randint(0, 4096, (B, w + 1), generator=g)
    start = torch.randint(max(0, last - 2 * w - 3), last + 1, (B,), generator=g)
    accepted = torch.randint(0, w + 1, (B,), generator=g)
    generated = torch.randint(0, 50, (B,), generator=g)
    cap = generated + torch.randint(0, 2 * w + 3, (B,), generator=g)
    n_drafts = torch.randint(0, w + 1, (B,), generator=g)
    ints = torch.cat(
        [tokens, n_drafts[:, None], start[:, None], trows[:, None], generated[:, None] * 0, cap[:, None]], 1
    )
    bonus = torch.randint(0, 4096, (B,), generator=g)
    drafts = torch.randint(0, 4096, (B, w), generator=g)
    args = (carry, ints, generated, ints[:, -1], accepted, bonus, drafts, last)
    return tuple(t.to(DEV) if isinstance(t, torch.Tensor) else t for t in args)


def test_reference_keeps_the_drafts_the_host_would():
    """n = min(w, last - start, cap - generated) drafts at least 0, start and generated moved by accepted + 1,
    tokens past n zeroed, the row written at its table row and nowhere else."""
    carry = torch.full((4, 6), 7)
    ints = torch.tensor([[1, 2, 3, 0, 10, 2, 0], [4, 5, 6, 0, 20, 0, 0]])  # w = 2: tokens, n, start, trow, ...
    generated, cap = torch.tensor([5, 0]), torch.tensor([100, 3])
    accepted, bonus, drafts = torch.tensor([1, 2]), torch.tensor([40, 50]), torch.tensor([[41, 42], [51, 52]])
    ops.write_carry(carry, ints, generated, cap, accepted, bonus, drafts, 13, backend="reference")
    # row 0: start 12, generated 7, n = min(2, 13 - 12, 100 - 7) = 1; row 1: start 23 > 13: n = 0
    assert carry[2].tolist() == [40, 41, 0, 1, 12, 7]
    assert carry[0].tolist() == [50, 0, 0, 0, 23, 3]
    assert carry[1].tolist() == [7] * 6 and carry[3].tolist() == [7] * 6


@pytest.mark.parametrize("B,w", [(1, 1), (5, 2), (9, 3), (4, 8)])
def test_kernel_rows_equal_the_references(B, w):
    for seed in range(3):
        args = step(B, w, R=B + 7, last=40 + seed * 7, seed=seed * 100 + B * 10 + w)
        want = args[0].clone()
        ops.write_carry(want, *args[1:], backend="reference")
        got = args[0].clone()
        with ops.which_ran() as ran:
            ops.write_carry(got, *args[1:])
        assert ran == {"write_carry": ["triton"]}
        assert torch.equal(got, want)


def test_refusals_name_the_reason():
    args = list(step(3, 2, R=8, last=30))
    bad = args.copy()
    bad[0] = bad[0][:, :5]
    assert "carry" in ops.refusal("write_carry", "triton", *bad)
    bad = args.copy()
    bad[4] = bad[4].int()
    assert "accepted" in ops.refusal("write_carry", "triton", *bad)
    bad = args.copy()
    bad[7] = 2**40
    assert "int32" in ops.refusal("write_carry", "triton", *bad)
    assert ops.refusal("write_carry", "triton", *args) is None
