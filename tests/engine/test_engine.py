"""The serving engine: continuous batching over the paged cache must not change what a request computes.

Oracles: the full-sequence forward (a different code path: no cache at all) for greedy tokens and
logprobs, and the same request run alone for batch invariance (deterministic mode: float64 accumulation,
so a row's numbers do not depend on the rows around it). The tiny model is shrunk (window 16, heavy
compression ratio 16) and pages hold 16 positions, so short sequences cross window, page, chunk and
compression-group boundaries many times.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from dsv4 import DeepSeekV4
from dsv4.check.inputs import check_config
from dsv4.engine import Engine, EngineConfig, RequestError, SamplingParams
from dsv4.engine.engine_process import pack_outputs, unpack_outputs
from dsv4.engine.sequence import StepOutput
from dsv4.ops.precision import exact_accumulation

LENGTHS = (5, 40, 23, 70, 1, 17)
NEW = 8


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4.from_config(check_config("tiny"), seed=0).eval()


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def run(model, prompts, params, arrivals=None, **config) -> tuple[list[list[int]], Engine, dict]:
    """Drive an engine to completion; request i is added at step arrivals[i] (default: all at once)."""
    cfg = dict(max_seqs=8, max_batch_tokens=64, page_size=16, deterministic=True)
    cfg.update(config)
    engine = Engine(model, EngineConfig(**cfg))
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logprobs: dict[int, list] = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_work():
        for i in [i for i in pending if arrivals is None or arrivals[i] <= step]:
            engine.add_request(str(i), prompts[i], params[i] if isinstance(params, list) else params)
            pending.remove(i)
        for out in engine.step():
            outs[int(out.request_id)].extend(out.new_tokens)
            logprobs[int(out.request_id)].extend(out.new_logprobs)
        step += 1
    return [outs[i] for i in range(len(prompts))], engine, logprobs


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, **kw)


def full_logits(model, prompt, generated) -> torch.Tensor:
    """Logits predicting each generated token, from one full-sequence forward (no cache)."""
    with exact_accumulation(True), torch.no_grad():
        seq = torch.tensor([prompt + generated])
        return model(seq).logits[0, len(prompt) - 1 : -1]  # [NEW, V]


def test_greedy_tokens_follow_the_full_forward(model, prompts):
    outs, engine, lps = run(model, prompts, greedy(logprobs=3), max_batch_tokens=13)
    assert engine.metrics()["steps"] > len(prompts)  # prompts were chunked
    for p, o, lp in zip(prompts, outs, lps.values()):
        assert len(o) == NEW
        logits = full_logits(model, p, o)
        ref_lp = torch.log_softmax(logits.double(), -1)
        for t, tok in enumerate(o):
            # the engine's token is the full forward's argmax, up to a tie within the two paths' rounding
            # (both accumulate in float64, rounded once to fp32: a few fp32 ulps of the logits)
            best = logits[t].max()
            assert logits[t, tok] >= best - 1e-5 * best.abs().clamp_min(1), (t, tok, int(logits[t].argmax()))
            assert abs(lp[t].logprob - float(ref_lp[t, tok])) < 1e-4
            assert [i for i, _ in lp[t].top] == ref_lp[t].topk(3).indices.tolist() or abs(
                lp[t].top[-1][1] - float(ref_lp[t].topk(3).values[-1])
            ) < 1e-4


def test_a_step_that_completes_no_compression_group_pools_nothing(model):
    """An unpadded decode step pools (`ops.pool_groups`) only where its token completes a group of some
    compressing layer: position p + 1 a multiple of that layer's ratio. The others used to pool, norm, rope
    and round-trip empty tensors (8% of a CPU decode step of the shipped model)."""
    from dsv4 import ops

    ratios = {r for r in model.cfg.compress_ratios if r > 1}
    engine = Engine(model, EngineConfig(max_seqs=1, prefix_caching=False))
    engine.add_request("a", list(range(2, 9)), SamplingParams(max_tokens=3 * max(ratios), ignore_eos=True))
    engine.step()  # the prompt
    pooled = []
    while engine.has_work():
        seq = engine.running[0] if engine.running else None
        p = seq.computed if seq is not None else None
        before = ops.calls().get(("pool_groups", "reference"), 0)
        engine.step()
        if p is not None:
            pooled.append((p, ops.calls().get(("pool_groups", "reference"), 0) - before))
    assert all((n > 0) == any((p + 1) % r == 0 for r in ratios) for p, n in pooled), pooled
    assert any(n > 0 for _, n in pooled) and any(n == 0 for _, n in pooled)


@pytest.mark.parametrize("sampled", [False, True])
def test_batching_does_not_change_tokens(model, prompts, sampled):
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, ignore_eos=True)
        if sampled
        else greedy()
        for i in range(len(prompts))
    ]
    alone = [run(model, [p], [params[i]], max_seqs=1)[0][0] for i, p in enumerate(prompts)]
    busy, engine, _ = run(model, prompts, params, arrivals=[0, 2, 3, 0, 7, 5], max_batch_tokens=11)
    other, _, _ = run(model, prompts[::-1], params[::-1], max_batch_tokens=37, page_size=32)
    assert busy == alone
    assert other[::-1] == alone
    assert engine.manager.free_pages()[0] == engine.layout.n_window_pages - 1  # every page came back


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chunks_longer_than_the_raw_rows_kept_write_only_those(model, prefix_caching):
    """Slots of 48 tokens hold more than the compressors keep (a ring of 24 rows at ratio 4, 32 at ratio
    16, and with prefix caching ratio 4's last group of each 16-position page): the bucket lists the
    tokens that may leave raw rows and only those are written. Tokens and pages must equal the ragged
    steps', also for requests that resume from a cached prefix (their ring rows restored from the page
    tails) and for chunks that end a few tokens into a slot (the ring's rows then straddle two slots).
    The first request's first chunk runs past the shared prefix's last page end by more than a ring:
    that page's tail is written only because the bucket lists it."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(2, model.cfg.vocab_size, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (50, 29, 3)]
    prompts += [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (97, 5, 49)]
    kw = dict(arrivals=[0, 6, 9, 0, 2, 3], max_batch_tokens=100, chunk_len=48, prefix_caching=prefix_caching)
    plain, _, _ = run(model, prompts, greedy(), **kw)
    padded, engine, _ = run(model, prompts, greedy(), pad_steps=True, **kw)
    # the narrowed writes ran: ratio 4 keeps 2 x 4 + 16 ring rows (+ 4 per page end), ratio 16 16 + 16
    assert {k.ratio: k.per_slot for k in engine.runner.keep} == {4: 40 if prefix_caching else 24, 16: 32}
    assert padded == plain
    if prefix_caching:
        assert engine.manager.hits > 0
    assert engine.manager.free_pages()[0] == engine.layout.n_window_pages - 1


def test_deterministic_steps_multiply_in_float64_also_for_a_bf16_model(prompts):
    """Deterministic mode leaves no matrix product to torch in bf16 or fp32, whatever the model's dtype: such
    a product sums in an order that the device's GEMM picks by the row count, so a request's numbers would
    follow the batch on a GPU (cuBLAS chooses its kernel per shape). On the CPU every product is rounded
    once from float64 (on a GPU the dense projections take the fixed-plan GEMM, `tests/ops/
    test_fixed_gemm.py`). Every matmul of the engine's steps, prompt chunks and decode rows of two
    requests, is checked."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    products = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes: list[tuple[str, torch.dtype]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in products:
                self.dtypes += [(str(func), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    bf16 = DeepSeekV4.from_config(check_config("tiny"), seed=0, dtype=torch.bfloat16).eval()
    engine = Engine(bf16, EngineConfig(max_seqs=2, max_batch_tokens=24, page_size=16, deterministic=True))
    for i, p in enumerate(prompts[1:3]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    with Products() as seen:
        while engine.has_work():
            engine.step()
    assert {func for func, _ in seen.dtypes} >= {"aten.mm.default", "aten.bmm.default"}
    assert {(func, d) for func, d in seen.dtypes if d != torch.float64} == set()


def test_prefix_cache_reuses_pages_and_changes_nothing(model):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, model.cfg.vocab_size, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 20)]
    plain, _, _ = run(model, prompts, greedy(), prefix_caching=False)
    cached, engine, _ = run(model, prompts, greedy(), arrivals=[0, 4, 6], prefix_caching=True)
    assert cached == plain
    # 40 shared tokens = 2 complete pages of 16: requests 2 and 3 reuse 32 positions each
    assert engine.manager.hits == 64


def test_preemption_recomputes_the_same_tokens(model):
    # four one-page prompts that each grow to three pages: 8 compressed pages hold the prompts, not the
    # outputs, so running sequences get preempted, recomputed from their tokens, and must not notice
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, model.cfg.vocab_size, (15,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain, _, _ = run(model, prompts, params)
    tight, engine, _ = run(model, prompts, params, cache_pages=8, prefix_caching=False)
    assert engine.stats["preemptions"] > 0
    assert tight == plain


@pytest.mark.parametrize("speculative", [0, 2])
def test_a_sequence_the_cache_cannot_hold_even_alone_is_an_error_not_a_loop(model, speculative):
    """4 compressed pages hold 64 positions; a request growing past them with nothing else running cannot
    go on. Its prompt chunks and first pages fit, so admission takes it; when its next row needs a page it
    would preempt itself and be recomputed forever (it did, before). It is one clear error instead. (The
    server refuses such a request at admission: `dsv4.serve.capacity`.)"""
    engine = Engine(
        model,
        EngineConfig(max_seqs=2, max_batch_tokens=64, page_size=16, cache_pages=4, window_pages=4,
                     prefix_caching=False, speculative=speculative, max_model_len=120),
    )  # fmt: skip
    engine.add_request("a", list(range(2, 17)), SamplingParams(max_tokens=100, temperature=1.0, ignore_eos=True))
    with pytest.raises(RuntimeError, match="cannot hold a sequence of .* positions even alone"):
        for _ in range(200):
            engine.step()
    assert engine.stats["preemptions"] == 0


def test_abort_and_finish_free_every_page(model, prompts):
    engine = Engine(model, EngineConfig(max_seqs=4, page_size=16, max_batch_tokens=32))
    free = engine.manager.free_pages()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy())
    for _ in range(3):
        engine.step()
    assert engine.running and engine.waiting
    for i in range(len(prompts)):
        engine.abort(str(i))
    assert not engine.has_work() and not engine.requests
    assert engine.manager.free_pages() == free and len(engine.manager.free_states) == 4


def test_stops_and_choices(model, prompts):
    outs, _, _ = run(model, prompts[:2], greedy())
    stop_at = outs[0][3]
    o, _, _ = run(model, prompts[:1], SamplingParams(max_tokens=NEW, temperature=0, stop_token_ids=[stop_at]))
    assert o[0] == outs[0][: outs[0].index(stop_at) + 1]
    engine = Engine(model, EngineConfig(max_seqs=4, page_size=16))
    engine.add_request("r", prompts[1], SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True), n=3)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_work():
        for out in engine.step():
            got[out.index].extend(out.new_tokens)
    assert all(len(v) == 5 for v in got.values()) and len({tuple(v) for v in got.values()}) > 1


def test_a_request_whose_choices_all_end_by_stop_string_is_forgotten(model, prompts):
    """abort_sequence (a stop string found in a choice's text) on the last live choice forgets the
    request: its pages are free, nothing of it stays in the engine, and the step loop ends."""
    engine = Engine(model, EngineConfig(max_seqs=4, page_size=16))
    engine.add_request("r", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True), n=2)
    engine.step()
    engine.abort_sequence("r", 0)
    assert "r" in engine.requests  # choice 1 still runs
    engine.abort_sequence("r", 1)
    assert "r" not in engine.requests
    for _ in range(3):  # an overlapped step in flight is read, and nothing more comes of the request
        engine.step()
    assert not engine.has_work() and not engine.requests


def test_requests_that_cannot_be_served_are_refused(model):
    engine = Engine(model, EngineConfig(max_seqs=2, max_model_len=64, page_size=16))
    with pytest.raises(RequestError, match="context"):
        engine.add_request("a", [5] * 64, greedy())
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("b", [], greedy())
    with pytest.raises(RequestError, match="vocabulary|token ids"):
        engine.add_request("c", [model.cfg.vocab_size], greedy())
    with pytest.raises(RequestError, match="n must be"):
        engine.add_request("d", [5], greedy(), n=99)
    with pytest.raises(RequestError, match="tokenizer"):
        engine.add_request("e", [5], SamplingParams(stop=["x"]))
    for bad in (
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(top_p=0),
        dict(top_k=-1),
        dict(max_tokens=0),
        dict(logprobs=99),
        dict(presence_penalty=3),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not engine.has_work()


def test_overlapped_steps_give_the_same_tokens(model, prompts):
    """overlap=True (the CUDA default: a step is launched before the last one's tokens are read, its
    decode inputs taken from the device) changes nothing a request sees: tokens, stop tokens, choices,
    preemption, and a request stopping one step earlier than the one launched after it."""
    sampled = [
        SamplingParams(max_tokens=NEW, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(len(prompts))
    ]
    for params in (greedy(), sampled):
        sync, _, _ = run(model, prompts, params, arrivals=[0, 2, 3, 0, 7, 5], max_batch_tokens=11)
        over, engine, _ = run(model, prompts, params, arrivals=[0, 2, 3, 0, 7, 5], max_batch_tokens=11, overlap=True)
        assert over == sync
        assert engine.manager.free_pages()[0] == engine.layout.n_window_pages - 1
    stop_at = sync[1][2]
    stopping = SamplingParams(max_tokens=NEW, temperature=0.9, seed=101, stop_token_ids=[stop_at])
    a, _, _ = run(model, prompts[1:2], stopping)
    b, _, _ = run(model, prompts[1:2], stopping, overlap=True)
    assert a == b and a[0][-1] == stop_at and len(a[0]) <= NEW
    g = torch.Generator().manual_seed(4)
    tight = [torch.randint(2, model.cfg.vocab_size, (15,), generator=g).tolist() for _ in range(4)]
    long = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain, _, _ = run(model, tight, long)
    over, engine, _ = run(model, tight, long, cache_pages=8, prefix_caching=False, overlap=True)
    assert engine.stats["preemptions"] > 0 and over == plain


def test_overlap_waits_for_the_tokens_that_decide_the_next_draw(model, prompts):
    """A penalized row's draw counts its last token: a step after one that sampled such a row waits for
    that step's tokens. With overlap, penalized requests beside plain ones, arriving at other steps, get
    the tokens they get without it. (A negative frequency penalty makes a random model repeat the tokens
    it drew, so whether the last one is counted decides the next: a stale count changes the text.)"""
    params = [
        SamplingParams(
            max_tokens=NEW,
            temperature=0.0 if i % 2 else 0.9,
            seed=200 + i,
            ignore_eos=True,
            frequency_penalty=-2.0 if i % 2 else 0.0,
            repetition_penalty=1.5 if i % 3 == 0 else 1.0,
        )
        for i in range(len(prompts))
    ]
    assert any(p.penalized for p in params) and not all(p.penalized for p in params)
    sync, _, _ = run(model, prompts, params, arrivals=[0, 2, 3, 0, 7, 5], max_batch_tokens=11)
    over, _, _ = run(model, prompts, params, arrivals=[0, 2, 3, 0, 7, 5], max_batch_tokens=11, overlap=True)
    assert over == sync


@pytest.mark.parametrize("sampled,logprobs", [(False, 2), (True, 2), (True, None)])
def test_bucketed_steps_give_the_ragged_steps_numbers(model, prompts, sampled, logprobs):
    """Steps padded to buckets - what a GPU replays from one CUDA graph per bucket: one-token rows, prompt
    chunks in fixed slots of chunk_len tokens, padding that belongs to a row without pages - give the
    ragged steps' tokens bit for bit (deterministic mode), across chunk, page and compression-group
    boundaries, with rows arriving while others decode; with and without the plain draw that the bucket's
    graph holds (no logprobs alternatives: every out row drawn in the step itself)."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.9, seed=100 + i, ignore_eos=True, logprobs=logprobs)
        if sampled
        else greedy(logprobs=logprobs)
        for i in range(len(prompts))
    ]
    kw = dict(arrivals=[0, 2, 3, 0, 7, 5], max_batch_tokens=40, chunk_len=8)
    plain, ragged, lp_plain = run(model, prompts, params, **kw)
    padded, engine, lp_padded = run(model, prompts, params, pad_steps=True, **kw)
    assert padded == plain
    # every hidden state is the same; the head's matmul may reduce in another order for another number of
    # rows (BLAS blocking), so a logit may differ by one fp32 rounding: a log-probability lp = z - lse by
    # at most two roundings of numbers no larger than |lp| + log V (lse <= max z + log V)
    bound = 2 * torch.finfo(torch.float32).eps
    for a, b in zip(lp_plain.values(), lp_padded.values()):
        assert [x.token for x in a] == [x.token for x in b]
        for x, y in zip(a, b):
            for (i, u), (j, v) in zip([(x.token, x.logprob), *x.top], [(y.token, y.logprob), *y.top]):
                tol = bound * (abs(u) + math.log(model.cfg.vocab_size) + 1)
                assert (i == j or abs(u - v) <= tol) and abs(u - v) <= tol
    assert engine.runner.padded_steps == engine.stats["steps"] and ragged.runner.padded_steps == 0
    assert engine.stats["steps"] == ragged.stats["steps"]  # the same plan, padded


def test_a_burst_of_prompts_in_one_prefill_bucket_gives_the_same_tokens(model, prompts):
    """Six prompts arriving at once, no stream decoding yet: with max_prefill_tokens = 128 the first step
    takes all of them (16 slots of 8 tokens, the longer prompts in chunks of at most max_batch_tokens, 32)
    in a bucket of prompts alone beyond the largest decode-step bucket (4 slots); the tokens are the
    ragged steps' bit for bit (deterministic mode), and the burst took fewer steps. A prefill budget
    below max_batch_tokens is refused."""
    kw = dict(max_batch_tokens=34, chunk_len=8)
    plain, ragged, _ = run(model, prompts, greedy(), **kw)
    burst, engine, _ = run(model, prompts, greedy(), pad_steps=True, max_prefill_tokens=128, **kw)
    assert burst == plain
    assert engine.runner.slot_sizes[-1] == 4 and engine.runner.prefill_sizes == [6, 8, 12, 16]
    assert engine.runner.bucket_steps[0, 16] == 1  # the first step: every prompt (1+4+3+4+1+3 slots)
    assert max(c for d, c in engine.runner.bucket_steps if d) <= 4  # beside decode rows: the usual budget
    assert engine.stats["steps"] < ragged.stats["steps"]
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(model, EngineConfig(max_seqs=2, max_batch_tokens=64, max_prefill_tokens=32))


@pytest.mark.parametrize("speculative", [0, 2])
def test_a_burst_that_finds_streams_decoding_gives_the_same_tokens(model, prompts, speculative):
    """Two short prompts first, then the other four (their prompts overflow what a step beside two decode
    rows takes): the step after their arrival is theirs alone, in a bucket of prompts alone, and the
    tokens are the ragged steps' bit for bit (deterministic mode), with MTP drafts verified too."""
    order = [4, 0, 1, 2, 3, 5]  # the one-token and the five-token prompt first
    ps, arrivals = [prompts[i] for i in order], [0, 0, 2, 2, 2, 2]
    kw = dict(max_batch_tokens=34, chunk_len=8)
    plain, _, _ = run(model, ps, greedy(), arrivals, **kw)
    burst, engine, _ = run(
        model, ps, greedy(), arrivals, pad_steps=True, max_prefill_tokens=128, speculative=speculative, **kw
    )
    assert burst == plain
    assert engine.stats["burst_steps"] == 1
    assert engine.runner.bucket_steps[0, 16] == 1  # 4 + 3 + 4 + 3 slots (chunks of at most 32 tokens)


@pytest.mark.parametrize("speculative", [0, 2])
def test_a_burst_step_changes_no_sampled_token(model, prompts, speculative):
    """The same burst with seeded sampling, steps launched before the last one's tokens are read (a decode
    row left out while its token is still on the device) and, with drafts, rejection sampling: every token
    is the one the same engine draws without the burst's step."""
    ps, arrivals = [prompts[i] for i in [4, 0, 1, 2, 3, 5]], [0, 0, 2, 2, 2, 2]
    params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True)
    kw = dict(max_batch_tokens=34, chunk_len=8, pad_steps=True, overlap=True, speculative=speculative)
    without, plain_engine, _ = run(model, ps, params, arrivals, **kw)
    burst, engine, _ = run(model, ps, params, arrivals, max_prefill_tokens=128, **kw)
    assert burst == without
    assert (plain_engine.stats["burst_steps"], engine.stats["burst_steps"]) == (0, 1)


def test_a_bucket_filled_to_the_last_token_gives_the_ragged_steps_numbers(model, monkeypatch):
    """A bucket holds D + C x L tokens and no spare padding token: in a step that fills every decode row
    and every slot, the lists' unfilled entries name real tokens of their own slot. Such steps give the
    ragged steps' tokens bit for bit (deterministic mode), and such steps happen here."""
    import dsv4.engine.runner as runner_mod

    full = []
    fill = runner_mod.fill_bucket

    def watch(b, decode, chunks, v, pad_trow):
        rows = fill(b, decode, chunks, v, pad_trow)
        used = sum(-(-len(r.tokens) // b.slot_len) for r in chunks)
        tight = all(len(r.tokens) % b.slot_len == 0 for r in chunks)
        full.append(len(decode) == b.decode and used == b.slots and tight and b.slots > 0 and b.decode > 0)
        assert b.tokens == b.decode + b.slots * b.slot_len
        assert all((v[name] < b.tokens).all() for name in v if name[0] in "gk" or name == "out")
        return rows

    monkeypatch.setattr(runner_mod, "fill_bucket", watch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, model.cfg.vocab_size, (16,), generator=g).tolist() for _ in range(4)]
    kw = dict(arrivals=[0, 0, 3, 3], max_batch_tokens=34, chunk_len=8)
    plain, _, _ = run(model, prompts, greedy(), **kw)
    padded, engine, _ = run(model, prompts, greedy(), pad_steps=True, **kw)
    assert padded == plain and engine.runner.padded_steps == engine.stats["steps"]
    assert any(full), "no step filled its bucket: the test does not test what it says"


def test_each_sequence_first_output_says_how_long_it_queued_and_prefilled(model, prompts):
    # one seat: the second request waits for the first to finish, so its queue holds the first's whole run
    engine = Engine(model, EngineConfig(max_seqs=1, page_size=16, max_batch_tokens=32))
    added = time.monotonic()
    for i, p in enumerate(prompts[:2]):
        engine.add_request(str(i), p, greedy())
    firsts: dict[str, tuple[float, tuple[float, float]]] = {}
    later = []
    while engine.has_work():
        for out in engine.step():
            if out.request_id not in firsts:
                firsts[out.request_id] = (time.monotonic(), out.timing)
            else:
                later.append(out.timing)
    assert later and all(t is None for t in later)  # only a sequence's first output carries it
    for seen, (queue, prefill) in firsts.values():
        assert queue >= 0 and prefill > 0
        assert queue + prefill <= seen - added  # measured inside the interval the caller saw
    # the second was admitted after the first's last token: its queue covers the first's prefill
    assert firsts["1"][1][0] >= sum(firsts["0"][1])
    # the engine process's pipe carries it
    out = StepOutput("r", 0, [5], [], False, None, 3, 1, timing=(0.25, 0.5))
    assert unpack_outputs(pack_outputs([out]))[0].timing == (0.25, 0.5)
