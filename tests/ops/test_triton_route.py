"""The fused MoE router (`route`, backend "triton") against its plain-torch reference.

What must hold exactly, on the CPU interpreter and on CUDA: the indices are the top-k of the kernel's own
scores + bias (largest first) or the hash table's row; the weights are the reference's normalization of
the kernel's own picked scores (the same fp32 / float64 operations in the same order: sequential sum,
correctly rounded division, the scale). What may differ on the interpreter: the scores, whose log1p is
computed from numpy's log there (Goldberg's formula: within 5 ulp of the exact value, torch's own within
2; half of that through the square root, plus its rounding and the rounding to fp32: under 8 ulp). On
CUDA the kernel calls libdevice's exp and log1p as torch's softplus does: the scores are the reference's
bits, and so is everything else (`test_cuda_matches_the_reference_bit_for_bit`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import CUDA, DEV, interpret_unless_cuda, poison_allocator  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.precision import acc_dtype, exact_accumulation  # noqa: E402
from dsv4.ops.triton import route as route_module  # noqa: E402

ULP32 = 2.0**-23
SCORE_ULPS = 8  # the interpreter's scores against torch's (module docstring)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    poison_allocator(monkeypatch, route_module)
    ops.reset_calls()
    yield


def normalize(picked: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference's weights from picked fp32 scores [T, k] (its operations, in its order)."""
    p = picked.to(acc_dtype())
    total = p[:, :1]
    for i in range(1, p.size(1)):
        total = total + p[:, i : i + 1]
    return (p / total * scale).float()


def check(logits, bias, k, scale=2.5, table=None, tok=None, exact_scores=CUDA):
    """Run both; assert every exact property (module docstring); return the kernel's results."""
    w, idx, s = ops.route(logits, bias, k, "sqrtsoftplus", scale, table, tok, backend="triton")
    assert ops.last_backend("route") == "triton"
    rw, ridx, rs = ref.route(logits, bias, k, "sqrtsoftplus", scale, table, tok)
    assert s.dtype == w.dtype == torch.float32 and idx.dtype == torch.int64
    assert s.shape == rs.shape and w.shape == idx.shape == (logits.size(0), k)
    if exact_scores:
        assert same(s, rs)
    else:
        torch.testing.assert_close(s, rs, rtol=SCORE_ULPS * ULP32, atol=1e-30, equal_nan=True)
    if table is not None:
        assert torch.equal(idx, table[tok].long())
    else:
        biased = s if bias is None else s + bias
        assert torch.equal(idx, biased.topk(k, dim=-1).indices) or _ties(biased)
    assert same(w, normalize(s.gather(1, idx), scale))
    if exact_scores and not _ties(s if bias is None else s + bias):
        assert torch.equal(idx, ridx) and same(w, rw)
    return w, idx, s


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits where numbers, NaN at the same places."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _ties(x: torch.Tensor) -> bool:
    return any(row.unique().numel() < row.numel() for row in x)


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (37, 32, 4), (64, 256, 6), (5, 384, 8), (3, 20, 3)])
def test_random_logits_and_bias(T, E, k, exact):
    g = torch.Generator().manual_seed(T * 1000 + E + k)
    logits = (torch.randn(T, E, generator=g) * 4).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.2).to(DEV)
    with exact_accumulation(exact):
        check(logits, bias, k)
        check(logits, None, k)


@pytest.mark.parametrize("exact", [False, True])
def test_hash_layers_take_the_tables_row(exact):
    g = torch.Generator().manual_seed(1)
    T, E, k, vocab = 29, 32, 6, 100
    logits = torch.randn(T, E, generator=g).to(DEV)
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)]).int().to(DEV)
    tok = torch.randint(0, vocab, (T,), generator=g).to(DEV)
    with exact_accumulation(exact):
        check(logits, None, k, 1.5, table, tok)
        check(logits, None, k, 1.5, table.long(), tok.int())


def test_structured_inputs():
    T, E, k = 6, 16, 4
    # every expert ties: the lowest indices, each weight exactly 1/k of the scale
    w, idx, _ = check(torch.zeros(T, E, device=DEV), torch.zeros(E, device=DEV), k)
    assert idx.tolist() == [list(range(k))] * T and torch.all(w == 2.5 / k)
    # a large bias selects whatever the score: experts 3 and 9 always, weighed by their unbiased scores
    g = torch.Generator().manual_seed(2)
    bias = torch.zeros(E)
    bias[[3, 9]] = 100.0
    w, idx, s = check(torch.randn(T, E, generator=g).to(DEV), bias.to(DEV), k)
    assert (idx[:, :2].sort(-1).values.cpu() == torch.tensor([3, 9])).all()
    # both softplus branches and the tails: x above 20 is x itself; far below 0 the score underflows to 0
    x = torch.tensor([[25.0, 20.0, 19.5, 1.0, 0.0, -1.0, -30.0, -80.0, -200.0, float("-inf")] + [-5.0] * 6])
    _, _, s = check(x.to(DEV), None, 3)
    assert s[0, 0].item() == 5.0 and s[0, 8].item() == 0.0 and s[0, 9].item() == 0.0
    # NaN logits are chosen first, as torch.topk ranks NaN above everything; their weights are NaN
    x = torch.randn(2, E, generator=g)
    x[0, 5] = float("nan")
    w, idx, _ = check(x.to(DEV), torch.zeros(E, device=DEV), k)
    assert idx[0, 0].item() == 5 and w[0].isnan().all() and not w[1].isnan().any()


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(40, 64, generator=g) * 3).to(DEV)
    bias = (torch.randn(64, generator=g) * 0.1).to(DEV)
    whole = ops.route(logits, bias, 6, "sqrtsoftplus", 2.5, backend="triton")
    for rows in (slice(0, 1), slice(7, 20), slice(39, 40)):
        part = ops.route(logits[rows], bias, 6, "sqrtsoftplus", 2.5, backend="triton")
        for a, b in zip(whole, part):
            assert torch.equal(a[rows], b)


def test_strided_logits_and_empty_batches():
    g = torch.Generator().manual_seed(4)
    wide = (torch.randn(9, 48, generator=g) * 2).to(DEV)
    check(wide[:, :32], None, 4)  # rows 48 apart
    w, idx, s = ops.route(wide[:0, :32], None, 4, "sqrtsoftplus", 2.5, backend="triton")
    assert w.shape == idx.shape == (0, 4) and s.shape == (0, 32)


def test_refusals_name_their_reason():
    x = torch.randn(4, 16, device=DEV)
    bias = torch.zeros(16, device=DEV)

    def why(*args, **kw):
        return ops.refusal("route", "triton", *args, **kw)

    assert why(x, bias, 4) is None
    assert "sqrtsoftplus" in why(x, bias, 4, "sigmoid")
    assert "top-17" in why(x, bias, 17)
    assert "bias" in why(x, bias.double(), 4)
    assert "token ids" in why(x, None, 4, "sqrtsoftplus", 1.0, torch.zeros(8, 4, dtype=torch.int32, device=DEV))
    assert "table" in why(
        x, None, 4, "sqrtsoftplus", 1.0, torch.zeros(8, 3, dtype=torch.int32, device=DEV), x[:, 0].long()
    )
    assert "logits" in why(x.t(), None, 4)
    x.requires_grad_(True)
    assert "autograd" in why(x, bias, 4)
    with torch.no_grad():
        assert why(x, bias, 4) is None
    with exact_accumulation():
        assert "fp32 number" in why(x.detach(), bias, 4, "sqrtsoftplus", 0.1)
    with pytest.raises(ops.BackendUnavailable, match="autograd"):
        ops.route(x, bias, 4, backend="triton")


def test_the_model_routes_through_the_kernel_by_default_and_trains_through_the_reference():
    """A no-grad forward on the kernel's device picks it (hash layers and the others); a training forward
    picks the reference (the kernel has no backward)."""
    from dsv4.config import ModelConfig
    from dsv4.model import DeepSeekV4

    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32).to(DEV)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(DEV)
    with ops.prefer_backend("triton"):
        with torch.no_grad(), ops.which_ran() as ran:
            model(tokens)
        assert ran["route"] == ["triton"]
        with ops.which_ran() as ran:
            model(tokens)
        assert ran["route"] == ["reference"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("exact", [False, True])
def test_cuda_matches_the_reference_bit_for_bit(exact):
    """V4's shapes (256 experts, top-6; 384, top-8) at decode and prefill sizes: scores, indices and
    weights all equal to the reference's on the device (logits in the normal range: module docstring)."""
    g = torch.Generator().manual_seed(5)
    for T, E, k in ((1, 256, 6), (64, 256, 6), (2048, 256, 6), (16, 384, 8)):
        logits = (torch.randn(T, E, generator=g) * 4).cuda()
        bias = (torch.randn(E, generator=g) * 0.05).cuda()
        with exact_accumulation(exact):
            check(logits, bias, k, exact_scores=True)
