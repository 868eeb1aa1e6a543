"""The fused speculative acceptance (`speculative_accept`, backend "triton") against its plain-torch reference.

Both compute every probability with the same float64 operations on the same operands; only the softmax
sums add in another order (and on the CPU interpreter numpy's exp / log may differ from torch's by an ulp).
So a probability may differ in its last few float64 bits, and a result may differ only where the
reference's own decision is that close: an acceptance test u * q(d) <= p(d) within a relative 1e-9 of
equality, or two Gumbel candidates of the draw within 1e-9 of each other. Such rows are counted and
allowed (random data has none or almost none: the test asserts that too); every other row must give the
reference's accepted count and next token exactly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import CUDA, DEV, interpret_unless_cuda  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402

TIE = 1e-9  # a relative margin many orders above float64 rounding (2^-52 ~ 2.2e-16) of sums of <= 1e5 terms


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()
    yield


def make(B: int, K: int, V: int, kind: str = "random", dtype=torch.float32, seed: int = 0) -> tuple:
    """A verify step's arguments. kind: "random" (draft logits unrelated to the target's: mostly rejected),
    "near" (the target's logits plus noise: accepted and rejected both, residual draws with real mass),
    "same" (q = p: every draft accepted). Temperatures mixed, every third row greedy (drafts there: the
    target's argmax for a prefix of random length, then another token), n_drafts 0 .. K in turn, seeds and
    counters with high words set."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K + 1, V, generator=g) * 3).to(dtype)
    base = logits[:, :K].float()
    if kind == "random":
        draft_logits = torch.randn(B, K, V, generator=g) * 3
    elif kind == "near":
        draft_logits = base + torch.randn(B, K, V, generator=g) * 0.5
    else:
        draft_logits = base.clone()
    greedy = torch.tensor([b % 3 == 1 for b in range(B)])
    temp = torch.tensor([1.0 if greedy[b] else [1.0, 0.7, 2.0, 0.3][b % 4] for b in range(B)], dtype=torch.float64)
    q = torch.softmax(draft_logits.double() / temp.view(B, 1, 1), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K) if K else torch.zeros(B, 0).long()
    argmax = logits[:, :K].double().argmax(-1)
    for b in range(B):
        if greedy[b] and K:
            keep = int(torch.randint(0, K + 1, (1,), generator=g))
            drafts[b, :keep] = argmax[b, :keep]
            drafts[b, keep:] = (argmax[b, keep:] + 1) % V
    n_drafts = torch.tensor([b % (K + 1) for b in range(B)])
    seeds = torch.randint(0, 2**62, (B,), generator=g) | (torch.arange(B) << 40)
    counters = torch.randint(0, 2**40, (B,), generator=g)
    return tuple(t.to(DEV) for t in (logits, draft_logits, drafts, n_drafts, temp, greedy, seeds, counters))


def near_ties(args) -> torch.Tensor:
    """[B] bool: rows whose reference decision has a margin below TIE (an acceptance test it reached, or
    the two best candidates of its draw)."""
    logits, draft_logits, drafts, n_drafts, temp, greedy, seeds, counters = (t.cpu() for t in args)
    B, _, V = logits.shape
    flag = greedy.view(B, 1, 1)
    p = ref.temperature_distribution(logits.double(), temp.view(B, 1, 1), flag)
    q = ref.temperature_distribution(draft_logits.double(), temp.view(B, 1, 1), flag)
    q = torch.where(flag, torch.nn.functional.one_hot(drafts, V).double(), q)
    accepted, _ = ref.rejection_sample(p, q, drafts, n_drafts, seeds, counters)
    tie = torch.zeros(B, dtype=torch.bool)
    for b in range(B):
        a = int(accepted[b])
        for i in range(min(a + 1, int(n_drafts[b]))):  # the tests the row reached
            u = ref.uniform(seeds[b : b + 1], counters[b : b + 1] + i, 1, ref.STREAM_ACCEPT)[0, 0]
            pd, qd = p[b, i, drafts[b, i]], q[b, i, drafts[b, i]]
            tie[b] |= bool((u * qd - pd).abs() <= TIE * pd.abs().clamp_min(1e-300))
        if greedy[b]:
            continue  # an exact max: no tie to rounding
        if n_drafts[b] == 0:
            x = logits[b, 0].double() / temp[b]
            c = counters[b : b + 1]
        else:
            r = (p[b, a] - (q[b, a] if a < n_drafts[b] else 0)).clamp_min(0)
            r = r / r.sum() if r.sum() > 0 else p[b, a]
            x, c = r.log(), counters[b : b + 1] + a
        vals = (x + ref.gumbel_noise(seeds[b : b + 1], c, V)[0]).nan_to_num(nan=float("inf"))
        top = vals.topk(2).values
        tie[b] |= bool((top[0] - top[1]).abs() <= TIE * top[0].abs().clamp_min(1.0))
    return tie


def assert_matches_reference(args, max_ties: int = 1) -> None:
    acc, tok = ops.speculative_accept(*args, backend="triton")
    want_acc, want_tok = ref.speculative_accept(*args)
    assert acc.dtype == tok.dtype == torch.int64 and acc.shape == tok.shape == want_acc.shape
    tie = near_ties(args).to(acc.device)
    assert int(tie.sum()) <= max_ties, "the data is too close to rounding to test anything"
    same = (acc == want_acc) & (tok == want_tok)
    assert torch.all(same | tie), (acc[~same], want_acc[~same], tok[~same], want_tok[~same])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "near", "same"])
@pytest.mark.parametrize("K,V", [(2, 100), (3, 1500), (1, 37), (1, 5000)])
def test_random_rows_give_the_references_results(dtype, kind, K, V):
    """Blocks of the vocabulary (V above and below the 1024-column block, not a multiple of it), every
    logits dtype, n_drafts 0 .. K, greedy and sampled rows."""
    assert_matches_reference(make(12, K, V, kind, dtype, seed=K * V))


def test_through_the_registry_reports_triton():
    with ops.which_ran() as ran:
        ops.speculative_accept(*make(3, 2, 50))
    assert ran == {"speculative_accept": ["triton"]}


def test_structured_rows():
    """q = p accepts every draft; greedy rows keep exactly their prefix of argmax drafts and then take the
    argmax; a row without drafts draws as `gumbel_argmax` does; -inf logits are never drawn; K = 0."""
    B, K, V = 9, 3, 300
    logits, draft_logits, drafts, n_drafts, temp, greedy, seeds, counters = make(B, K, V, "same", seed=7)
    acc, tok = ops.speculative_accept(logits, draft_logits, drafts, n_drafts, temp, greedy, seeds, counters)
    sampled = ~greedy
    assert torch.equal(acc[sampled], n_drafts[sampled])
    argmax = logits.double().argmax(-1)  # [B, K + 1]
    for b in range(B):
        if greedy[b]:
            n = int(n_drafts[b])
            keep = next((i for i in range(n) if drafts[b, i] != argmax[b, i]), n)
            assert int(acc[b]) == keep and int(tok[b]) == int(argmax[b, keep])
    plain = n_drafts == 0
    want, _ = ref.gumbel_argmax(logits[:, 0], temp, greedy, seeds, counters)
    assert torch.equal(tok[plain], want[plain])
    masked = logits.clone()
    masked[..., : V // 2] = float("-inf")  # only the upper half can be drawn
    args = (masked, draft_logits, drafts.clamp_min(V // 2), n_drafts, temp, greedy, seeds, counters)
    _, tok = ops.speculative_accept(*args)
    assert torch.all(tok >= V // 2)
    assert_matches_reference(args)
    none = make(6, 0, 90, seed=3)
    assert_matches_reference(none)


def test_nan_logits_as_the_reference():
    """A NaN in the target's logits at the first position (its softmax all NaN: the draft is rejected and
    the draw takes the first NaN's column, 0), in a draft's logits (rejected, the token from p), and in a
    greedy row (the first NaN is its argmax)."""
    args = list(make(6, 2, 80, "near", seed=11))
    logits, draft_logits = args[0].clone(), args[1].clone()
    logits[0, 0, 17] = float("nan")
    draft_logits[2, 0, 40] = float("nan")
    logits[1, 0, 33] = float("nan")
    args[0], args[1] = logits, draft_logits
    args[3] = torch.full_like(args[3], 2)
    acc, tok = ops.speculative_accept(*args, backend="triton")
    want_acc, want_tok = ref.speculative_accept(*args)
    assert torch.equal(acc[:3], want_acc[:3]) and torch.equal(tok[:3], want_tok[:3])


def test_chunks_cover_the_vocabulary():
    """Phases 1-2's chunks: a power of two of columns each, every chunk holding at least one column, at most
    MAX_CHUNKS of them, for vocabularies from 1 column to beyond V4's."""
    from dsv4.ops.triton.spec_accept import MAX_CHUNKS, chunking

    for V in (1, 2, 37, 511, 512, 513, 1500, 4096, 129_280, 2**20 + 1):
        ch, nc = chunking(V)
        assert ch & (ch - 1) == 0 and 1 <= nc <= MAX_CHUNKS, (V, ch, nc)
        assert (nc - 1) * ch < V <= nc * ch, (V, ch, nc)


def test_nan_and_minus_inf_in_later_chunks_as_the_reference():
    """V = 1,500 (three chunks of 512): a greedy row whose only NaN is in the last chunk (its argmax: that
    column), a sampled row with a NaN there at the position it stops (the draw takes it), and rows whose
    first two chunks are -inf (only the last chunk can be drawn); every row as the reference."""
    args = list(make(6, 2, 1500, "near", seed=13))
    logits = args[0].clone()
    logits[1, :, 1200] = float("nan")  # row 1 is greedy (every third row from 1)
    logits[0, 0, 1300] = float("nan")  # row 0 samples; with n_drafts 0 it draws at position 0
    logits[2:, :, :1024] = float("-inf")
    args[0] = logits
    acc, tok = ops.speculative_accept(*args, backend="triton")
    want_acc, want_tok = ref.speculative_accept(*args)
    assert int(tok[1]) == 1200 and int(tok[0]) == 1300
    assert torch.all(tok[2:] >= 1024)
    assert torch.equal(acc, want_acc) and torch.equal(tok, want_tok)


def test_per_row_settings_as_columns_of_the_fixed_steps_integers():
    """The fixed-shape step hands over n_drafts, seeds, counters (and the sampled variant's temperature and
    greedy flags) as strided columns of one integer / float table: the kernel takes them as they come."""
    logits, draft_logits, drafts, n_drafts, temp, greedy, seeds, counters = make(5, 2, 300, "near", seed=9)
    ints = torch.stack([n_drafts, seeds, counters, greedy.long()], 1)  # [B, 4]: every column strided
    floats = torch.stack([temp, temp], 1)
    args = (logits, draft_logits, drafts, ints[:, 0], floats[:, 1], ints[:, 3] > 0, ints[:, 1], ints[:, 2])
    assert ops.refusal("speculative_accept", "triton", *args) is None
    assert_matches_reference(args)


def test_draft_logits_read_in_place_from_a_store():
    """draft_rows: the draft logits are rows of a store [R, >= K, V] (the engine's, one row per sequence slot,
    the table rows a strided column of the step's integers): the same results as the gathered copy, on the
    reference and on the kernel, whose programs read each row where it is."""
    B, K, V, R = 6, 2, 700, 11
    args = make(B, K, V, "near", seed=21)
    rows = torch.randperm(R, generator=torch.Generator().manual_seed(2))[:B].to(DEV)
    store = torch.randn(R, K + 1, V, generator=torch.Generator().manual_seed(3)).to(DEV)  # (a wider store)
    store[rows, :K] = args[1]
    ints = torch.stack([rows, rows], 1)  # (a strided column, as the engine hands the table rows over)
    stored = (args[0], store, *args[2:], ints[:, 1])
    for backend in ("reference", "triton"):  # each backend: the same results from the store as from the copy
        want = ops.speculative_accept(*args, backend=backend)
        got = ops.speculative_accept(*stored, backend=backend)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), backend
    assert_matches_reference(args)  # (and the two backends agree, as everywhere)
    assert ops.refusal("speculative_accept", "triton", *stored) is None
    assert "draft_rows" in ops.refusal("speculative_accept", "triton", *stored[:-1], rows[:3])
    assert "store" in ops.refusal("speculative_accept", "triton", args[0], store[:, :1], *args[2:], rows)


def test_a_row_is_the_same_alone_and_in_any_batch():
    args = make(8, 2, 500, "near", seed=5)
    acc, tok = ops.speculative_accept(*args)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0)).to(DEV)
    acc_p, tok_p = ops.speculative_accept(*(t[perm] for t in args))
    assert torch.equal(acc_p, acc[perm]) and torch.equal(tok_p, tok[perm])
    for b in (0, 5):
        a1, t1 = ops.speculative_accept(*(t[b : b + 1] for t in args))
        assert int(a1) == int(acc[b]) and int(t1) == int(tok[b])


def test_refusals_name_the_reason():
    args = list(make(2, 2, 40))
    bad = args.copy()
    bad[4] = bad[4].float()
    assert "temperature" in ops.refusal("speculative_accept", "triton", *bad)
    bad = args.copy()
    bad[1] = bad[1][:, :1]
    assert "draft_logits" in ops.refusal("speculative_accept", "triton", *bad)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_vocabulary_of_v4_at_serving_batches():
    """V4's 129,280-column vocabulary, 64 rows of K = 3 (many blocks per pass), bf16 logits."""
    assert_matches_reference(make(64, 3, 129280, "near", torch.bfloat16, seed=1), max_ties=2)
