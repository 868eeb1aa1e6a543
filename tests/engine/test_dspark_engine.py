"""Speculative decoding with a DSpark draft in the engine must not change what a request computes.

Oracles as for the MTP draft (test_speculative.py): plain decoding by the same engine with speculation off
(greedy tokens equal, deterministic mode), sampled tokens that do not depend on the batch, and the
draft's own numbers (`Proposal`) for what the engine verifies. The tiny model is shrunk (window 16, ratios
4 and 16, pages of 16 positions) so that verifies cross page, window and compression-group boundaries;
its random draft rejects nearly every greedy draft, so an oracle drafter that proposes the known greedy
continuation with planted errors, and verify lengths of its own, exercises acceptance and rollback at
chosen places with verify lengths that differ between the sequences of a step.
"""

from __future__ import annotations

import pytest
import torch
from test_speculative import record_preemptions, run  # the engine driven step by step, arrivals staggered

from dsv4 import DeepSeekV4
from dsv4.check.goldens import FP32_TOL
from dsv4.check.inputs import check_config
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.engine.dspark_step import AnchorRow, DSparkDrafter
from dsv4.loading import speculative_problem
from dsv4.model.dspark import verify_length
from dsv4.ops.precision import exact_accumulation

LENGTHS = (5, 40, 23, 17)
NEW = 12


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4.from_config(check_config("tiny").with_draft("dspark"), seed=0).eval()


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, seed=i)


@pytest.fixture(scope="module")
def plain(model, prompts) -> list[list[int]]:
    return run(model, prompts, [greedy(i) for i in range(len(prompts))])[0]


class OracleDrafter(DSparkDrafter):
    """Proposes the known greedy continuation, wrong wherever `wrong(index)` says, and verifies
    `length(index)` drafts (capped by the sequence's limit): the draft still runs, only its proposals and
    verify lengths are replaced."""

    def __init__(self, engine: Engine, answers: list[list[int]], wrong, length):
        spec = engine.spec
        super().__init__(engine.model, engine.runner, engine.sampler, spec.k, spec.threshold)
        self.answers, self.wrong, self.length, self.vocab = answers, wrong, length, engine.vocab

    def __call__(self, rows: list[AnchorRow]):
        super().__call__(rows)
        out = []
        for r in rows:
            n = min(r.k, self.length(r.counter))
            want = self.answers[r.seed][r.counter : r.counter + n]
            out.append(([(t + 1) % self.vocab if self.wrong(r.counter + j) else t for j, t in enumerate(want)], None))
        return out


def test_greedy_dspark_gives_the_plain_tokens_with_drafts_accepted_and_rejected(model, prompts, plain):
    """Every third draft wrong and verify lengths 3, 1, 0, 2 by turns: acceptance at every depth, sequences
    of one step verifying different numbers of drafts (or none), rejected tokens that had completed a
    group or crossed a page, in a busy batch with arrivals and prompt chunks beside the verifies."""
    params = [greedy(i) for i in range(len(prompts))]
    spec, engine = run(
        model,
        prompts,
        params,
        arrivals=[0, 2, 3, 1],
        speculative=3,
        max_batch_tokens=24,
        drafter=lambda e: OracleDrafter(e, plain, lambda i: i % 3 == 1, lambda i: (3, 1, 0, 2)[i % 4]),
    )
    assert spec == plain
    st = engine.spec_stats
    assert 0 < st["accepted"] < st["drafted"]
    assert [n for n in range(4) if st["verify_lengths"][n]] == [0, 1, 2, 3]
    assert sum(st["verify_lengths"][1:]) == st["verify_steps"]
    assert sum(n * c for n, c in enumerate(st["verify_lengths"])) == st["drafted"]
    assert engine.stats["steps"] < NEW + len(prompts) * 4  # steps were saved
    assert engine.manager.free_pages()[0] == engine.layout.n_window_pages - 1  # every page came back


def test_fixed_shape_steps_with_the_confidence_head_give_the_plain_tokens(model, prompts, plain):
    """The whole greedy step at a fixed shape (what a CUDA graph replays: verify, argmax acceptance, the
    context, the next block and its verify length on the device, one read per step), run eagerly here; the
    confidence head picks the verify lengths of the blocks drafted on the device, the oracle those of the
    eager steps (with prompt chunks); a step's width is its longest verify and shorter rows are padded."""
    params = [greedy(i) for i in range(len(prompts))]
    fixed: list[tuple[list[int], int]] = []  # per fixed step: its rows' verify lengths, drafts accepted

    def spy(engine: Engine) -> OracleDrafter:
        steps = engine.spec
        inner = steps._fixed

        def greedy_fixed(plan):
            before = steps.stats["accepted"]
            lengths = [len(sch.seq.drafts) for sch in plan]
            out = inner(plan)
            fixed.append((lengths, steps.stats["accepted"] - before))
            return out

        steps._fixed = greedy_fixed
        return OracleDrafter(engine, plain, lambda i: i % 3 == 2, lambda i: 4 - i % 3)

    spec, engine = run(
        model,
        prompts,
        params,
        arrivals=[0, 2, 3, 1],
        speculative=4,
        speculative_threshold=0.3,
        pad_steps=True,
        chunk_len=16,
        drafter=spy,
    )
    assert spec == plain
    assert len(fixed) == engine.spec_stats["fixed_steps"] > 0
    assert sum(a for _, a in fixed) > 0  # fixed steps kept drafts
    assert any(len(set(lengths)) > 1 for lengths, _ in fixed)  # rows padded to the widest
    assert len({n for lengths, _ in fixed for n in lengths}) >= 3


def test_the_real_draft_changes_no_token(model, prompts, plain):
    params = [greedy(i) for i in range(len(prompts))]
    spec, engine = run(model, prompts, params, speculative=5, speculative_threshold=0.3, max_batch_tokens=13)
    assert spec == plain
    assert engine.spec_stats["drafted"] > 0


class RecordingDrafter(DSparkDrafter):
    """The real drafter, recording each proposal: (anchor position, request index, the whole block)."""

    def __init__(self, engine: Engine, log: list):
        spec = engine.spec
        super().__init__(engine.model, engine.runner, engine.sampler, spec.k, spec.threshold)
        self.log = log

    def propose(self, rows: list[AnchorRow]):
        prop, qs = super().propose(rows)
        for b, r in enumerate(rows):
            self.log.append((r.position, r.seed, prop.tokens[b], prop.logits[b], prop.confidence[b]))
        return prop, qs


@pytest.mark.parametrize("fixed", [False, True])
def test_the_engine_drafts_what_the_whole_sequence_draft_drafts(model, prompts, plain, fixed):
    """The draft's context in the engine is every position's, as if computed once: each block the engine
    proposes (after prompt chunks, and after verifies whose rejected drafts wrote context that the next
    verify replaced) equals the block the whole-sequence path drafts at that anchor from the final tokens
    (`sequence_blocks`, one forward with taps, no cache). The fixed-shape step's blocks (drafted on the
    device) are checked by their tokens."""
    which = (1, 3)
    log: list = []
    seen: list = []  # fixed steps: (position, request, drafts kept)

    def record(engine: Engine) -> RecordingDrafter:
        steps = engine.spec
        inner = steps._fixed

        def greedy_fixed(plan):
            out = inner(plan)
            seen.extend((sch.seq.computed, sch.seq.seed, list(sch.seq.drafts)) for sch in plan if sch.seq.running)
            return out

        steps._fixed = greedy_fixed
        return RecordingDrafter(engine, log)

    params = [greedy(i) for i in which]
    run(
        model,
        [prompts[i] for i in which],
        params,
        speculative=5,
        max_batch_tokens=24,
        pad_steps=fixed,
        chunk_len=16,
        drafter=record,
    )
    assert log and (seen or not fixed)
    d = model.dspark
    for i in which:
        full = torch.tensor([prompts[i] + plain[i]])  # [1, S]
        mine = [x for x in log if x[1] == i]
        assert mine
        at = sorted({x[0] for x in mine} | {x[0] for x in seen if x[1] == i})
        with torch.no_grad(), exact_accumulation(True):
            taps = model(full, taps=True).taps
            anchors = torch.tensor([at])
            want = d.chain(d.sequence_blocks(taps, full, anchors), full[0, anchors[0]])
        ref = {p: j for j, p in enumerate(at)}
        for p, _, toks, logits, conf in mine:
            j = ref[p]
            scale = want.logits[j].abs().max()
            assert (logits - want.logits[j]).abs().max() <= FP32_TOL * scale, p
            assert (conf - want.confidence[j]).abs().max() <= FP32_TOL * want.confidence[j].abs().max().clamp_min(1)
            assert torch.equal(toks, want.tokens[j]), p
        for p, _, drafts in (x for x in seen if x[1] == i):
            assert drafts == want.tokens[ref[p], : len(drafts)].tolist(), p


def test_sampled_dspark_is_reproducible_and_batch_invariant(model, prompts):
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=50 + i, ignore_eos=True) for i in range(3)]
    params[1] = SamplingParams(max_tokens=8, temperature=1.0, top_k=40, seed=51, ignore_eos=True, logprobs=2)
    alone = [
        run(model, [prompts[i]], [params[i]], max_seqs=1, speculative=3, speculative_threshold=0.2)[0][0]
        for i in range(3)
    ]
    busy, engine = run(model, prompts[:3], params, arrivals=[0, 2, 1], speculative=3, speculative_threshold=0.2)
    assert busy == alone
    st = engine.spec_stats
    assert 0 < st["accepted"] < st["drafted"]  # sampled drafts of a random model: some kept, some not


def test_a_sampled_sequence_preempted_for_memory_keeps_its_solo_tokens(model, monkeypatch):
    """Four sampled requests outgrowing a small cache (test_speculative.py's test of the same name): a
    sequence preempted with drafts is recomputed up to its last token, proposes its block again from the
    same context there, and its tokens are its solo run's."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, model.cfg.vocab_size, (15,), generator=g).tolist() for _ in range(4)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=70 + i, ignore_eos=True) for i in range(4)]
    alone = [run(model, [p], [params[i]], max_seqs=1, speculative=2)[0][0] for i, p in enumerate(prompts)]
    carried = record_preemptions(monkeypatch)
    tight, _ = run(model, prompts, params, speculative=2, cache_pages=8, window_pages=10, prefix_caching=False)
    assert tight == alone and any(carried)


def test_the_drafter_verifies_what_it_drew_from_the_sampler(model, prompts):
    """q of each draft is the engine sampler's distribution of the draft's logits with the request's
    settings (what rejection sampling needs), each draft has q > 0 there, and the verify length is the
    confidence head's (capped by the sequence's limit)."""
    engine = Engine(
        model,
        EngineConfig(
            max_seqs=2, max_batch_tokens=64, page_size=16, deterministic=True, speculative=4, speculative_threshold=0.3
        ),
    )
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_k=50, seed=3)
    for i, (p, params) in enumerate(zip(prompts[1:3], (sampled, greedy(1)))):
        engine.add_request(str(i), p, params)
    engine.step()  # both prompts computed: the drafter ran
    seqs = engine.running
    rows = [
        AnchorRow(s.tokens[-1], s.computed, s.pages.state, 4 - 2 * i, s.params, s.seed, s.n_generated)
        for i, s in enumerate(seqs)
    ]
    drafter = engine.drafter
    with exact_accumulation(True):
        prop, qs = drafter.propose(rows)
        got = drafter(rows)
    n = verify_length(prop.confidence, 0.3, 4).tolist()
    for b, (toks, q) in enumerate(got):
        assert len(toks) == min(n[b], rows[b].k)
        assert toks == prop.tokens[b, : len(toks)].tolist()
        if rows[b].params.greedy:
            assert q is None and toks == prop.logits[b, : len(toks)].argmax(-1).tolist()
        else:
            want = engine.sampler.probabilities(prop.logits[b, : len(toks)], [rows[b].params] * len(toks))
            assert torch.equal(q, want) and (q.gather(1, torch.tensor(toks).unsqueeze(1)) > 0).all()
            assert torch.allclose(q.sum(-1), torch.ones(len(toks), dtype=torch.float64))
    assert len(qs) == 4  # the first k slots' q, drawn from the sampler


def test_dspark_refuses_what_it_cannot_do(model):
    B = model.cfg.dspark_block_size
    with pytest.raises(ValueError, match="block size"):
        Engine(model, EngineConfig(speculative=B + 1))
    with pytest.raises(ValueError, match="speculative_threshold must be in"):
        Engine(model, EngineConfig(speculative=2, speculative_threshold=1.5))
    assert speculative_problem(model.cfg, B) is None and "block" in speculative_problem(model.cfg, B + 1)
    mtp = check_config("tiny")
    assert "confidence head" in speculative_problem(mtp, 2, 0.5)
    assert speculative_problem(mtp, 2) is None and "--speculative K" in speculative_problem(mtp, 0, 0.5)
    with pytest.raises(ValueError, match="confidence head"):
        Engine(DeepSeekV4.from_config(mtp, seed=0), EngineConfig(speculative=2, speculative_threshold=0.5))
