"""`write_carry` and `read_carry`, the fixed-shape speculative step's carry: the references by hand (how many
drafts a row keeps; what a fed row reads), the Triton kernels' results against the references' exactly (the
CPU interpreter here, compiled on CUDA), with the step's integers as the strided columns the engine hands
over, and the refusals."""

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


def read_step(B: int, w: int, R: int, P: int, sampled: bool, seed: int = 0) -> tuple:
    """A step's `read_carry` arguments: B rows on table rows of R (the last the padding row, which several rows
    may name), about half of them fed; ints with S = 4 sampling columns when sampled."""
    g = torch.Generator().manual_seed(seed)
    carry = torch.randint(-9, 10**6, (R, w + 4), generator=g)
    trows = torch.randint(0, R, (B,), generator=g)
    own = torch.randint(0, 10**6, (B, w + 3), generator=g)
    cols = [own, trows[:, None]]
    if sampled:
        temps = torch.rand(B, 1, generator=g, dtype=torch.float64).mul(2).view(torch.int64)
        cols.append(torch.cat([torch.randint(0, 2**40, (B, 2), generator=g), torch.randint(0, 2, (B, 1)), temps], 1))
    feed = [torch.randint(0, 2, (B, 1), generator=g), torch.randint(0, 500, (B, 2), generator=g)]
    ints = torch.cat(cols + feed, 1)
    tables_w = torch.randint(-1, 10**5, (R, P), generator=g)
    tables_c = torch.randint(-1, 10**5, (R, P), generator=g)
    return tuple(t.to(DEV) for t in (ints, carry, tables_w, tables_c)) + (R - 1,)


def test_read_reference_takes_a_fed_rows_integers_from_the_carry():
    """w = 1: tokens (2), n_drafts, start from carry[table row] where fed, else the row's own; the table row,
    cap, tables and state always the row's."""
    carry = torch.tensor([[7, 8, 1, 30, 4], [0, 0, 0, 0, 0], [5, 6, 0, 9, 2]])  # tokens, n, start, generated
    ints = torch.tensor([[1, 2, 1, 10, 0, 1, 3, 99], [3, 4, 0, 11, 2, 0, 6, 98]])  # ..., trow, fed, gen, cap
    tw, tc = torch.arange(6).view(3, 2), -torch.arange(6).view(3, 2)
    base, gen, cap, wt, ct, state = ops.read_carry(ints, carry, tw, tc, 2, backend="reference")
    assert base.tolist() == [[7, 8, 1, 30, 0], [3, 4, 0, 11, 2]]
    assert gen.tolist() == [4, 6] and cap.tolist() == [99, 98] and state.tolist() == [0, 0]
    assert wt.tolist() == [[0, 1], [4, 5]] and ct.tolist() == [[0, -1], [-4, -5]]


@pytest.mark.parametrize("B,w,P,sampled", [(1, 1, 3, False), (5, 2, 17, True), (9, 3, 1, False), (4, 8, 1500, True)])
def test_read_kernel_equals_the_reference(B, w, P, sampled):
    for seed in range(3):
        args = read_step(B, w, R=B + 3, P=P, sampled=sampled, seed=seed * 100 + B * 10 + w)
        want = ops.read_carry(*args, backend="reference")
        with ops.which_ran() as ran:
            got = ops.read_carry(*args)
        assert ran == {"read_carry": ["triton"]}
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_read_refusals_name_the_reason():
    args = list(read_step(3, 2, R=6, P=4, sampled=False))
    bad = args.copy()
    bad[0] = bad[0][:, :-1]
    assert "ints" in ops.refusal("read_carry", "triton", *bad)
    bad = args.copy()
    bad[2] = bad[2].int()
    assert "tables_w" in ops.refusal("read_carry", "triton", *bad)
    bad = args.copy()
    bad[3] = bad[3][:, :3]
    assert "one shape" in ops.refusal("read_carry", "triton", *bad)
    assert ops.refusal("read_carry", "triton", *args) is None
