"""Sparse attention's grouped-query plan (`dsv4.ops.triton.sparse_attention_grouped`) against the reference.

A program serves G consecutive queries: the last one's keys once for all of them, then each query's keys
that the shared pass did not give it. Whatever the key lists hold, every column of every list must count
exactly once: tested on a paged step's layout (decode rows of other sequences, prompt chunks whose windows
shift by a column per token, entry lists in entry order and in score order), on random lists with repeated
keys, on rows without keys and on a last group cut short. On a machine without CUDA the kernel runs on the
Triton CPU interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

import dsv4.ops as ops  # noqa: E402
import dsv4.ops.triton.sparse_attention_grouped as grouped  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.precision import exact_accumulation  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops.reset_calls()
    ops.set_deterministic(False)
    yield
    ops.set_deterministic(False)


def paged_step(seed: int, window: int = 32, entries: int = 16, ratio: int = 4):
    """One engine-like step: 5 decode rows of other sequences, then a chunk of 16 tokens (positions
    30..45) whose entry columns are in entry order, then one of 21 tokens (0..20) whose visible entries are
    listed in a random order per token. Rows of kv: window slots of each sequence, then entry slots, in
    random places. -> (idx [1, T, window + entries], n)."""
    g = torch.Generator().manual_seed(seed)
    n = 1024
    free = torch.randperm(n, generator=g).tolist()

    def slots(count: int) -> list[int]:
        return [free.pop() for _ in range(count)]

    rows = []
    for _ in range(5):  # decode rows: each its own sequence's keys, anywhere
        r = torch.tensor(slots(window + entries))
        r[torch.rand(r.shape, generator=g) < 0.3] = -1
        rows.append(r)
    for first, count, ordered in ((30, 16, True), (0, 21, False)):
        win_slot = slots(first + count)  # the sequence's window row of each position
        ent_slot = slots((first + count) // ratio + 1)
        for p in range(first, first + count):
            w = [win_slot[q] if q >= 0 else -1 for q in range(p - window + 1, p + 1)]
            visible = [ent_slot[e] for e in range((p + 1) // ratio)][:entries]
            if not ordered:
                visible = [visible[i] for i in torch.randperm(len(visible), generator=g).tolist()]
            rows.append(torch.tensor(w + visible + [-1] * (entries - len(visible))))
    return torch.stack(rows).unsqueeze(0), n


def run_both(q, kv, sink, idx, scale):
    want = ref.sparse_attention(q.double(), kv.double(), sink.double(), idx, scale)
    with torch.no_grad():
        got = grouped.grouped_forward(q.to(DEV), kv.to(DEV), sink.to(DEV), idx.to(DEV), scale)
    return want, got


def check(want, got, dtype):
    (o0, lse0), (o1, lse1) = want, (got[0].cpu().double(), got[1].cpu().double())
    assert torch.isfinite(o1).all() and torch.isfinite(lse1).all()
    # fp32 operands: each score and probability within a few ulp of float64's, the sums over <= 48 keys
    # reordered: relative error ~ 1e-6 of each row's scale; bf16 operands: the probabilities are rounded to
    # bf16 for the value product (2^-8 relative) on both sides of the per-query kernel's contract
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = o0.abs().amax(-1, keepdim=True).clamp_min(1e-3)
    assert ((o1 - o0).abs() / scale).max() < tol
    assert (lse1 - lse0).abs().max() < tol * max(1.0, float(lse0.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_step_matches_the_reference(dtype):
    idx, n = paged_step(seed=1)
    t, h, d = idx.size(1), 16, 64
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, t, h, d, generator=g).to(dtype)
    kv = torch.randn(1, n, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g)
    check(*run_both(q, kv, sink, idx, d**-0.5), dtype)


def test_any_lists_count_each_column_once():
    """Random lists (keys repeated within a row, rows of unrelated keys), rows without keys, a last group
    cut short (S = 4k + 3), fewer heads than a tile row block: every listed column counts once."""
    g = torch.Generator().manual_seed(3)
    b, s, h, d, n, k = 2, 11, 12, 32, 40, 24
    q = torch.randn(b, s, h, d, generator=g)
    kv = torch.randn(b, n, d, generator=g)
    sink = torch.randn(h, generator=g) * 2
    idx = torch.randint(0, n, (b, s, k), generator=g)  # n = 40 over 24 columns: repeats in most rows
    idx[torch.rand(b, s, k, generator=g) < 0.25] = -1
    idx[0, 4] = -1  # no key at all: o = 0 and lse = the sink, exactly
    idx[1, 1:5] = idx[1, 5]  # four queries listing the same keys as the fifth
    idx[1, 6, 1:] = idx[1, 5, :-1]  # and one whose list is shifted by a column
    want, got = run_both(q, kv, sink, idx, d**-0.5)
    check(want, got, torch.float32)
    assert torch.equal(got[0][0, 4].cpu(), torch.zeros(h, d))
    assert torch.equal(got[1][0, 4].cpu(), sink)


def test_the_plan_is_taken_only_where_set(monkeypatch):
    """Off unless `ENABLED`; then for few heads and enough groups, never under exact accumulation (the
    engine's deterministic mode) or for a head count that fills a tile alone; through `ops.sparse_attention`
    it gives the reference's numbers."""
    idx, n = paged_step(seed=4)
    t, h, d = idx.size(1), 16, 64
    g = torch.Generator().manual_seed(5)
    q, kv, sink = torch.randn(1, t, h, d, generator=g), torch.randn(1, n, d, generator=g), torch.randn(h, generator=g)
    assert not grouped.applies(q)
    with grouped.enabled():
        assert grouped.ENABLED
    assert not grouped.ENABLED
    monkeypatch.setattr(grouped, "ENABLED", True)
    monkeypatch.setattr(grouped, "num_sms", lambda dev: 4)
    assert grouped.applies(q) and grouped.group_size(16) == 4 and grouped.group_size(64) == 1
    assert not grouped.applies(torch.empty(1, t, 64, d))
    assert not grouped.applies(torch.empty(t, 1, h, d))  # one-token rows: a dense decode step
    with exact_accumulation():  # the engine's deterministic mode
        assert not grouped.applies(q)
    ran = []
    real = grouped.grouped_forward
    monkeypatch.setattr(grouped, "grouped_forward", lambda *a: ran.append(1) or real(*a))
    with torch.no_grad():
        o, lse = ops.sparse_attention(q.to(DEV), kv.to(DEV), sink.to(DEV), idx.to(DEV), d**-0.5, backend="triton")
    assert ran == [1]
    want = ref.sparse_attention(q.double(), kv.double(), sink.double(), idx, d**-0.5)
    check(want, (o, lse), torch.float32)
