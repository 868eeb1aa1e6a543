"""The serving engine: requests in, tokens out, many sequences sharing one model and one paged cache.

`Engine` is synchronous and single-threaded: `add_request`, `abort`, and `step()`, which schedules one
step (continuous batching with chunked prefill under a token budget), runs the model once, samples, and
returns what each request gained. `AsyncEngine` (dsv4.engine.async_engine) runs it in its own thread.

Scheduling, per step:
1. running sequences first, in arrival order: each decoding sequence gets one token; each sequence still
   in its prompt gets a chunk of what the budget has left (a long prompt never stalls the streams);
2. waiting sequences are admitted (prefix cache looked up first) while the budget, the running limit and
   the free pages allow;
3. when a running sequence needs a page and none is free, the most recently admitted sequence is
   preempted: its pages are released and it is recomputed later from its tokens (prompt + output so far).
A request never crashes the engine: what cannot fit waits or is refused up front with a reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..model import DeepSeekV4
from ..model.paged import CacheLayout, PagedKVCache, default_page_size
from ..ops.precision import exact_accumulation
from .cache_manager import CacheManager, SeqPages
from .detokenize import Detokenizer, StopChecker
from .runner import GRAPH_BUCKETS, Row, Runner
from .sampling import Sampler, SamplingParams
from .speculative import MAX_SPECULATIVE, Drafter, DraftRow, GreedySpecGraph, accept, greedy_spec_step


class RequestError(ValueError):
    """A request the engine refuses (too long, bad parameters); the message says why."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sequence:
    request: Request
    index: int                                   # choice index within the request
    tokens: list[int]                            # prompt + generated
    seed: int
    prompt_len: int = 0
    pages: SeqPages | None = None
    computed: int = 0                            # positions whose cache entries are written
    status: Status = Status.WAITING
    finish_reason: str | None = None
    admitted_at: int = 0                         # admission order (preemption picks the latest)
    cached_tokens: int = 0                       # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    detok: Detokenizer | None = None
    stopper: StopChecker = field(default_factory=StopChecker)
    n_pending: int = 0                           # tokens sampled on the device, not read yet (overlap)
    pending_index: int = -1                      # the latest one's row in its step's sampled tokens
    drafts: list[int] = field(default_factory=list)   # speculative: tokens the MTP block proposes next
    draft_q: torch.Tensor | None = None          # their draft distributions [len(drafts), vocab] float64

    @property
    def n_tokens(self) -> int:
        """Tokens known so far, those still on the device included."""
        return len(self.tokens) + self.n_pending

    @property
    def n_generated(self) -> int:
        return self.n_tokens - self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.computed < self.n_tokens - 1


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    n: int = 1
    arrival: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.sequences)


@dataclass
class StepOutput:
    """What one sequence gained in a step."""
    request_id: str
    index: int
    new_tokens: list[int]
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    text: str = ""                                  # new text (with a tokenizer; stop strings applied)


@dataclass
class _Step:
    """A launched step: its rows, the sequences it samples for, and their sampled tokens (on the device)."""
    order: list[tuple[Sequence, int]]
    samplers: list[Sequence]
    sampled: object


@dataclass
class EngineConfig:
    max_seqs: int = 32                      # sequences running at once
    max_model_len: int | None = None        # prompt + output limit (default: the model's, at most 8192)
    max_batch_tokens: int | None = None     # tokens per step, prefill chunks + decodes (default: 4096 on a
                                            # GPU, where a step's cost is mostly kernel launches; 512 on a CPU)
    # while sequences are decoding, new prompts are admitted in batches: when their tokens reach this many
    # (default: half the step budget on a GPU, 0 = at once on a CPU) or the oldest has waited this long
    prefill_batch_tokens: int | None = None
    max_prefill_delay_s: float = 0.05
    page_size: int | None = None            # positions per page (default: see default_page_size)
    cache_pages: int | None = None          # compressed pages (default: every running sequence at full length)
    window_pages: int | None = None         # window pages (default: the window of every sequence, twice)
    prefix_caching: bool = True
    deterministic: bool = False             # batch-invariant numbers (float64 accumulation on the reference)
    cuda_graphs: bool = True                # replay decode steps and whole-prompt steps from CUDA graphs
    pad_prefill: bool = False               # whole-prompt steps at fixed shapes also without graphs (tests)
    overlap: bool | None = None             # launch a step before reading the last one's tokens (default:
                                            # on CUDA, where the device runs while the host does bookkeeping)
    max_n: int = 16                         # choices per request
    speculative: int = 0                    # draft tokens per step from the MTP block (0: off)


class Engine:
    def __init__(self, model: DeepSeekV4, config: EngineConfig | None = None, tokenizer=None,
                 eos_token_id: int | None = None):
        self.model = model.eval()
        c = dataclasses.replace(config) if config is not None else EngineConfig()
        cfg = model.cfg
        on_gpu = model.embed.weight.device.type == "cuda"
        if c.max_batch_tokens is None:
            c.max_batch_tokens = 4096 if on_gpu else 512
        if c.prefill_batch_tokens is None:
            c.prefill_batch_tokens = c.max_batch_tokens // 2 if on_gpu else 0
        self.config = c
        if c.max_seqs < 1 or c.max_batch_tokens < 1:
            raise ValueError("max_seqs and max_batch_tokens must be >= 1")
        self.max_model_len = min(c.max_model_len or min(cfg.max_seq_len, 8192), cfg.max_seq_len)
        P = c.page_size or default_page_size(cfg)
        per_seq = math.ceil(self.max_model_len / P)
        n_c = c.cache_pages or c.max_seqs * per_seq
        window_per_seq = math.ceil((cfg.window_size + c.max_batch_tokens) / P) + 1
        n_w = c.window_pages or 2 * c.max_seqs * window_per_seq
        self.layout = CacheLayout.for_model(cfg, n_w + 1, n_c + 1, c.max_seqs, self.max_model_len, P,
                                            page_tails=c.prefix_caching)
        p = model.embed.weight
        self.cache = PagedKVCache(cfg, self.layout, p.device, p.dtype)
        self.manager = CacheManager(self.layout, c.prefix_caching, has_compressed=bool(self.layout.ratios))
        self.runner = Runner(model, self.cache, cuda_graphs=c.cuda_graphs and not c.deterministic,
                             max_graph_batch=c.max_seqs, pad_prefill=c.pad_prefill)
        self.sampler = Sampler()
        self.overlap = on_gpu if c.overlap is None else c.overlap
        self.drafter: Drafter | None = None
        if c.speculative:
            if not 0 < c.speculative <= MAX_SPECULATIVE:
                raise ValueError(f"speculative must be in [0, {MAX_SPECULATIVE}] draft tokens, got {c.speculative}")
            self.drafter = Drafter(model, self.cache, self.sampler)
            self.overlap = False            # every step reads its acceptance before the next is planned
        self.spec_stats = {"verify_steps": 0, "drafted": 0, "accepted": 0, "fixed_steps": 0}
        self._spec_graphs: dict[int, GreedySpecGraph] = {}
        self._inflight: _Step | None = None
        self.tokenizer = tokenizer
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_id", None)
        self.eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._admissions = itertools.count()
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "preemptions": 0}
        # host seconds per phase of a step: scheduling, building inputs + launching the model and the sampler,
        # waiting for the sampled tokens (the device's share), bookkeeping + detokenization
        self.timing = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "post": 0.0}
        self.device = p.device
        self.vocab = cfg.vocab_size

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt: list[int], params: SamplingParams, n: int = 1) -> None:
        """Raise RequestError when a request cannot be served (before it is queued)."""
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab for t in prompt):
            raise RequestError(f"prompt token ids must be integers in [0, {self.vocab})")
        if not 1 <= n <= self.config.max_n:
            raise RequestError(f"n must be in [1, {self.config.max_n}], got {n}")
        if len(prompt) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens; this server's context is "
                               f"{self.max_model_len} tokens (prompt + output), so at most "
                               f"{self.max_model_len - 1} prompt tokens fit")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (this model has none): use stop_token_ids")
        if any(t >= self.vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be < the vocabulary size {self.vocab}")
        w, c = self.manager.pages_for(0, min(self.max_model_len, len(prompt) + 1))
        # the prompt is computed in chunks of at most max_batch_tokens and window pages behind the window
        # are released after each, so a sequence never holds more than a window and a chunk of them
        w = min(w, math.ceil((self.layout.window + self.config.max_batch_tokens) / self.layout.page_size) + 1)
        if w > self.layout.n_window_pages - 1 or c > self.layout.n_comp_pages - 1:
            raise RequestError(f"the prompt of {len(prompt)} tokens needs {w} window and {c} compressed cache "
                               f"pages; this server has {self.layout.n_window_pages - 1} and "
                               f"{self.layout.n_comp_pages - 1} in all (--cache-pages)")

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, n: int = 1) -> Request:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.check_request(prompt, params, n)
        req = Request(request_id, list(prompt), params, n)
        base = params.resolved_seed()
        for i in range(n):
            seed = base if i == 0 else (base * 1_000_003 + i) % 2**63
            seq = Sequence(req, i, list(prompt), seed, prompt_len=len(prompt))
            if self.tokenizer is not None:
                seq.detok = Detokenizer.for_prompt(self.tokenizer, prompt)
                seq.detok.skip_special = params.skip_special_tokens
                seq.stopper = StopChecker(list(params.stop), params.include_stop_str_in_output)
            req.sequences.append(seq)
            self.waiting.append(seq)
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages (a client that went away)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.sequences:
            self._finish(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight is not None)

    # ------------------------------------------------------------------ scheduling
    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        if seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if seq.pages is not None:
            self.manager.release(seq.pages)
            seq.pages = None
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _preempt(self, seq: Sequence) -> None:
        seq.drafts, seq.draft_q = [], None
        self.running.remove(seq)
        self.manager.release(seq.pages)
        seq.pages, seq.computed, seq.status = None, 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if not s.prefilling]
        chunked = [s for s in self.running if s.prefilling]
        for seq in decoding + chunked:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:            # preempted by an earlier one in this loop
                continue
            if seq.n_pending and (seq.n_generated >= seq.request.params.max_tokens
                                  or seq.n_tokens >= self.max_model_len):
                continue                                    # its token on the device is its last
            n = 1 + len(seq.drafts) if not seq.prefilling else min(budget, seq.n_tokens - seq.computed)
            while not self.manager.allocate(seq.pages, seq.computed, seq.computed + n):
                victim = max((s for s in self.running if s not in [p for p, _ in plan]),
                             key=lambda s: s.admitted_at)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            plan.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_seqs and self._admit_now():
            seq = self.waiting[0]
            if self._sibling_prefilling(seq) or seq.n_pending:     # (a preempted one's token is on its way)
                break
            pages = self.manager.new_sequence()
            if pages is None:
                break
            cached = self.manager.match(pages, seq.tokens) if seq.computed == 0 else 0
            n = min(budget, len(seq.tokens) - cached)
            reserve = (len(self.running), len(self.running))    # a decode page for every running sequence
            if not (self.manager.can_fit(cached, cached + n, reserve)
                    and self.manager.allocate(pages, cached, cached + n)):
                self.manager.release(pages)
                if not self.running:
                    raise RuntimeError("the cache cannot hold a single request's next chunk: give the "
                                       "engine more cache pages or a smaller max_batch_tokens")
                break
            if cached:
                self.cache.restore_tail(pages.state, pages.ctable[cached // self.layout.page_size - 1], cached)
            self.waiting.popleft()
            seq.pages, seq.computed, seq.cached_tokens = pages, cached, max(seq.cached_tokens, cached)
            seq.status, seq.admitted_at = Status.RUNNING, next(self._admissions)
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def _admit_now(self) -> bool:
        """Admit waiting prompts now, or let them gather while the running sequences decode (a step with
        prompt chunks runs eagerly and costs about as much for 100 tokens as for 2000 on a GPU)."""
        c = self.config
        if not self.running or c.prefill_batch_tokens <= 0 or any(s.prefilling for s in self.running):
            return True
        gathered = sum(len(s.tokens) - s.computed for s in self.waiting)
        oldest = time.monotonic() - min(s.request.arrival for s in self.waiting)
        return gathered >= c.prefill_batch_tokens or oldest >= c.max_prefill_delay_s

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """With prefix caching, choices 1..n-1 wait until choice 0 has computed the shared prompt."""
        if not self.config.prefix_caching or seq.index == 0:
            return False
        first = seq.request.sequences[0]
        return first.status is not Status.FINISHED and first.computed < first.request.prompt_len

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Schedule and run one step; return what each request gained.

        With `overlap` (on CUDA), a step is launched before the previous one's tokens are read: decoding
        sequences take their input token from the device, and the host does the previous step's
        bookkeeping while the device computes. A sequence that turns out finished then computed one token
        too many, which is dropped.
        """
        if self.drafter is not None:
            return self._step_speculative()
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        outputs: list[StepOutput] = []
        if prev is not None and not self._overlap_ok():
            outputs = self._collect(prev)
            prev = None
        plan = self._schedule()
        t1 = time.perf_counter()
        cur = self._launch(plan, prev) if plan else None
        t2 = time.perf_counter()
        if prev is not None:
            outputs += self._collect(prev)
        if cur is not None:
            if self.overlap:
                self._inflight = cur
            else:
                outputs += self._collect(cur)
        self.timing["schedule"] += t1 - t0
        self.timing["launch"] += t2 - t1
        self.timing["post"] += time.perf_counter() - t2
        return outputs

    # ------------------------------------------------------------------ speculative steps
    def _step_speculative(self) -> list[StepOutput]:
        """One step with MTP drafts (dsv4.engine.speculative): a sequence that carries drafts runs them as a
        verify row [x_c, d_1, ..., d_k]; acceptance keeps a prefix and draws one more token; then the MTP
        block catches up on the positions that are final and drafts the next k for each sequence."""
        t0 = time.perf_counter()
        plan = self._schedule()
        t1 = time.perf_counter()
        if not plan:
            return []
        if self._fixed_spec_ok(plan):
            outputs = self._step_greedy_fixed(plan)
            self.timing["schedule"] += t1 - t0
            self.timing["launch"] += time.perf_counter() - t1
            return outputs
        rows: list[Row] = []
        for seq, n in plan:
            s = seq.computed
            verify = not seq.prefilling and bool(seq.drafts)
            toks = [seq.tokens[s]] + seq.drafts if verify else seq.tokens[s:s + n]
            rows.append(Row(toks, s, seq.pages.wtable, seq.pages.ctable, seq.pages.state,
                            want_logits=verify or s + n == seq.n_tokens, all_logits=verify))
        with exact_accumulation(self.config.deterministic):
            logits, hidden = self.runner.run_hidden(rows)
            emitted = self._accept(plan, rows, logits)
        t2 = time.perf_counter()
        outputs: dict[int, tuple[Sequence, StepOutput]] = {}
        for (seq, n), row in zip(plan, rows):
            if seq.computed + n <= seq.prompt_len:
                self.stats["prompt_tokens"] += n
            seq.computed += len(row.tokens) if not row.all_logits else len(emitted[id(seq)][0])
            seq.drafts, seq.draft_q = [], None
            for tok, lp in zip(*emitted.get(id(seq), ((), ()))):
                if seq.status is Status.FINISHED:
                    break
                self._emit(seq, tok, lp, outputs)
        self.stats["steps"] += 1
        with exact_accumulation(self.config.deterministic):
            self._draft(plan, rows, hidden)
        self.timing["schedule"] += t1 - t0
        self.timing["launch"] += t2 - t1
        self.timing["post"] += time.perf_counter() - t2
        return self._finish_step([seq for seq, _ in plan], outputs)

    def _fixed_spec_ok(self, plan: list[tuple[Sequence, int]]) -> bool:
        """A step that is only greedy verifies of exactly k drafts runs at a fixed shape, replayed from a
        CUDA graph on a GPU (`greedy_spec_step`): the common case of speculative decode."""
        k = self.config.speculative
        if not (self.runner.cuda_graphs or self.config.pad_prefill) or len(plan) > self.config.max_seqs:
            return False
        for seq, _ in plan:
            p = seq.request.params
            if seq.prefilling or len(seq.drafts) != k or not p.greedy or p.logprobs is not None or p.penalized:
                return False
        return all(self.manager.allocate(seq.pages, seq.computed, min(seq.computed + 2 * k + 1, self.max_model_len))
                   for seq, _ in plan)          # the next drafts' positions too (their MTP rows are written now)

    def _step_greedy_fixed(self, plan: list[tuple[Sequence, int]]) -> list[StepOutput]:
        k = self.config.speculative
        seqs = [seq for seq, _ in plan]
        args = ([[seq.tokens[seq.computed]] + seq.drafts for seq in seqs], [seq.computed for seq in seqs],
                [seq.pages.wtable for seq in seqs], [seq.pages.ctable for seq in seqs],
                [seq.pages.state for seq in seqs])
        with exact_accumulation(self.config.deterministic):
            if self.runner.cuda_graphs:
                bucket = next(b for b in GRAPH_BUCKETS if b >= len(seqs))
                graph = self._spec_graphs.get(bucket)
                if graph is None:
                    graph = self._spec_graphs[bucket] = GreedySpecGraph(self.model, self.cache, bucket, k)
                accepted, bonus, drafts = graph.run(*args)
            else:                                   # the same fixed-shape step, eagerly (tested on a CPU)
                dev = self.device
                t = [torch.tensor(a, dtype=torch.long, device=dev) for a in args[:2]]
                width = self.layout.table_width()
                tables = [torch.tensor([(tb + [-1] * width)[:width] for tb in args[i]], dtype=torch.long, device=dev)
                          for i in (2, 3)]
                accepted, bonus, drafts = greedy_spec_step(self.model, self.cache, t[0], t[1], *tables,
                                                           torch.tensor(args[4], dtype=torch.long, device=dev))
        host = torch.cat([accepted, bonus, drafts.flatten()]).tolist()                 # one device read
        n = len(seqs)
        outputs: dict[int, tuple[Sequence, StepOutput]] = {}
        for b, seq in enumerate(seqs):
            a = host[b]
            emitted = seq.drafts[:a] + [host[n + b]]
            self.spec_stats["verify_steps"] += 1
            self.spec_stats["drafted"] += k
            self.spec_stats["accepted"] += a
            seq.computed += a + 1
            seq.drafts, seq.draft_q = [], None
            for tok in emitted:
                if seq.status is Status.FINISHED:
                    break
                self._emit(seq, tok, None, outputs)
            if seq.status is Status.RUNNING:
                end = len(seq.tokens) - 1
                keep = min(k, self.max_model_len - 1 - end, seq.request.params.max_tokens - seq.n_generated - 1)
                seq.drafts = host[2 * n + b * k:2 * n + b * k + max(keep, 0)]
        self.stats["steps"] += 1
        self.spec_stats["fixed_steps"] += 1
        return self._finish_step(seqs, outputs)

    def _accept(self, plan: list[tuple[Sequence, int]], rows: list[Row],
                logits: torch.Tensor) -> dict[int, tuple[list[int], list[TokenLogprob | None]]]:
        """Sample the rows that want logits: plain rows with the sampler, verify rows by acceptance.
        -> per sequence id: (tokens to emit, their logprobs)."""
        at, plain, spec = 0, [], []
        for (seq, _), row in zip(plan, rows):
            if not row.want_logits:
                continue
            width = len(row.tokens) if row.all_logits else 1
            (spec if row.all_logits else plain).append((seq, at, width))
            at += width
        result: dict[int, tuple[list[int], list[TokenLogprob | None]]] = {}
        if plain:
            seqs = [seq for seq, _, _ in plain]
            out = self._sample(logits[[a for _, a, _ in plain]], seqs)
            toks = out.tokens.tolist()
            lps = out.logprobs.tolist() if out.logprobs is not None else None
            tops = (out.top_ids.tolist(), out.top_logprobs.tolist()) if out.top_ids is not None else None
            for j, seq in enumerate(seqs):
                k = seq.request.params.logprobs
                lp = None
                if k is not None:
                    lp = TokenLogprob(toks[j], lps[j], list(zip(tops[0][j][:k], tops[1][j][:k])) if k and tops else [])
                result[id(seq)] = ([toks[j]], [lp])
        if spec:
            dev, V = logits.device, logits.size(-1)
            K = max(w for _, _, w in spec) - 1
            B = len(spec)
            target = torch.zeros(B, K + 1, V, dtype=torch.float64, device=dev)
            q = torch.zeros(B, K, V, dtype=torch.float64, device=dev)
            drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
            for b, (seq, a, w) in enumerate(spec):
                target[b, :w] = self.sampler.probabilities(logits[a:a + w], [seq.request.params] * w)
                if seq.draft_q is None:             # drafts of a fixed-shape greedy step: one-hot
                    seq.draft_q = torch.nn.functional.one_hot(torch.tensor(seq.drafts, device=dev), V).double()
                q[b, :w - 1] = seq.draft_q
                drafts[b, :w - 1] = torch.tensor(seq.drafts, device=dev)
            n_drafts = torch.tensor([w - 1 for _, _, w in spec], device=dev)
            seeds = torch.tensor([seq.seed for seq, _, _ in spec], device=dev)
            counters = torch.tensor([seq.n_generated for seq, _, _ in spec], device=dev)
            kept, nxt = accept(target, q, drafts, n_drafts, seeds, counters)
            kept, nxt = kept.tolist(), nxt.tolist()
            for b, (seq, a, w) in enumerate(spec):
                toks = seq.drafts[:kept[b]] + [nxt[b]]
                self.spec_stats["verify_steps"] += 1
                self.spec_stats["drafted"] += w - 1
                self.spec_stats["accepted"] += kept[b]
                lps: list[TokenLogprob | None] = [None] * len(toks)
                k = seq.request.params.logprobs
                if k is not None:
                    lp = torch.log_softmax(logits[a:a + len(toks)].double(), -1)          # [n, V]
                    own = lp.gather(1, torch.tensor(toks, device=dev).unsqueeze(1))[:, 0].tolist()
                    top = lp.topk(k, -1) if k else None
                    ids = top.indices.tolist() if top is not None else None
                    vals = top.values.tolist() if top is not None else None
                    lps = [TokenLogprob(t, own[i], list(zip(ids[i], vals[i])) if ids else [])
                           for i, t in enumerate(toks)]
                result[id(seq)] = (toks, lps)
        return result

    def _draft(self, plan: list[tuple[Sequence, int]], rows: list[Row], hidden: torch.Tensor) -> None:
        """The MTP block catches up on every row's positions whose next token is now known, and proposes
        the next drafts of each running sequence that speculates."""
        k_max = self.config.speculative
        draft_rows, owners = [], []
        at = 0
        for (seq, _), row in zip(plan, rows):
            seg, at = at, at + len(row.tokens)
            if seq.status is not Status.RUNNING or seq.request.params.penalized:
                continue
            s = row.start
            m = min(len(row.tokens), len(seq.tokens) - 1 - s)
            if m <= 0:
                continue
            end = s + m                                      # the next main input's position, when caught up
            k = 0
            if end == len(seq.tokens) - 1:
                k = min(k_max, self.max_model_len - 1 - end,
                        seq.request.params.max_tokens - seq.n_generated - 1)
                if k > 0 and not self.manager.allocate(seq.pages, end, end + k + 1):
                    k = 0                                    # no pages for the drafts: decode plainly
            draft_rows.append(DraftRow(torch.arange(seg, seg + m, device=self.device), seq.tokens[s + 1:end + 1],
                                       s, seq.pages.wtable, seq.pages.state, max(k, 0), seq.request.params,
                                       seq.seed, seq.n_generated))
            owners.append(seq)
        if not draft_rows:
            return
        for seq, (toks, q) in zip(owners, self.drafter(hidden, draft_rows)):
            if toks:
                seq.drafts, seq.draft_q = toks, q

    def _overlap_ok(self) -> bool:
        """Penalties count the previous token: those steps wait for it."""
        return self.overlap and not any(s.request.params.penalized for s in self.running)

    def _launch(self, plan: list[tuple[Sequence, int]], prev: _Step | None) -> _Step:
        order = [p for p in plan if p[1] == 1] + [p for p in plan if p[1] != 1]
        rows, src = [], []
        for seq, n in order:
            s = seq.computed
            if s >= len(seq.tokens):                        # its input token is still on the device
                src.append((len(rows), seq.pending_index))
                toks = [0]
            else:
                toks = seq.tokens[s:s + n]
            rows.append(Row(toks, s, seq.pages.wtable, seq.pages.ctable, seq.pages.state,
                            want_logits=s + n == seq.n_tokens))
        with exact_accumulation(self.config.deterministic):
            feed = (prev.sampled.tokens, src) if src else None
            logits = self.runner.run(rows, feed)
            samplers = [seq for (seq, n), row in zip(order, rows) if row.want_logits]
            sampled = self._sample(logits, samplers) if samplers else None
        for (seq, n), _row in zip(order, rows):
            seq.computed += n
            if seq.computed <= seq.prompt_len:
                self.stats["prompt_tokens"] += n
        for j, seq in enumerate(samplers):
            seq.n_pending += 1
            seq.pending_index = j
        self.stats["steps"] += 1
        return _Step(order, samplers, sampled)

    def _collect(self, step: _Step) -> list[StepOutput]:
        """Read a launched step's tokens and do the bookkeeping: stops, detokenization, pages."""
        t0 = time.perf_counter()
        sampled = step.sampled
        tokens = sampled.tokens.tolist() if sampled is not None else []              # one device read
        self.timing["wait"] += time.perf_counter() - t0
        token_lp = sampled.logprobs.tolist() if sampled is not None and sampled.logprobs is not None else None
        top_ids = sampled.top_ids.tolist() if sampled is not None and sampled.top_ids is not None else None
        top_lp = sampled.top_logprobs.tolist() if top_ids is not None else None
        outputs: dict[int, tuple[Sequence, StepOutput]] = {}
        for j, seq in enumerate(step.samplers):
            seq.n_pending -= 1
            if seq.status is Status.FINISHED:               # finished (or aborted) since: a token too many
                continue
            tok = tokens[j]
            lp = None
            if seq.request.params.logprobs is not None:
                k = seq.request.params.logprobs
                top = list(zip(top_ids[j][:k], top_lp[j][:k])) if k and top_ids is not None else []
                lp = TokenLogprob(tok, token_lp[j], top)
            self._emit(seq, tok, lp, outputs)
        return self._finish_step([seq for seq, _ in step.order], outputs)

    def _emit(self, seq: Sequence, tok: int, lp: TokenLogprob | None,
              outputs: dict[int, tuple[Sequence, StepOutput]]) -> None:
        """One generated token: append it, detokenize, apply stops; finish the sequence when it ends."""
        now = time.monotonic()
        seq.tokens.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
        self.stats["generated_tokens"] += 1
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        reason = self._stop_reason(seq, tok)
        out = outputs.setdefault(id(seq), (seq, self._output(seq)))[1]
        out.new_tokens.append(tok)
        if lp is not None:
            out.new_logprobs.append(lp)
        if seq.detok is not None:
            delta = seq.detok.add(tok)
            end = seq.stopper.check(seq.detok.text, len(delta)) if delta else None
            if end is not None:
                seq.detok.text, reason = seq.detok.text[:end], "stop"
            elif reason:
                seq.detok.flush()
            out.text += seq.stopper.releasable(seq.detok.text, finished=reason is not None)
        if reason:
            self._finish(seq, reason)

    def _finish_step(self, stepped: list[Sequence],
                     outputs: dict[int, tuple[Sequence, StepOutput]]) -> list[StepOutput]:
        """After a step's tokens are emitted: prefix-cache registration, window trimming, the outputs."""
        for seq in stepped:
            if seq.status is Status.RUNNING:
                self.manager.register(seq.pages, seq.tokens, min(seq.computed, len(seq.tokens)))
                self.manager.trim_window(seq.pages, seq.computed)
        result = []
        for seq, out in outputs.values():
            out.finished, out.finish_reason = seq.status is Status.FINISHED, seq.finish_reason
            out.completion_tokens = len(seq.tokens) - seq.prompt_len
            result.append(out)
        for rid in [r for r, req in self.requests.items() if req.finished]:
            del self.requests[rid]
        return result

    def _output(self, seq: Sequence) -> StepOutput:
        return StepOutput(seq.request.request_id, seq.index, [], [], False, None, seq.request.prompt_len,
                          seq.n_generated, seq.cached_tokens)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.request.params
        if tok in p.stop_token_ids or (tok == self.eos and not p.ignore_eos):
            return "stop"
        if len(seq.tokens) - seq.prompt_len >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"                                 # (counts tokens read: not the ones on the device)
        return None

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        params = [s.request.params for s in seqs]
        counts = mask = None
        if any(p.penalized for p in params):
            V = logits.size(-1)
            counts = torch.zeros(len(seqs), V, dtype=torch.long, device=logits.device)
            mask = torch.zeros(len(seqs), V, dtype=torch.bool, device=logits.device)
            for i, s in enumerate(seqs):
                pl = s.request.prompt_len
                if s.tokens[pl:]:
                    counts[i].index_add_(0, torch.tensor(s.tokens[pl:], device=logits.device),
                                         torch.ones(len(s.tokens) - pl, dtype=torch.long, device=logits.device))
                mask[i, torch.tensor(s.tokens[:pl], device=logits.device)] = True
        return self.sampler(logits.float(), params, [s.seed for s in seqs], [s.n_generated for s in seqs],
                            counts, mask)

    def warmup(self) -> None:
        """Capture the decode CUDA graphs (on CUDA; a no-op elsewhere) before the first request."""
        with torch.no_grad(), exact_accumulation(self.config.deterministic):
            self.runner.capture_graphs()

    # ------------------------------------------------------------------ introspection
    def metrics(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "cache_usage": self.manager.usage(),
                "prefix_hit_tokens": self.manager.hits, "prefix_query_tokens": self.manager.queries,
                "graph_steps": self.runner.graph_steps, "eager_steps": self.runner.eager_steps, **self.stats,
                "speculative": dict(self.spec_stats),
                "step_seconds": dict(self.timing)}
