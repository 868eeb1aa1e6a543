"""The scheduler alone (no model): randomized arrivals, prompt and output lengths, cancellations and memory
pressure. Each step the test plays the model's part - the scheduled positions become computed, a row
that reaches its last known token gains one token - and checks the invariants after every step:

- the plan fits the step budget (decode rows, prompt chunks counted in whole slots) and the running limit;
- every scheduled row has pages for every position it appends and for the window before it;
- the pools never hand out more pages than they have, reference counts match the holders (sequences and
  the prefix cache), and no page is held by two sequences unless it came from the prefix cache;
- no sequence starves: every request finishes, and none waits while a later arrival was admitted before
  it (first come, first served, preempted sequences first);
- at the end every page and ring slot is back.
"""

from __future__ import annotations

import random

import pytest

from dsv4.engine.cache_manager import CacheManager
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.scheduler import Scheduler, SchedulerConfig
from dsv4.engine.sequence import Request, Sequence, token_ids_ok
from dsv4.model.paged import CacheLayout


def make(
    n_window: int,
    n_comp: int,
    max_seqs: int,
    budget: int,
    chunk: int,
    prefix: bool,
    P: int = 16,
    window: int = 16,
    max_len: int = 256,
    slot_sizes: tuple[int, ...] = (),
    prefill: int = 0,
    prefill_sizes: tuple[int, ...] = (),
    k: int = 0,
) -> Scheduler:
    """k > 0: a speculative engine's scheduler with k drafts (it resumes preempted sequences, and a decoding
    row's pages reach k + 1 positions past it for the MTP block's next drafts)."""
    layout = CacheLayout(P, window, (4, 16), n_window + 1, n_comp + 1, max_seqs, max_len, prefix)
    config = SchedulerConfig(
        max_seqs, max_len, budget, chunk, prefix, slot_sizes, prefill, prefill_sizes, bool(k), k + 1 if k else 0
    )
    return Scheduler(config, CacheManager(layout, prefix))


def check_pages(s: Scheduler) -> None:
    m = s.manager
    for pool, table, cached in ((m.wpool, m.tables.w, m.cached_w), (m.cpool, m.tables.c, m.cached_c)):
        held: dict[int, int] = {}
        for seq in s.running:
            for page in table[seq.pages.state][table[seq.pages.state] > 0].tolist():
                held[page] = held.get(page, 0) + 1
        for page in cached.values():
            held[page] = held.get(page, 0) + 1
        assert sum(1 for p in range(1, pool.n_pages) if pool.refs[p] > 0) + pool.n_free == pool.n_pages - 1
        for page in range(1, pool.n_pages):
            assert pool.refs[page] == held.get(page, 0), (page, pool.refs[page], held.get(page, 0))
        assert set(pool.free).isdisjoint(held)
        shared = [p for p, n in held.items() if n > 1]
        assert all(p in cached.values() for p in shared)  # only prefix-cache pages are shared


@pytest.mark.parametrize("seed", range(13))
def test_random_traffic_keeps_every_invariant(seed):
    rng = random.Random(seed)
    prefix = seed % 2 == 0
    chunk = (1, 4, 8)[seed % 3]
    budget = rng.randint(16, 64)
    # seeds 6-11: padded steps, whose chunks take a number of slots that the runner has a bucket for;
    # seeds 9-12: a step with no decode row may take up to 3x the budget (padded, and ragged at 12)
    slot_sizes = (0, 1, 2, 3, 4, 6, budget // chunk) if 6 <= seed < 12 else ()
    prefill = 3 * budget if seed >= 9 else 0
    prefill_sizes = (2 * budget // chunk, prefill // chunk) if prefill and slot_sizes else ()
    cap = max(chunk, budget // chunk * chunk)  # one sequence's chunk: within max_batch_tokens still
    s = make(
        n_window=rng.randint(8, 40),
        n_comp=rng.randint(12, 60),
        max_seqs=rng.randint(2, 6),
        budget=budget,
        chunk=chunk,
        prefix=prefix,
        slot_sizes=slot_sizes,
        prefill=prefill,
        prefill_sizes=prefill_sizes,
    )
    P = s.manager.P
    shared = [rng.randrange(2, 1000) for _ in range(40)]
    pending = []
    for i in range(40):
        n = rng.choice([1, 3, 17, 40, 70])
        prompt = (shared[: rng.choice([0, 16, 33])] + [rng.randrange(2, 1000) for _ in range(n)])[:200] or [5]
        params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0)
        req = Request(str(i), prompt, params, n=rng.choice([1, 1, 2]))
        for k in range(req.n):
            req.sequences.append(Sequence(req, k, list(prompt), seed=0, prompt_len=len(prompt)))
        pending.append((rng.randint(0, 60), req))
    pending.sort(key=lambda x: x[0])
    arrived: list[Request] = []
    order: dict[int, int] = {}  # sequence -> arrival rank
    ever_admitted: set[int] = set()
    step = bursts = 0
    left_out: set[int] = set()  # decoding sequences the last step left out (a burst's)
    while pending or s.has_work():
        while pending and pending[0][0] <= step:
            _, req = pending.pop(0)
            arrived.append(req)
            for seq in req.sequences:
                order[id(seq)] = len(order)
                s.add(seq)
        if rng.random() < 0.05 and arrived:  # a client goes away
            for seq in rng.choice(arrived).sequences:
                s.finish(seq, "abort")
        decoding = [q for q in s.running if not q.prefilling]
        plan = s.schedule()
        # a decoding stream (not preempted by this plan) waits one step at most, and only for a burst's
        out = {id(q) for q in decoding if q.running} - {id(r.seq) for r in plan}
        assert not out & left_out and (not out or prefill)
        left_out = out
        used = sum(-(-r.n // chunk) * chunk if r.seq.prefilling else r.n for r in plan)
        decode = sum(r.n for r in plan if not r.seq.prefilling)
        limit = prefill if prefill and not decode else budget
        assert used <= limit and len(s.running) <= s.config.max_seqs
        bursts += used > budget
        assert all(r.n <= cap for r in plan if r.seq.prefilling)
        if slot_sizes:  # the chunks fit the largest bucket size that the decode rows leave room for
            sizes = slot_sizes + prefill_sizes if limit > budget else slot_sizes
            slots = sum(-(-r.n // chunk) for r in plan if r.seq.prefilling)
            assert slots <= max(n for n in sizes if n * chunk <= limit - decode)
        assert len({id(r.seq) for r in plan}) == len(plan)
        for r in plan:
            seq = r.seq
            assert seq.running
            first_w = max(0, seq.computed - s.manager.window + 1) // P
            for pos_page in range(seq.computed // P, (seq.computed + r.n - 1) // P + 1):
                assert seq.pages.ctable[pos_page] > 0
            for k in range(max(first_w, seq.pages.trimmed), (seq.computed + r.n - 1) // P + 1):
                assert seq.pages.wtable[k] > 0
        # first come, first served: no sequence was admitted while one that arrived earlier, and was never
        # admitted, still waits
        newly = [r.seq for r in plan if id(r.seq) not in ever_admitted]
        for seq in newly:
            ever_admitted.add(id(seq))
        for seq in newly:
            assert not [w for w in s.waiting if id(w) not in ever_admitted and order[id(w)] < order[id(seq)]]
        stepped = []
        for r in plan:  # the model's part
            seq, want = r.seq, r.want_logits
            seq.computed += r.n
            stepped.append(seq)
            if want:
                seq.tokens.append(rng.randrange(2, 1000))
                if seq.n_generated >= seq.params.max_tokens or len(seq.tokens) >= s.config.max_model_len:
                    s.finish(seq, "length")
        s.after_step(stepped)
        check_pages(s)
        step += 1
        assert step < 5000, "the traffic did not drain: some sequence starves"
    assert all(req.finished for _, req in pending) and all(req.finished for req in arrived)
    assert prefill or not bursts, "only steps of prompts alone may take more than max_batch_tokens"
    m = s.manager
    for pool in (m.wpool, m.cpool):  # every page free, or held by the prefix cache alone (evictable)
        assert pool.n_free + pool.evictable == pool.n_pages - 1
        assert all(pool.refs[p] == (1 if pool.cached[p] else 0) for p in range(1, pool.n_pages))
    assert sorted(m.free_states) == list(range(m.layout.n_states))
    assert (m.tables.w == -1).all() and (m.tables.c == -1).all()


def model_step(s: Scheduler, plan: list | None = None) -> None:
    """One step (the next one, or `plan`) with the model's part played: scheduled positions become
    computed, a row that reaches its last known token gains a token, a sequence with max_tokens generated
    finishes."""
    plan = s.schedule() if plan is None else plan
    for r in plan:
        want = r.want_logits
        r.seq.computed += r.n
        if want:
            r.seq.tokens.append(3)
            if r.seq.n_generated >= r.seq.params.max_tokens:
                s.finish(r.seq, "length")
    s.after_step([r.seq for r in plan])


def test_memory_pressure_preempts_the_latest_and_recomputes_it():
    s = make(n_window=64, n_comp=6, max_seqs=4, budget=64, chunk=1, prefix=False)
    reqs = []
    for i in range(3):
        req = Request(str(i), [7] * 15, SamplingParams(max_tokens=40, temperature=0))
        req.sequences.append(Sequence(req, 0, [7] * 15, seed=0, prompt_len=15))
        reqs.append(req)
        s.add(req.sequences[0])
    steps = 0
    while s.has_work():
        model_step(s)
        check_pages(s)
        steps += 1
        assert steps < 2000
    assert s.stats["preemptions"] > 0
    assert all(len(r.sequences[0].tokens) == 55 for r in reqs)


def test_pools_sized_for_every_seat_keep_no_seat_empty():
    """Pools that hold max_seqs sequences at max_model_len (the engine's default sizes) admit the last
    seat while the others run, even when they hold every other page: no preemption can be needed there,
    so admission keeps no pages in reserve (a reserve kept the last seat empty until a sequence ended).
    A pool one page smaller keeps the reserve."""
    max_seqs, max_len, P = 4, 64, 16
    full = max_seqs * (max_len // P)
    assert not make(n_window=32, n_comp=full - 1, max_seqs=max_seqs, budget=64, chunk=1, prefix=False, P=P).roomy
    s = make(n_window=32, n_comp=full, max_seqs=max_seqs, budget=64, chunk=1, prefix=False, P=P, max_len=max_len)
    assert s.roomy
    seqs = []
    for i in range(max_seqs):  # 49 positions: 4 pages each
        req = Request(str(i), [7] * 49, SamplingParams(max_tokens=8, temperature=0))
        req.sequences.append(Sequence(req, 0, [7] * 49, seed=0, prompt_len=49))
        seqs.append(req.sequences[0])
    for seq in seqs[:-1]:
        s.add(seq)
    while any(seq.prefilling or not seq.running for seq in seqs[:-1]):
        model_step(s)
    assert s.manager.free_pages()[1] == 4  # exactly the last seat's pages
    s.add(seqs[-1])
    s.schedule()
    assert seqs[-1].running
    check_pages(s)


def test_padded_steps_take_the_chunk_slots_of_a_bucket():
    """With the runner's bucket sizes given, the budget that decode rows leave goes to chunks in the largest
    number of slots that a bucket has: 3 decode rows and a budget of 3 + 28 slots take 24 slots (a 32-slot
    bucket would compute 4 slots of padding); the rest of the prompt follows. Without sizes: 28 slots."""
    L = 4
    for sizes, want in (((0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32), 24), ((), 28)):
        s = make(n_window=200, n_comp=200, max_seqs=4, budget=3 + 28 * L, chunk=L, prefix=False, slot_sizes=sizes)
        for i in range(3):  # three sequences decoding
            req = Request(str(i), [7] * 4, SamplingParams(max_tokens=100, temperature=0))
            req.sequences.append(Sequence(req, 0, [7] * 4, seed=0, prompt_len=4))
            s.add(req.sequences[0])
        model_step(s)
        assert all(not q.prefilling for q in s.running) and len(s.running) == 3
        long = Request("long", [9] * 200, SamplingParams(max_tokens=1, temperature=0))
        long.sequences.append(Sequence(long, 0, [9] * 200, seed=0, prompt_len=200))
        s.add(long.sequences[0])
        plan = s.schedule()
        chunk = [r for r in plan if r.seq is long.sequences[0]]
        assert [r.n for r in plan if r.n == 1] == [1, 1, 1] and len(chunk) == 1
        assert chunk[0].n == want * L, (sizes, chunk[0].n)


def test_a_burst_of_prompts_takes_the_prefill_budget_until_a_stream_decodes():
    """A step with no decode row takes up to max_prefill_tokens of prompt chunks (in a slot count that a
    prefill bucket has), each sequence's chunk still within max_batch_tokens; the next step carries the
    burst's decode rows and falls back to max_batch_tokens (what the decode rows leave of it). The 34 slots
    of prompts take 3 steps so, 6 without a prefill budget."""
    L, budget = 4, 32
    for prefill, sizes, want in ((96, (12, 16, 24), [24, 6, 4]), (0, (), [8, 6, 6, 6, 6, 2])):
        s = make(
            n_window=200, n_comp=200, max_seqs=8, budget=budget, chunk=L, prefix=False,
            slot_sizes=(0, 1, 2, 3, 4, 6, 8), prefill=prefill, prefill_sizes=sizes,
        )  # fmt: skip
        seqs = []
        for i in range(8):  # 8 prompts of 12 tokens (3 slots each), and one of 50 (13 slots)
            n = 50 if i == 7 else 12
            req = Request(str(i), [7] * n, SamplingParams(max_tokens=4, temperature=0))
            req.sequences.append(Sequence(req, 0, [7] * n, seed=0, prompt_len=n))
            s.add(req.sequences[0])
            seqs.append(req.sequences[0])
        slots = []
        while any(q.prefilling or not q.running for q in seqs):
            plan = s.schedule()
            chunks = [r for r in plan if r.seq.prefilling]
            decode = [r for r in plan if not r.seq.prefilling]
            assert all(r.n <= budget for r in chunks)
            assert sum(-(-r.n // L) for r in chunks) * L + len(decode) <= (
                prefill if not decode and prefill else budget
            )
            slots.append(sum(-(-r.n // L) for r in chunks))
            for r in plan:
                want_logits = r.want_logits
                r.seq.computed += r.n
                if want_logits:
                    r.seq.tokens.append(3)
            s.after_step([r.seq for r in plan])
        assert slots == want, (prefill, slots)


def test_a_burst_that_finds_streams_decoding_gets_a_step_of_its_own():
    """When more sequences wait for their first token than are decoding, and their prompts overflow what a
    step beside the decode rows could take, the next step is theirs alone (up to max_prefill_tokens); the
    decoding streams are in the step after it. Not when the prompts fit beside them, nor when they do not
    outnumber them, nor where steps of prompts alone have no larger budget."""
    L, budget = 4, 32

    def streams_then(newcomers: int, prompt: int, prefill: int = 96) -> list[tuple[int, int]]:
        s = make(
            n_window=300, n_comp=300, max_seqs=16, budget=budget, chunk=L, prefix=False,
            slot_sizes=(0, 1, 2, 3, 4, 6, 8), prefill=prefill, prefill_sizes=(12, 16, 24) if prefill else (),
        )  # fmt: skip

        def add(n: int) -> None:
            req = Request(str(len(s.running) + len(s.waiting)), [7] * n, SamplingParams(max_tokens=9, temperature=0))
            req.sequences.append(Sequence(req, 0, [7] * n, seed=0, prompt_len=n))
            s.add(req.sequences[0])

        for _ in range(2):  # two streams decoding
            add(4)
        model_step(s)
        assert all(not q.prefilling for q in s.running) and len(s.running) == 2
        for _ in range(newcomers):
            add(prompt)
        shape = []  # (decode rows, prompt chunk tokens) of the next three steps
        for _ in range(3):
            plan = s.schedule()
            shape.append((sum(not r.seq.prefilling for r in plan), sum(r.n for r in plan if r.seq.prefilling)))
            model_step(s, plan)
        return shape

    # 5 prompts of 12 tokens (15 slots) against 30 tokens of budget beside 2 decode rows: a step of their own
    assert streams_then(5, 12) == [(0, 60), (7, 0), (7, 0)]
    assert streams_then(5, 12, prefill=0) == [(2, 24), (4, 24), (6, 12)]  # (no larger budget: chunked)
    assert streams_then(2, 12) == [(2, 24), (4, 0), (4, 0)]  # they fit beside the decode rows
    assert streams_then(2, 40)[0] == (2, 24)  # they overflow it, but do not outnumber the streams


def test_admission_beside_launched_decodes_cuts_prompts_as_the_schedule_would():
    """`admit` (prompts started in a step of their own beside a step already launched for the decoding
    sequences) plans no running row and cuts each new prompt into the chunks that `schedule` would have cut
    beside those decode rows (drafts included), or a burst's step where `schedule` would give one."""
    L, budget = 4, 32

    def plans(newcomers: int, prompt: int, drafts: int = 0, prefill: int = 96):
        out = []
        for admit in (False, True):
            s = make(
                n_window=300, n_comp=300, max_seqs=16, budget=budget, chunk=L, prefix=False,
                slot_sizes=(0, 1, 2, 3, 4, 6, 8), prefill=prefill, prefill_sizes=(12, 16, 24) if prefill else (),
            )  # fmt: skip
            for i in range(2 + newcomers):  # two streams decoding, then the newcomers
                n = 4 if i < 2 else prompt
                req = Request(str(i), [7] * n, SamplingParams(max_tokens=9, temperature=0))
                req.sequences.append(Sequence(req, 0, [7] * n, seed=0, prompt_len=n))
                s.add(req.sequences[0])
                if i == 1:
                    model_step(s)
                    for q in s.running:
                        q.drafts = [5] * drafts
            plan = s.admit() if admit else s.schedule()
            out.append([(r.seq.request.request_id, r.n) for r in plan if r.seq.prefilling or r.seq.computed == 0])
            if admit:
                assert all(r.seq.computed == 0 for r in plan)  # no running row
        assert out[0] == out[1] and out[0]
        return out[1]

    assert plans(2, 14) == [("2", 14), ("3", 8)]  # beside 2 one-token rows: 30 tokens, 6 slots of 4
    assert plans(2, 14, drafts=7) == [("2", 14)]  # beside 2 rows of 8 tokens: 16, 4 slots
    assert plans(5, 12) == [(str(i), 12) for i in range(2, 7)]  # a burst: a step of the prompts alone


def test_a_burst_counts_only_what_the_prefix_cache_does_not_serve():
    """Newcomers whose prompts the prefix cache holds compute only their tails: five such prompts fit beside
    the decoding streams and take no step of their own; the same prompts, uncached, would."""
    L, n = 4, 36  # 16-token pages: the cache serves 32 of each prompt's 36 tokens

    def first_step(prefix: bool) -> tuple[int, int]:
        s = make(
            n_window=300, n_comp=300, max_seqs=16, budget=32, chunk=L, prefix=prefix,
            slot_sizes=(0, 1, 2, 3, 4, 6, 8), prefill=96, prefill_sizes=(12, 16, 24),
        )  # fmt: skip

        def add() -> None:
            req = Request(str(len(s.running) + len(s.waiting)), [7] * n, SamplingParams(max_tokens=9))
            req.sequences.append(Sequence(req, 0, [7] * n, seed=0, prompt_len=n))
            s.add(req.sequences[0])

        for _ in range(2):  # two streams decoding; their prompts' pages are in the cache (where it is on)
            add()
            while any(q.prefilling for q in s.running + list(s.waiting)):
                model_step(s)
        assert all(not q.prefilling for q in s.running) and len(s.running) == 2
        assert len(s.manager.cached_w) == (2 if prefix else 0)
        for _ in range(5):
            add()
        plan = s.schedule()
        return sum(not r.seq.prefilling for r in plan), sum(r.n for r in plan if r.seq.prefilling)

    assert first_step(prefix=False) == (0, 96)  # 180 tokens against 30 beside the streams: their own step
    assert first_step(prefix=True) == (2, 20)  # 4 tokens each to compute: 20 fit beside the streams


def test_prompt_ids_are_checked_as_the_definition_says_whatever_the_list_holds():
    """token_ids_ok (its fast path for lists of plain ints included) is: every id an int in [0, vocab)."""
    rng = random.Random(0)
    pool = [0, 1, 5, 7, 8, -1, True, False, 2.0, "3", None, 10**30]
    for _ in range(2000):
        ids = [rng.choice(pool) if rng.random() < 0.2 else rng.randrange(-2, 10) for _ in range(rng.randrange(0, 6))]
        want = all(isinstance(t, int) and 0 <= t < 8 for t in ids)
        assert token_ids_ok(ids, 8) == want, ids


@pytest.mark.parametrize("seed", range(6))
def test_speculating_sequences_resume_where_the_preemption_found_them(seed):
    """A speculative engine's scheduler (k drafts) under memory pressure, the model's part played as a verify:
    a decoding row is [last token, drafts], a random number of drafts is accepted and k new drafts are made.
    Every decoding row has pages for k + 1 positions past it, up to the sequence's last position (where the
    MTP block writes its next drafts, so that whether a sequence drafts never depends on the memory left).
    A sequence preempted after generating is recomputed up to its last token only, no row of the recompute
    draws a token, and its next row verifies the drafts it had: the step it would have run without the
    preemption."""
    rng = random.Random(seed)
    k = rng.choice([1, 2, 3])
    s = make(
        n_window=rng.randint(10, 14),
        n_comp=rng.randint(6, 9),
        max_seqs=4,
        budget=32,
        chunk=4,
        prefix=seed % 2 == 0,
        k=k,
    )
    P, max_len = s.manager.P, s.config.max_model_len
    reqs = []
    for i in range(6):
        n = rng.choice([5, 15, 16, 17, 30])
        req = Request(str(i), [rng.randrange(2, 9) for _ in range(n)], SamplingParams(max_tokens=rng.randint(20, 50)))
        req.sequences.append(Sequence(req, 0, list(req.prompt), seed=0, prompt_len=n))
        reqs.append(req)
        s.add(req.sequences[0])
    at_preemption: dict[int, tuple[int, list[int]]] = {}  # a sequence preempted after generating -> (its length,
    # its drafts) then
    preempt = s.preempt

    def recording(seq: Sequence) -> None:
        if seq.n_generated:  # (one preempted in its prompt is recomputed as a prompt)
            at_preemption[id(seq)] = (seq.n_tokens, list(seq.drafts))
        preempt(seq)

    s.preempt = recording
    resumed = steps = 0
    while s.has_work():
        plan = s.schedule()
        for r in plan:
            seq = r.seq
            assert seq.running
            if not seq.prefilling:  # a decoding row: its positions and the next drafts' have pages
                end = min(seq.computed + r.n + k + 1, max_len, seq.prompt_len + seq.params.max_tokens)
                assert (seq.pages.ctable[seq.computed // P : (end - 1) // P + 1] > 0).all()
                assert (seq.pages.wtable[max(seq.computed // P, seq.pages.trimmed) : (end - 1) // P + 1] > 0).all()
            if id(seq) in at_preemption:
                length, drafts = at_preemption[id(seq)]
                if seq.prefilling:  # recomputing: up to its last token, drawing nothing
                    assert seq.computed + r.n <= length - 1 and not r.want_logits and seq.drafts == drafts
                else:  # its first row after the recompute: the verify it would have run
                    assert seq.computed == length - 1 and r.n == 1 + len(drafts) and seq.drafts == drafts
                    del at_preemption[id(seq)]
                    resumed += 1
        for r in plan:  # the model's part
            seq, chunk, want = r.seq, r.seq.prefilling, r.want_logits
            if not want:  # a chunk that draws nothing (a resuming one keeps its drafts)
                seq.computed += r.n
                continue
            a = rng.randint(0, len(seq.drafts)) if r.verify else 0  # drafts accepted, then one token drawn
            seq.tokens += seq.drafts[:a] + [rng.randrange(2, 9)]
            seq.computed += r.n if chunk else a + 1
            room = min(k, max_len - len(seq.tokens), seq.params.max_tokens - seq.n_generated - 1)
            seq.drafts = [] if chunk else [rng.randrange(2, 9) for _ in range(max(room, 0))]  # (a prompt: none yet)
            if seq.n_generated >= seq.params.max_tokens or len(seq.tokens) >= max_len:
                s.finish(seq, "length")
        s.after_step([r.seq for r in plan])
        check_pages(s)
        steps += 1
        assert steps < 3000, "the traffic did not drain"
    assert s.stats["preemptions"] > 0 and resumed > 0
    assert all(req.finished for req in reqs)
    m = s.manager
    assert sorted(m.free_states) == list(range(m.layout.n_states))
