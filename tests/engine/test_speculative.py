"""Speculative decoding with the MTP draft must not change what a request computes.

Oracles: plain decoding by the same engine with speculation off (greedy tokens equal, deterministic mode),
the training path's MTP logits (a different code path: the full-sequence forward) for the draft, and the
target distribution itself for sampled acceptance (a statistical test). The tiny model is shrunk as in
test_engine.py (window 16, ratios 4 and 16, pages of 16 positions) so that verifies cross page, window and
compression-group boundaries often; its random MTP block rejects nearly every draft, so an oracle draft
that proposes the right tokens with planted errors exercises acceptance and rollback at chosen places.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsv4 import DeepSeekV4
from dsv4.check.inputs import check_config
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.engine.sampling import STREAM_DRAFT, draw
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.speculative import MAX_SPECULATIVE, Drafter, accept
from dsv4.ops.precision import exact_accumulation

LENGTHS = (5, 40, 23, 70, 1, 17)
NEW = 24


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4.from_config(check_config("tiny"), seed=0).eval()


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def run(model, prompts, params, arrivals=None, drafter=None, **config) -> tuple[list[list[int]], Engine]:
    cfg = dict(max_seqs=8, max_batch_tokens=64, page_size=16, deterministic=True)
    cfg.update(config)
    engine = Engine(model, EngineConfig(**cfg))
    if drafter is not None:
        engine.drafter = drafter(engine)
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_work():
        for i in [i for i in pending if arrivals is None or arrivals[i] <= step]:
            engine.add_request(str(i), prompts[i], params[i] if isinstance(params, list) else params)
            pending.remove(i)
        for out in engine.step():
            outs[int(out.request_id)].extend(out.new_tokens)
        step += 1
    return [outs[i] for i in range(len(prompts))], engine


def greedy(i: int = 0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, seed=i, **kw)


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation, wrong wherever `wrong(index)` says: the MTP block still runs
    (its cache is written as in a real run), only the proposals are replaced."""

    def __init__(self, engine: Engine, answers: list[list[int]], wrong):
        super().__init__(engine.model, engine.runner, engine.sampler)
        self.answers, self.wrong, self.vocab = answers, wrong, engine.vocab

    def __call__(self, hidden, rows):
        results = super().__call__(hidden, rows)
        out = []
        for r, (toks, _) in zip(rows, results):
            want = self.answers[r.seed][r.counter : r.counter + r.k]
            toks = [(t + 1) % self.vocab if self.wrong(r.counter + j) else t for j, t in enumerate(want)]
            q = torch.nn.functional.one_hot(torch.tensor(toks, dtype=torch.long), self.vocab).double()
            out.append((toks, q))
        return out


def plant(engine: Engine, answers: list[list[int]], wrong) -> OracleDrafter:
    """`OracleDrafter` for the eager steps, and the same drafts planted into every greedy row before each
    fixed-shape step (whose greedy variant reads only the draft tokens), replacing what the last step's
    device drafted."""
    steps, vocab = engine.spec, engine.vocab
    inner = steps._fixed

    def fixed(plan):
        for sch in plan:
            seq = sch.seq
            if seq.drafts and seq.params.greedy:
                c = seq.n_generated
                want = answers[seq.seed][c : c + len(seq.drafts)]
                seq.drafts = [(t + 1) % vocab if wrong(c + j) else t for j, t in enumerate(want)]
        return inner(plan)

    steps._fixed = fixed
    return OracleDrafter(engine, answers, wrong)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_gives_the_plain_tokens_with_drafts_accepted_and_rejected(model, prompts, k):
    params = [greedy(i) for i in range(len(prompts))]
    plain, _ = run(model, prompts, params)
    # every third draft index wrong: full acceptances, rejections at every depth of a verify, and (with
    # ratio 4 and 16 groups) rejected tokens that had completed a group or crossed a page
    spec, engine = run(
        model,
        prompts,
        params,
        arrivals=[0, 2, 3, 0, 7, 5],
        speculative=k,
        drafter=lambda e: OracleDrafter(e, plain, lambda i: i % 3 == 1),
    )
    assert spec == plain
    st = engine.spec_stats
    assert 0 < st["accepted"] < st["drafted"]
    assert engine.stats["steps"] < max(len(o) for o in plain) + len(prompts) * 4  # steps were saved
    assert engine.manager.free_pages()[0] == engine.layout.n_window_pages - 1  # every page came back


def test_real_mtp_drafts_change_no_token(model, prompts):
    params = [greedy(i) for i in range(len(prompts))]
    plain, _ = run(model, prompts, params)
    spec, engine = run(model, prompts, params, speculative=2, max_batch_tokens=13)
    assert spec == plain
    assert engine.spec_stats["drafted"] > 0


@pytest.mark.parametrize("pad", [False, True])
def test_sampled_speculation_is_reproducible_and_batch_invariant(model, prompts, pad):
    """Alone or in a busy batch, the same tokens. Padded (as on a GPU), the busy batch mixes steps of every
    kind: while the top-p request (eager steps only) runs, every step is eager; otherwise prompt chunks run
    bucketed and decodes in the fixed-shape step."""
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95 if i == 2 else 1.0, seed=50 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    alone = [
        run(model, [p], [params[i]], max_seqs=1, speculative=2, pad_steps=pad)[0][0] for i, p in enumerate(prompts)
    ]
    busy, engine = run(model, prompts, params, arrivals=[0, 2, 3, 0, 7, 5], speculative=2, pad_steps=pad)
    assert busy == alone
    assert (engine.spec_stats["fixed_steps"] > 0) == pad


def record_preemptions(monkeypatch) -> list[int]:
    """From now on, the number of drafts each sequence the scheduler preempts carries, in order."""
    carried: list[int] = []
    preempt = Scheduler.preempt

    def recording(self, seq):
        carried.append(len(seq.drafts))
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "preempt", recording)
    return carried


PRESSURE = [SamplingParams(max_tokens=40, temperature=1.0, seed=70 + i, ignore_eos=True) for i in range(4)]


@pytest.fixture(scope="module")
def pressure(model) -> tuple[list[list[int]], list[list[int]]]:
    """Four prompts of 15 tokens, and each one's tokens under `PRESSURE` alone (eager steps)."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, model.cfg.vocab_size, (15,), generator=g).tolist() for _ in range(4)]
    return prompts, [run(model, [p], [PRESSURE[i]], max_seqs=1, speculative=2)[0][0] for i, p in enumerate(prompts)]


@pytest.mark.parametrize("pad,overlap", [(False, False), (True, False), (True, True)])
def test_a_sampled_sequence_preempted_for_memory_keeps_its_solo_tokens(model, pressure, pad, overlap, monkeypatch):
    """Four sampled requests whose outputs outgrow a small cache: running sequences are preempted while they
    carry drafts. Each resumes where it was (recomputed up to its last token, its drafts kept, their logits
    too), so its next step verifies the drafts it would have verified without the preemption, and its
    tokens are its solo run's, on eager steps and on fixed-shape ones (sampled variant), overlapped or not.
    (Before, the recompute drew the next token plainly: another sample from there on.)"""
    prompts, alone = pressure
    carried = record_preemptions(monkeypatch)
    config = dict(speculative=2, pad_steps=pad, overlap=overlap, chunk_len=8, prefix_caching=False)
    tight, engine = run(model, prompts, PRESSURE, cache_pages=8, window_pages=10, **config)
    assert tight == alone
    assert any(carried) and engine.stats["preemptions"] == len(carried)
    assert (engine.spec_stats["fixed_steps"] > 0) == pad


def test_the_draft_is_the_training_mtp_head(model):
    """`draft` on the paged cache computes what the training path's MTP block computes (forward(mtp=True))."""
    g = torch.Generator().manual_seed(5)
    s = 37
    tokens = torch.randint(2, model.cfg.vocab_size, (1, s), generator=g)
    with exact_accumulation(True), torch.no_grad():
        want = model(tokens, mtp=True).mtp_logits[0][0]  # [s-1, V] predicts t+2
        cache = model.new_cache(1, 64)
        _, hidden = model.append(tokens, cache.step_inputs(tokens, static_start=0), cache.kv, return_hidden=True)
        head = tokens[:, :-1]
        got, _ = model.draft(hidden[: s - 1], tokens[:, 1:], cache.step_inputs(head, static_start=0), cache.kv)
    # both paths accumulate in float64 and round to fp32 once: a few fp32 ulps of the largest logit
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 16 * 2.0**-24 * max(scale, 1.0)


def test_acceptance_keeps_the_target_distribution():
    """Rejection sampling: whatever the draft distribution, the first emitted token follows p_0 and the
    second (given the first draft was kept) follows p_1. 200k rows: a 1% bias in any probability is over
    9 standard deviations (sd <= sqrt(0.25 / n)), the bound 4.5 sd."""
    V, n = 6, 200_000
    p = torch.tensor(
        [
            [0.30, 0.25, 0.20, 0.15, 0.07, 0.03],
            [0.05, 0.05, 0.40, 0.10, 0.30, 0.10],
            [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
        ],
        dtype=torch.float64,
    )
    q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.25, 0.25], [0.40, 0.10, 0.10, 0.10, 0.10, 0.20]], dtype=torch.float64)
    seeds = torch.arange(n, dtype=torch.long) * 7919 + 13
    counters = torch.full((n,), 5, dtype=torch.long)
    drafts = torch.stack([draw(q[j].expand(n, V), seeds, counters + j, STREAM_DRAFT) for j in range(2)], 1)
    kept, nxt = accept(p.expand(n, 3, V), q.expand(n, 2, V), drafts, torch.full((n,), 2), seeds, counters)
    first = torch.where(kept > 0, drafts[:, 0], nxt)
    sd = math.sqrt(0.25 / n)
    freq = torch.bincount(first, minlength=V).double() / n
    assert (freq - p[0]).abs().max() < 4.5 * sd, (freq, p[0])
    m = kept > 0
    second = torch.where(kept[m] > 1, drafts[m, 1], nxt[m])
    freq2 = torch.bincount(second, minlength=V).double() / m.sum()
    assert (freq2 - p[1]).abs().max() < 4.5 * math.sqrt(0.25 / int(m.sum())), (freq2, p[1])
    # the acceptance rate is sum_x min(p, q) per position, as the rule says
    rate = float((kept > 0).double().mean())
    assert abs(rate - float(torch.minimum(p[0], q[0]).sum())) < 4.5 * sd


def test_greedy_acceptance_is_argmax_matching():
    V = 8
    target = torch.nn.functional.one_hot(torch.tensor([[3, 5, 1, 2]]), V).double()  # argmax per position
    for drafts, kept_want, next_want in (([3, 5, 1], 3, 2), ([3, 4, 1], 1, 5), ([0, 5, 1], 0, 3)):
        d = torch.tensor([drafts])
        q = torch.nn.functional.one_hot(d, V).double()
        kept, nxt = accept(target, q, d, torch.tensor([3]), torch.tensor([1]), torch.tensor([0]))
        assert (int(kept), int(nxt)) == (kept_want, next_want)


def test_speculation_refuses_what_it_cannot_do(model):
    with pytest.raises(ValueError, match="speculative must be in"):
        Engine(model, EngineConfig(speculative=MAX_SPECULATIVE + 1))
    cfg = check_config("tiny")
    no_mtp = DeepSeekV4.from_config(
        dataclasses.replace(cfg, n_mtp_layers=0, compress_ratios=cfg.compress_ratios[: cfg.n_layers]), seed=0
    )
    with pytest.raises(ValueError, match="MTP block"):
        Engine(no_mtp, EngineConfig(speculative=1))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_fixed_shape_greedy_step_gives_the_plain_tokens(model, prompts, k):
    """The whole greedy speculative step at a fixed shape (what a CUDA graph replays: verify, acceptance,
    MTP catch-up and chained drafts on the device, one read per step), run eagerly here."""
    params = [greedy(i) for i in range(len(prompts))]
    plain, _ = run(model, prompts, params)
    spec, engine = run(model, prompts, params, arrivals=[0, 2, 3, 0, 7, 5], speculative=k, pad_steps=True)
    assert spec == plain
    assert engine.spec_stats["fixed_steps"] > 0
    # with oracle drafts (accepted except every third) the fixed-shape steps accept and roll back: planted
    # before each fixed-shape step (every greedy step is one here, prompt steps bucketed), as the eager
    # steps' drafter would propose them
    spec, engine = run(
        model,
        prompts,
        params,
        speculative=k,
        pad_steps=True,
        drafter=lambda e: plant(e, plain, lambda i: i % 3 == 1),
    )
    assert spec == plain
    st = engine.spec_stats
    assert st["fixed_steps"] > 0 and 0 < st["accepted"] < st["drafted"]


def run_logprobs(model, prompts, params, **config) -> tuple[list[list[tuple[int, float | None]]], Engine]:
    """`run`, each request's (token, its log-probability or None) in order."""
    engine = Engine(model, EngineConfig(**{**dict(max_seqs=8, max_batch_tokens=64, page_size=16), **config}))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i])
    outs: dict[int, list] = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            lps = out.new_logprobs or [None] * len(out.new_tokens)
            outs[int(out.request_id)] += [(t, lp.logprob if lp else None) for t, lp in zip(out.new_tokens, lps)]
    return [outs[i] for i in range(len(prompts))], engine


@pytest.mark.slow
def test_fixed_shape_sampled_step_gives_the_eager_steps_tokens(model, prompts):
    """Sampled rows (and greedy rows that want their log-probabilities) beside greedy ones in the fixed-shape
    step (what a CUDA graph replays), prompt chunks in bucketed steps that also run the MTP block's catch-up:
    the same tokens and log-probabilities as the eager speculative steps, which keep the target
    distribution (`test_acceptance_keeps_the_target_distribution`). While the top-p request runs, every
    step is eager (the fixed-shape step does not filter); before and after, the fixed-shape and bucketed
    ones: each path reads the drafts (and draft logits) the other made."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.8, seed=60, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=0.0, seed=61, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=NEW, temperature=1.3, seed=62, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=NEW, temperature=0.0, seed=63, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=64, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=0.5, seed=65, ignore_eos=True, logprobs=0),
    ]
    eager, plain = run_logprobs(model, prompts, params, deterministic=True, speculative=2)
    fixed, padded = run_logprobs(model, prompts, params, deterministic=True, speculative=2, pad_steps=True)
    assert plain.spec_stats["fixed_steps"] == 0 < padded.spec_stats["fixed_steps"]
    r = padded.runner
    assert 0 < r.padded_steps < r.eager_steps  # bucketed prompt steps, and eager (ragged) speculative steps
    assert [[t for t, _ in o] for o in fixed] == [[t for t, _ in o] for o in eager]
    for i, (a, b) in enumerate(zip(fixed, eager)):
        assert (params[i].logprobs is None) == (a[0][1] is None)
        # the verify's float32 logits come from two layouts of the same step (ragged rows, uniform rows),
        # whose reductions (blocked / pairwise sums of at most 2^10 terms here: vocabulary 1024, width 128)
        # may round differently, each by O(log2(n) eps) relative; both log-sum-exps are float64. 64 eps of
        # (1 + |log p|) bounds the sum of those with room to spare.
        eps = torch.finfo(torch.float32).eps
        for (_, x), (_, y) in zip(a, b):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 64 * eps * (1 + abs(y)))


@pytest.mark.parametrize("k", [1, 3])
def test_overlapped_fixed_shape_steps_give_the_same_tokens(model, prompts, k):
    """overlap=True (the CUDA default): a fixed-shape step of the same sequences is launched before the last
    one is read, each row fed on the device from what that step left (its next token, drafts, position and
    count; `ops.write_carry`). Greedy and sampled rows, some wanting log-probabilities, sequences that end by
    max_tokens or max_model_len inside a verify (the fed step then ran for nothing: its tokens are dropped):
    the same tokens and log-probabilities, bit for bit, as reading every step before the next (deterministic
    mode: a row computes the same way in any batch)."""
    # (the random draft's drafts survive mostly at high temperatures, where p and q are both near uniform:
    # full acceptances and bonus tokens, and verifies cut by max_tokens, happen there)
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.0, seed=70, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=5.0, seed=71, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=NEW, temperature=0.0, seed=72, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=NEW, temperature=5.0, seed=73, ignore_eos=True),  # 70 + 24 > max_model_len
        SamplingParams(max_tokens=3, temperature=0.0, seed=74, ignore_eos=True),
        SamplingParams(max_tokens=NEW - 1, temperature=5.0, seed=75, ignore_eos=True),
    ]
    cfg = dict(deterministic=True, speculative=k, pad_steps=True, max_model_len=82)
    read, e0 = run_logprobs(model, prompts, params, overlap=False, **cfg)
    fed, e1 = run_logprobs(model, prompts, params, overlap=True, **cfg)
    assert fed == read
    assert [len(o) for o in read] == [NEW, 7, NEW, 82 - 70, 3, NEW - 1]
    st = e1.spec_stats
    assert e0.spec_stats["fed_steps"] == 0 < st["fed_steps"] < st["fixed_steps"]
    assert st["accepted"] > 0 and st["verify_lengths"] == e0.spec_stats["verify_lengths"]
    assert not e1.has_work() and e1.manager.free_pages() == e0.manager.free_pages()  # every page back


def _staggered(model, prompts, params, arrivals, overlap: bool) -> tuple[list[list], Engine]:
    """Requests added before the steps `arrivals` names (step -> request indices), every step's outputs
    collected: -> (per request its (token, log-probability) pairs, the engine)."""
    cfg = dict(deterministic=True, speculative=2, pad_steps=True, max_seqs=3, max_batch_tokens=64, page_size=16)
    engine = Engine(model, EngineConfig(**cfg, chunk_len=8, overlap=overlap))
    outs: dict[int, list] = {i: [] for i in range(len(prompts))}
    step = 0
    while engine.has_work() or any(a > step for a in arrivals):
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompts[i], params[i])
        for out in engine.step():
            lps = out.new_logprobs or [None] * len(out.new_tokens)
            outs[int(out.request_id)] += [(t, lp.logprob if lp else None) for t, lp in zip(out.new_tokens, lps)]
        step += 1
    return [outs[i] for i in range(len(prompts))], engine


STAGGERED = [
    SamplingParams(max_tokens=NEW, temperature=t, seed=80 + i, ignore_eos=True, logprobs=0 if i % 3 else None)
    for i, t in enumerate((0.0, 5.0, 0.0, 1.0, 5.0, 0.0))
]


def test_a_new_request_joins_the_overlapped_steps(model, prompts):
    """A request that arrives while others decode (or waits for a free slot) starts without waiting for the
    device: its prompt runs in a step launched beside their fed fixed-shape step (`admitted`), and its first
    decode joins the next fed step from the carry that the prompt step left (`carried`), or with its own row
    (`joined`: a prompt of one token, a decode's row). The same tokens and log-probabilities, bit for bit, as
    reading every step before the next, every page back."""
    arrivals = {0: [0, 1], 6: [2], 9: [3], 14: [4, 5]}
    (read, e0), (fed, e1) = (_staggered(model, prompts, STAGGERED, arrivals, overlap) for overlap in (False, True))
    assert fed == read and all(len(o) == NEW for o in read)
    assert e0.spec_stats["joined"] == e0.spec_stats["admitted"] == e0.spec_stats["carried"] == 0
    st = e1.spec_stats
    assert st["joined"] > 0 and st["admitted"] > 0 and st["carried"] > 0
    assert st["fed_steps"] > 0 and st["fixed_steps"] <= st["fixed_rows"] <= 3 * st["fixed_steps"]  # max_seqs 3
    # (the runner counts them by shape for `bench engine`: batch buckets of rows of 1 + k tokens)
    assert sum(e1.runner.fixed_steps.values()) == st["fixed_steps"] and {s for _, s in e1.runner.fixed_steps} == {3}
    assert not e1.has_work() and e1.manager.free_pages() == e0.manager.free_pages()


def test_requests_that_end_at_their_first_token_or_cannot_join(model, prompts):
    """A request that ends at its first token (max_tokens = 1; here also a prefix-cache hit) was carried into
    a fed step that it takes nothing from; one that wants top log-probabilities is not admitted beside a fed
    step (the fixed-shape step does not take it) and waits for the schedule, whose steps are then eager. The
    same tokens and log-probabilities, bit for bit, as reading every step before the next (a token's numbers
    do not depend on which form of step computed it, nor on the batch), every page back."""
    prompts = prompts + [prompts[1][:30], prompts[3][:20]]
    params = STAGGERED + [
        SamplingParams(max_tokens=1, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=1.0, seed=8, ignore_eos=True, logprobs=2),
    ]
    arrivals = {0: [0, 1], 6: [2], 9: [3], 11: [6], 14: [4, 5], 24: [7]}
    (read, e0), (fed, e1) = (_staggered(model, prompts, params, arrivals, overlap) for overlap in (False, True))
    assert fed == read and [len(o) for o in read] == [NEW] * 6 + [1, NEW]
    assert e1.spec_stats["carried"] > 0
    assert not e1.has_work() and e1.manager.free_pages() == e0.manager.free_pages()


def test_parallel_samples_admitted_beside_a_fed_step(model, prompts):
    """A request for n = 3 samples that arrives while others decode: its siblings start one after another
    (the later ones from the prefix cache of the first's prompt) beside the fed steps, each with its own
    seed stream. Per (request, sample) the same tokens and log-probabilities, bit for bit, as reading every
    step before the next, every page back."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=1.0, seed=90 + i, ignore_eos=True, logprobs=0) for i in range(3)
    ]
    runs = []
    for overlap in (False, True):
        cfg = dict(deterministic=True, speculative=2, pad_steps=True, max_seqs=4, max_batch_tokens=64, page_size=16)
        engine = Engine(model, EngineConfig(**cfg, chunk_len=8, overlap=overlap))
        outs: dict[tuple[str, int], list] = {}
        step = 0
        while engine.has_work() or step < 8:
            if step == 0:
                engine.add_request("a", prompts[0], params[0])
                engine.add_request("b", prompts[2], params[1])
            if step == 7:
                engine.add_request("c", prompts[1][:40], params[2], n=3)
            for out in engine.step():
                outs.setdefault((out.request_id, out.index), []).extend(
                    (t, lp.logprob) for t, lp in zip(out.new_tokens, out.new_logprobs)
                )
            step += 1
        runs.append((outs, engine))
    (read, e0), (fed, e1) = runs
    assert fed == read and len(read) == 5 and all(len(o) == NEW for o in read.values())
    assert len({tuple(t for t, _ in read["c", i]) for i in range(3)}) == 3  # (three samples, not one)
    assert e1.spec_stats["admitted"] > 0
    assert not e1.has_work() and e1.manager.free_pages() == e0.manager.free_pages()


class RecordingDrafter(Drafter):
    """The MTP drafts as they are, each row's draft distributions q kept by (seed, counter)."""

    def __init__(self, engine: Engine):
        super().__init__(engine.model, engine.runner, engine.sampler)
        self.q: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, hidden, rows):
        results = super().__call__(hidden, rows)
        for r, (_, q) in zip(rows, results):
            if r.k:
                self.q[r.seed, r.counter] = q.cpu()
        return results


def test_a_prefix_another_request_computed_gives_the_same_drafts(model, prompts):
    """The MTP block's row at a position is computed from the token after it, so a window page's last row
    depends on the next page's first token: a prompt is served from another request's pages only where that
    token is its own too. A request after two that share its first page (one also its next token) drafts
    exactly as alone (every draft distribution, bit for bit), so its sampled tokens are its solo ones; its
    prefix comes from the request whose next token is its own. (Eager steps, where the drafts' distributions
    reach the host; the fixed-shape steps keep the same cache.)"""
    mine, other = prompts[3][:30], prompts[1]
    prompts = [mine[:16] + other[:10], mine[:17] + other[:12], mine]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=60 + i, ignore_eos=True) for i in range(3)]
    cfg = dict(speculative=2, page_size=16)
    alone, e0 = run(model, prompts[2:], params[2:], drafter=RecordingDrafter, **cfg)
    after, e1 = run(model, prompts, params, arrivals=[0, 0, 12], drafter=RecordingDrafter, **cfg)
    assert after[2] == alone[0] and len(alone[0]) == 8
    mine_q = {key: q for key, q in e1.drafter.q.items() if key[0] == params[2].seed}
    assert mine_q.keys() == e0.drafter.q.keys() and len(mine_q) > 0
    assert all(torch.equal(q, e0.drafter.q[key]) for key, q in mine_q.items())
    assert e1.manager.hits == 16  # (the first page, from the request whose next token is its own)


def test_a_tokens_numbers_do_not_depend_on_the_step_that_computed_them(model, prompts):
    """A request that wants top log-probabilities makes every step it is in an eager one (the fixed-shape step
    does not take it): the other requests' tokens and log-probabilities, computed there instead of in
    fixed-shape steps, and beside another batch, are the same bit for bit (every log-probability logit -
    logsumexp in float64 rounded to float32, as the plain draw's; the model batch-invariant under
    `deterministic`)."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=t, seed=80 + i, ignore_eos=True, logprobs=0)
        for i, t in enumerate((0.0, 5.0, 0.0, 1.0, 5.0, 0.0))
    ] + [SamplingParams(max_tokens=NEW, temperature=1.0, seed=8, ignore_eos=True, logprobs=2)]
    prompts = prompts + [prompts[3][:20]]
    (alone, e0), (beside, e1) = (
        _staggered(model, prompts, params, {0: [0, 1], 6: [2], 9: [3], 14: [4, 5], **extra}, overlap=False)
        for extra in ({}, {3: [6]})
    )
    assert beside[:6] == alone[:6] and all(len(o) == NEW for o in beside)
    assert 0 < e1.spec_stats["fixed_steps"] < e0.spec_stats["fixed_steps"]  # (eager steps in between)


def test_the_command_line_bound_is_the_engine_bound():
    from dsv4.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--speculative", str(MAX_SPECULATIVE + 1)])
    assert build_parser().parse_args(["generate", "x", "--speculative", str(MAX_SPECULATIVE)]).speculative == 15


@pytest.mark.parametrize("how", ["--no-mtp", "hf layout"])
def test_generate_speculative_without_a_draft_is_one_line_before_any_output(tmp_path, capsys, how):
    """A model with no draft - the shipped one under --no-mtp, or a transformers-layout copy, whose loader
    drops the MTP block - refuses --speculative in one line (exit 2) and prints nothing of the prompt."""
    from dsv4.checkpoint import convert
    from dsv4.cli import main
    from dsv4.loading import default_model_dir

    argv = ["generate", "def f():", "--speculative", "2", "--max-new-tokens", "2"]
    if how == "--no-mtp":
        argv.append("--no-mtp")
    else:
        convert(default_model_dir(), tmp_path / "hf", to="hf")
        argv += ["--model", str(tmp_path / "hf")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1] == (
        "error: --speculative drafts with the model's MTP block, and this model has none"
    )
