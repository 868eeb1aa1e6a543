"""The fused token draw (`gumbel_argmax`, backend "triton") against its plain-torch reference.

The kernel computes each candidate value with the reference's integer hash and float64 operations in the
same order, so on CUDA (where both take the logarithm from libdevice) the drawn token is the reference's
exactly. On the CPU interpreter the logarithm is numpy's, which may differ from torch's by an ulp: there
a different token is allowed only where the two candidates' values are within a few float64 ulps (a
tie to rounding). The log-probability is logit - logsumexp in float64 in both, summed in another order,
so after both round it to float32 they are at most one float32 ulp apart.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import CUDA, DEV, interpret_unless_cuda  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.engine.sampling import Sampler, SamplingParams, SamplingTensors  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import sampling as ts  # noqa: E402

F64_EPS = 2.0**-52


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()
    yield


def rows(B: int, seed: int = 0):
    """Per-row settings: mixed temperatures, greedy rows, seeds and counters with high words set."""
    g = torch.Generator().manual_seed(seed)
    temp = torch.tensor([[1.0, 0.7, 2.0, 1e-3, 100.0, 1.0][i % 6] for i in range(B)], dtype=torch.float64)
    greedy = torch.tensor([i % 3 == 1 for i in range(B)])
    seeds = torch.randint(0, 2**62, (B,), generator=g) | (torch.arange(B) << 40)
    counters = torch.randint(0, 2**40, (B,), generator=g)
    return [t.to(DEV) for t in (temp, greedy, seeds, counters)]


def draw_values(logits, temp, greedy, seeds, counters, stream: int = ref.STREAM_SAMPLE) -> torch.Tensor:
    """The reference's candidate values [B, V] (float64), for judging ties to rounding."""
    x = logits.double()
    noise = ref.gumbel_noise(seeds, counters, x.size(-1), stream)
    return torch.where(greedy.unsqueeze(1), x, x / temp.unsqueeze(1) + noise)


def assert_tokens_agree(tok, want_tok, logits, settings, stream: int = ref.STREAM_SAMPLE) -> None:
    """Equal on CUDA; on the interpreter, a different token only where the two candidates tie to within a
    few float64 ulps (numpy's log against torch's)."""
    if CUDA:
        assert torch.equal(tok, want_tok)
        return
    vals = draw_values(logits, *settings, stream=stream)
    a = vals.gather(1, tok.unsqueeze(1)).squeeze(1)
    b = vals.gather(1, want_tok.unsqueeze(1)).squeeze(1)
    differ = tok != want_tok
    slack = 8 * F64_EPS * b.abs().clamp_min(1.0)
    assert torch.all(~differ | ((a - b).abs() <= slack)), (tok[differ], want_tok[differ])
    assert not torch.any(differ & b.isnan())  # a NaN is chosen by both


def assert_same_draw(logits, settings, split: int | None = None) -> None:
    kw = {} if split is None else {"split": split}
    tok, lp = (
        ts.triton_gumbel_argmax(logits, *settings, **kw)
        if kw
        else ops.gumbel_argmax(logits, *settings, backend="triton")
    )
    want_tok, want_lp = ref.gumbel_argmax(logits, *settings)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32 and tok.shape == lp.shape == want_tok.shape
    assert_tokens_agree(tok, want_tok, logits, settings)
    lp_ref = logits.double().gather(1, tok.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits.double(), -1)
    both_nan = lp.isnan() & lp_ref.isnan()
    ulp = torch.finfo(torch.float32).eps * lp_ref.abs().float().clamp_min(torch.finfo(torch.float32).tiny)
    close = (lp.double() - lp_ref).abs() <= ulp.double() + 1e-300
    assert torch.all(both_nan | close | (lp.double() == lp_ref)), (lp, lp_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("V,split", [(3000, 1024), (1024, 256), (777, 64), (129, 8192), (1000, 100)])
def test_random_logits(dtype, V, split):
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(7, V, generator=g) * 4).to(dtype).to(DEV)
    assert_same_draw(logits, rows(7), split)


def test_through_the_registry_reports_triton():
    logits = torch.randn(3, 500).to(DEV)
    with ops.which_ran() as ran:
        assert_same_draw(logits, rows(3))
    assert ran == {"gumbel_argmax": ["triton"]}


def test_structured_rows():
    """Ties (all-equal rows: greedy and sampled, lowest index wins among equal values), -inf everywhere but
    one column, a +inf logit, NaN logits (the first NaN wins, its log-probability is NaN), huge and tiny
    temperatures, one-column vocabularies, vocabularies at split boundaries."""
    V = 700
    logits = torch.randn(10, V)
    logits[0] = 0.0
    logits[1] = 0.0
    logits[2] = float("-inf")
    logits[2, 333] = 1.0
    logits[3, 5] = float("inf")
    logits[4, 9] = float("nan")
    logits[4, 600] = float("nan")
    logits[5, 650] = float("nan")  # in a later split than the maximum
    logits[6] = logits[6].round()  # many exact ties
    logits[7, 128:] = float("-inf")
    logits[8] = 1e30
    logits[9] = -1e30
    temp, greedy, seeds, counters = rows(10)
    greedy[:] = torch.tensor([True, False, False, False, False, True, True, False, True, False], device=DEV)
    for split in (64, 128, 8192):
        assert_same_draw(logits.to(DEV), (temp, greedy, seeds, counters), split)
    for V in (1, 63, 64, 65, 128):
        assert_same_draw(torch.randn(4, V).to(DEV), rows(4), 64)


@pytest.mark.parametrize("split", [64, ts.SPLIT])
def test_ties_go_to_the_lowest_index_across_blocks_and_splits(split):
    """The same maximum in several blocks of one split, and in several splits."""
    logits = torch.zeros(2, 3000)
    logits[:, [1500, 70, 2900]] = 5.0
    temp, greedy, seeds, counters = rows(2)
    greedy[:] = True
    tok, _ = ts.triton_gumbel_argmax(logits.to(DEV), temp, greedy, seeds, counters, split=split)
    assert tok.tolist() == [70, 70]


def test_a_row_draws_the_same_alone_and_in_any_batch():
    """Fixed column splits: a row's token and log-probability, bit for bit, do not depend on its batch."""
    logits = torch.randn(9, 2000).to(DEV)
    settings = rows(9)
    tok, lp = ts.triton_gumbel_argmax(logits, *settings, split=256)
    for i in (0, 4, 8):
        one = [t[i : i + 1] for t in settings]
        t1, l1 = ts.triton_gumbel_argmax(logits[i : i + 1], *one, split=256)
        assert t1.item() == tok[i].item() and torch.equal(l1.view(torch.int32), lp[i : i + 1].view(torch.int32))


def test_strided_settings_as_the_runner_packs_them():
    """The runner's settings are columns of packed [B, 4] buffers (strides of 4 elements)."""
    B, V = 5, 400
    floats = torch.zeros(B, 4, dtype=torch.float64)
    ints = torch.zeros(B, 4, dtype=torch.int64)
    params = [SamplingParams(temperature=t) for t in (0.0, 0.5, 1.0, 1.5, 0.0)]
    SamplingTensors.pack(params, [11, 12, 13, 2**45, 15], [0, 3, 6, 9, 2**35], V, floats.numpy(), ints.numpy())
    st = SamplingTensors.unpack(floats.to(DEV), ints.to(DEV), None)
    logits = torch.randn(B, V).to(DEV)
    settings = (st.temperature[:, 0], st.greedy[:, 0], st.seeds, st.counters)
    assert settings[0].stride(0) == 4 and settings[2].stride(0) == 4
    assert_same_draw(logits, settings)


def test_the_sampler_draws_plain_rows_with_the_fused_op_and_others_as_before():
    """Plain rows (no filtering, penalties, constraints or alternatives) go through `gumbel_argmax`; its
    tokens are those of the sampler's general path, which a top-k of V (no filtering) forces."""
    B, V = 6, 300
    logits = torch.randn(B, V).to(DEV)
    params = [SamplingParams(temperature=t, logprobs=0) for t in (0.0, 0.8, 1.0, 1.2, 0.0, 2.0)]
    seeds, counters = list(range(100, 106)), [0, 1, 2, 3, 4, 5]
    with ops.which_ran() as ran:
        plain = Sampler()(logits, params, seeds, counters)
    assert ran == {"gumbel_argmax": ["triton"]}
    general = Sampler()(logits, [SamplingParams(temperature=p.temperature, top_k=V) for p in params], seeds, counters)
    settings = (
        torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float64, device=DEV),
        torch.tensor([p.greedy for p in params], device=DEV),
        torch.tensor(seeds, device=DEV),
        torch.tensor(counters, device=DEV),
    )
    want, _ = ref.gumbel_argmax(logits, *settings)
    assert torch.equal(want, general.tokens)  # the reference op is the general path's draw
    assert_tokens_agree(plain.tokens, general.tokens, logits, settings)
    assert plain.logprobs is not None and plain.logprobs.shape == (B,)


def test_the_speculative_draw_is_the_fused_op_at_temperature_one():
    """`sampling.draw` (rejection sampling's resample, a filtered draft's draw): argmax(log p + noise) on
    float64 probabilities with zeros, through the fused op, gives the composed reference's tokens (equal on
    CUDA; on the interpreter up to float64 ties, `assert_tokens_agree`), never a zero-probability token."""
    from dsv4.engine.sampling import draw

    g = torch.Generator().manual_seed(5)
    probs = torch.rand(9, 2000, generator=g, dtype=torch.float64)
    probs[probs < 0.6] = 0  # most of each row impossible, as after top-k / the residual max(p - q, 0)
    probs = (probs / probs.sum(-1, keepdim=True)).to(DEV)
    _, _, seeds, counters = rows(9)
    with ops.which_ran() as ran:
        tok = draw(probs, seeds, counters, ref.STREAM_ACCEPT)
    assert ran == {"gumbel_argmax": ["triton"]}
    want = (torch.log(probs) + ref.gumbel_noise(seeds, counters, probs.size(-1), ref.STREAM_ACCEPT)).argmax(-1)
    one = torch.ones(9, dtype=torch.float64, device=DEV)
    free = torch.zeros(9, dtype=torch.bool, device=DEV)
    assert_tokens_agree(tok, want, torch.log(probs), (one, free, seeds, counters), ref.STREAM_ACCEPT)
    assert torch.all(probs.gather(1, tok.unsqueeze(1)) > 0)


@pytest.mark.parametrize("n", [1, 5, 1000, 3000])
@pytest.mark.parametrize("stream", [ref.STREAM_SAMPLE, ref.STREAM_ACCEPT, 0, 2**32 - 1])
def test_uniforms_are_the_references_bits(n, stream):
    """Integer hashing and a division by 2^32: equal to the reference everywhere, interpreter included."""
    _, _, seeds, counters = rows(11, seed=n)
    got = ops.uniform(seeds, counters, n, stream, backend="triton")
    want = ref.uniform(seeds, counters, n, stream)
    assert got.dtype == torch.float64 and got.shape == (11, n)
    assert torch.equal(got, want)
    assert torch.all((got > 0) & (got < 1))


def test_uniforms_of_strided_rows_and_as_acceptance_draws_them():
    """Seeds and counters as views with strides (the packed step inputs), and the shape speculative
    acceptance asks for (B * K rows of one column, counters c .. c + K - 1); through the registry."""
    _, _, seeds, counters = rows(8)
    packed = torch.stack([seeds, counters], 1)  # [8, 2]: each column a strided view
    with ops.which_ran() as ran:
        got = ops.uniform(packed[:, 0], packed[:, 1], 7)
    assert ran == {"uniform": ["triton"]}
    assert torch.equal(got, ref.uniform(seeds, counters, 7))
    K = 3
    flat = (counters.unsqueeze(1) + torch.arange(K, device=DEV)).flatten()
    got = ops.uniform(seeds.repeat_interleave(K), flat, 1, ref.STREAM_ACCEPT, backend="triton")
    assert torch.equal(got, ref.uniform(seeds.repeat_interleave(K), flat, 1, ref.STREAM_ACCEPT))
    assert ops.uniform(seeds[:0], counters[:0], 4, backend="triton").shape == (0, 4)


def test_refusals_name_the_reason():
    logits = torch.randn(2, 10).to(DEV)
    temp, greedy, seeds, counters = rows(2)
    assert "temperature" in ops.refusal("gumbel_argmax", "triton", logits, temp.float(), greedy, seeds, counters)
    assert "greedy" in ops.refusal("gumbel_argmax", "triton", logits, temp, greedy.long(), seeds, counters)
    assert "contiguous" in ops.refusal("gumbel_argmax", "triton", logits.t(), temp, greedy, seeds, counters)
    with pytest.raises(ops.BackendUnavailable, match="seeds"):
        ops.gumbel_argmax(logits, temp, greedy, seeds[:1], counters, backend="triton")
    assert "int64" in ops.refusal("uniform", "triton", seeds.int(), counters, 4)
    assert "one entry per row" in ops.refusal("uniform", "triton", seeds, counters[:1], 4)
    assert "stream" in ops.refusal("uniform", "triton", seeds, counters, 4, 2**32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_vocabulary_of_v4_at_serving_batches():
    """The serving shapes: a 129,280-token vocabulary, fp32 logits, batches 1 to 256: tokens equal."""
    for B in (1, 64, 256):
        g = torch.Generator().manual_seed(B)
        logits = (torch.randn(B, 129280, generator=g) * 3).to(DEV)
        assert_same_draw(logits, rows(B, B))
