"""The serving engine: requests in, tokens out, many sequences sharing one model and one paged cache.

`Engine` is synchronous: `add_request`, `abort`, and `step()`, whose loop is

    plan = scheduler.schedule()          # host: which rows run (dsv4.engine.scheduler)
    cur = runner.launch(plan)            # device: one graph replay + sampling, nothing waited for (runner)
    outputs = process(previous step)     # host: read its tokens, stops, pages (output), while cur runs

so the host's bookkeeping of step N overlaps the device's work on step N+1 (`overlap`, on by default on
CUDA). A sequence whose step-N token turns out to end it then computed one token too many, which is
dropped. Text (detokenization, stop strings) is made from the tokens by `TextStreams`, in this process
when the engine has a tokenizer, or in the server's process (`dsv4.engine.engine_process`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from .. import ops
from ..model import DeepSeekV4
from ..model.paged import CacheLayout, PagedKVCache, default_page_size
from ..ops import compiles
from ..ops.precision import exact_accumulation
from .batch import Row
from .cache_manager import CacheManager
from .config import EngineConfig
from .dspark_step import steps_for
from .healing import Vocabulary
from .mirror import Mirror
from .output import OutputProcessor, TextStreams
from .runner import InFlight, Runner, SampleRow
from .sampling import SamplingParams, SamplingTensors
from .scheduler import Scheduled, Scheduler
from .sequence import Request, RequestError, Sequence, Status, StepOutput, TokenLogprob, token_ids_ok
from .spec_step import SpeculativeSteps, check_speculative, new_stats

__all__ = ["Engine", "EngineConfig", "RequestError", "StepOutput", "TokenLogprob", "Sequence", "Request", "Status"]


class Engine:
    def __init__(
        self,
        model: DeepSeekV4,
        config: EngineConfig | None = None,
        tokenizer=None,
        eos_token_id: int | None = None,
        detokenize: bool = True,
        mirror: Mirror | None = None,
    ):
        """tokenizer: its EOS id ends sequences and, with detokenize, outputs carry text (stop strings
        applied here); detokenize=False leaves text to the caller (stop strings are then allowed).
        mirror: the engine on several workers (`dsv4.engine.mirror`; every worker builds the same engine:
        rank 0 serves, the others `follow`)."""
        self.model = model.eval()
        c = dataclasses.replace(config) if config is not None else EngineConfig()
        cfg = model.cfg
        p = model.embed.weight
        on_gpu = p.device.type == "cuda"
        graphs = c.cuda_graphs and on_gpu
        c.resolve(cfg, p.device, graphs, padded=c.pad_steps or mirror is not None)
        self.config = c
        self.max_model_len = min(c.max_model_len or min(cfg.max_seq_len, 8192), cfg.max_seq_len)
        P = c.page_size or default_page_size(cfg)
        per_seq = math.ceil(self.max_model_len / P)
        n_c = c.cache_pages or c.max_seqs * per_seq
        window_per_seq = math.ceil((cfg.window_size + c.max_batch_tokens) / P) + 1
        n_w = c.window_pages or 2 * c.max_seqs * window_per_seq
        self.layout = CacheLayout.for_model(
            cfg, n_w + 1, n_c + 1, c.max_seqs, self.max_model_len, P, page_tails=c.prefix_caching
        )
        self.cache = PagedKVCache(cfg, self.layout, p.device, p.dtype)
        mtp = bool(c.speculative) and not cfg.dspark  # the MTP block drafts: its rows fill the window pages too
        self.manager = CacheManager(
            self.layout, c.prefix_caching, has_compressed=bool(self.layout.ratios), next_token_keys=mtp
        )
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "preemptions": 0}
        self.runner = Runner(
            model,
            self.cache,
            self.manager.tables,
            cuda_graphs=graphs,
            max_decode=c.max_seqs,
            max_slots=c.max_batch_tokens // c.chunk_len,
            max_prefill_slots=c.max_prefill_tokens // c.chunk_len,
            slot_len=c.chunk_len,
            pad=c.pad_steps or mirror is not None,
            mirror=mirror,
            mtp=mtp,  # speculative steps with prompt chunks: bucketed
        )
        self.scheduler = Scheduler(
            c.scheduler_config(self.max_model_len, self.runner),
            self.manager,
            self._restore_prefix,
            self.stats,
        )
        self.sampler = self.runner.sampler
        self.overlap = on_gpu if c.overlap is None else c.overlap
        self.eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
        if eos_token_id is None and getattr(tokenizer, "eos_id", None) is not None:
            self.eos = tokenizer.eos_id
        self.tokenizer = tokenizer
        self.output = OutputProcessor(self.scheduler.finish, self.eos, self.max_model_len, self.stats, self.vocabulary)
        self.text = TextStreams(tokenizer, self.abort_sequence) if tokenizer is not None and detokenize else None
        self.spec: SpeculativeSteps | None = None
        if c.speculative:
            check_speculative(c, cfg)
            self.spec = steps_for(self, c.speculative)
            self.overlap = False  # a step reads its acceptance before the next is planned (`spec.overlap` aside)
        self._inflight: tuple[InFlight, list[Sequence], list[Sequence]] | None = None
        self.requests: dict[str, Request] = {}
        # host seconds per phase of a step: scheduling, building inputs + launching the model and the sampler,
        # waiting for the sampled tokens (the device's share), bookkeeping
        self.timing = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "post": 0.0}
        self.device = p.device
        self.vocab = cfg.vocab_size

    # ------------------------------------------------------------------ views kept for callers
    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def spec_stats(self) -> dict:
        return self.spec.stats if self.spec is not None else new_stats()

    @property
    def drafter(self):
        return self.spec.drafter if self.spec is not None else None

    @drafter.setter
    def drafter(self, value) -> None:
        self.spec.drafter = value

    def vocabulary(self) -> Vocabulary:
        """The tokenizer's token bytes, for token healing (built on the first healed request)."""
        return Vocabulary.of(self.tokenizer)

    def allowed(self, seq: Sequence):
        """The ids a sequence may draw next: those of its token-healing constraint, or None (any)."""
        return self.vocabulary().allowed(seq.heal) if seq.heal else None

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt: list[int], params: SamplingParams, n: int = 1) -> None:
        """Raise RequestError when a request cannot be served (before it is queued)."""
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        if not token_ids_ok(prompt, self.vocab):
            raise RequestError(f"prompt token ids must be integers in [0, {self.vocab})")
        if not 1 <= n <= self.config.max_n:
            raise RequestError(f"n must be in [1, {self.config.max_n}], got {n}")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this server's context is "
                f"{self.max_model_len} tokens (prompt + output), so at most "
                f"{self.max_model_len - 1} prompt tokens fit"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (this model has none): use stop_token_ids")
        if params.heal_text and self.tokenizer is None:
            raise RequestError("token healing needs a tokenizer (this engine has none)")
        if any(t >= self.vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be < the vocabulary size {self.vocab}")
        if params.top_k > self.vocab:
            raise RequestError(f"top_k must be at most the vocabulary size {self.vocab}, got {params.top_k}")
        w, c = self.scheduler.window_pages_needed(len(prompt))
        if w > self.layout.n_window_pages - 1 or c > self.layout.n_comp_pages - 1:
            raise RequestError(
                f"the prompt of {len(prompt)} tokens needs {w} window and {c} compressed cache "
                f"pages; this server has {self.layout.n_window_pages - 1} and "
                f"{self.layout.n_comp_pages - 1} in all (--cache-pages)"
            )

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, n: int = 1) -> Request:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.check_request(prompt, params, n)
        req = Request(request_id, list(prompt), params, n)
        base = params.resolved_seed()
        for i in range(n):
            seed = base if i == 0 else (base * 1_000_003 + i) % 2**63
            seq = Sequence(req, i, list(prompt), seed, prompt_len=len(prompt), heal=params.heal_text.encode())
            req.sequences.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        if self.text is not None:
            self.text.add(request_id, prompt, params, n)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages (a client that went away)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.sequences:
            self.scheduler.finish(seq, "abort")
        if self.text is not None:
            self.text.drop(request_id)

    def abort_sequence(self, request_id: str, index: int, reason: str = "stop") -> None:
        """Stop one choice of a request (a stop string found in its text); the request is forgotten once
        every choice ended (no later output would say so: the text already did)."""
        req = self.requests.get(request_id)
        if req is not None and 0 <= index < len(req.sequences):
            self.scheduler.finish(req.sequences[index], reason)
            if req.finished:
                del self.requests[request_id]

    @torch.no_grad()
    def follow(self) -> None:
        """A worker other than rank 0 of a multi-worker engine: run rank 0's steps until it stops, with the
        same numerics (`dsv4.engine.mirror`)."""
        with exact_accumulation(self.config.deterministic):
            self.runner.follow(self.spec.follow if self.spec is not None else None)

    def close(self) -> None:
        """The end of serving: the other workers of a multi-worker engine stop too."""
        self.runner.stop_followers()

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work() or self._inflight is not None or (self.spec is not None and self.spec.in_flight)
        )

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Schedule and launch one step, and return what the previous one (or, without overlap, this one)
        gave each request."""
        if self.spec is not None:
            return self._text(self.spec.step())
        prev, self._inflight = self._inflight, None
        outputs: list[StepOutput] = []
        if prev is not None and not self._overlap_ok(prev[2]):
            outputs = self._process(prev)
            prev = None
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        cur = self._launch(plan) if plan else None
        self.timing["schedule"] += t1 - t0
        self.timing["launch"] += time.perf_counter() - t1
        if prev is not None:
            outputs += self._process(prev)
        if cur is not None:
            if self.overlap:
                self._inflight = cur
            else:
                outputs += self._process(cur)
        return self._text(outputs)

    def _overlap_ok(self, sampled: list[Sequence]) -> bool:
        """Whether the next step may launch before the last one's tokens are read: not where one of those
        tokens decides the next step's draw (penalties count it; a token-healing constraint's next
        allowed tokens depend on it)."""
        return self.overlap and not any(s.heal or s.request.params.penalized for s in sampled)

    def _launch(self, plan: list[Scheduled]) -> tuple[InFlight, list[Sequence], list[Sequence]]:
        parts: tuple[list[Row], list[Row]] = ([], [])  # one-token rows, then prompt chunks
        seqs: tuple[list[Sequence], list[Sequence]] = ([], [])
        alone = self.scheduler.prompts_alone  # every row a chunk: the step fits a bucket of prompts alone
        for sch in plan:  # (up to max_seqs rows each step: the host's time per step is what the device waits for)
            seq, n = sch.seq, sch.n
            s, known = seq.computed, len(seq.tokens)
            if s >= known:  # its input token is still on the device
                row = Row([0], s, seq.pages.state, True, feed=seq.pending_index)
            else:  # (after: the MTP catch-up's next token, where the prompt goes on)
                after = seq.tokens[s + n] if s + n < known else -1
                row = Row(seq.tokens[s : s + n], s, seq.pages.state, s + n == known + seq.n_pending, after=after)
            parts[n > 1 or alone].append(row)
            seqs[n > 1 or alone].append(seq)
        decode, chunks = parts
        order, rows = seqs[0] + seqs[1], decode + chunks
        samples, samplers = [], []
        for i, seq in enumerate(order):
            if rows[i].want_logits:
                params = seq.request.params
                pen = (seq.tokens[seq.prompt_len :], seq.request.prompt) if params.penalized else None
                allowed = self.allowed(seq) if seq.heal else None
                counter = len(seq.tokens) + seq.n_pending - seq.prompt_len  # (n_generated)
                samples.append((i, SampleRow(params, seq.seed, counter, pen, allowed)))
                samplers.append(seq)
        with exact_accumulation(self.config.deterministic):
            inflight = self.runner.launch(decode, chunks, samples)
        for seq, row in zip(order, rows):
            seq.computed += len(row.tokens)
            if seq.computed <= seq.prompt_len:
                self.stats["prompt_tokens"] += len(row.tokens)
        feed = inflight.feed
        for j, seq in enumerate(samplers):
            seq.n_pending += 1
            seq.pending_index = feed[j]
        self.stats["steps"] += 1
        return inflight, order, samplers

    def _process(self, step: tuple[InFlight, list[Sequence], list[Sequence]]) -> list[StepOutput]:
        """Read a launched step's tokens and do the bookkeeping: stops, pages, outputs."""
        inflight, stepped, samplers = step
        t0 = time.perf_counter()
        toks, lps, top_ids, top_lps = inflight.read()  # one device read
        t1 = time.perf_counter()
        self.timing["wait"] += t1 - t0
        outputs: dict[int, StepOutput] = {}
        out, now = self.output, time.monotonic()
        for j, seq in enumerate(samplers):
            seq.n_pending -= 1
            if seq.finished:  # finished (or aborted) since: a token too many
                continue
            out.emit(seq, toks[j], out.logprob(seq, toks[j], lps, top_ids, top_lps, j), outputs, now)
        result = self.finish_step(stepped, outputs)
        self.timing["post"] += time.perf_counter() - t1
        return result

    def finish_step(self, stepped: list[Sequence], outputs: dict[int, StepOutput]) -> list[StepOutput]:
        """After a step's tokens are emitted: page bookkeeping, the outputs, finished requests forgotten."""
        self.scheduler.after_step(stepped)
        seqs = {id(s): s for s in stepped}
        result = self.output.finalize(outputs, seqs)
        for out in result:
            if out.finished:
                req = self.requests.get(out.request_id)
                if req is not None and req.finished:
                    del self.requests[out.request_id]
        return result

    def _text(self, outputs: list[StepOutput]) -> list[StepOutput]:
        if self.text is None:
            return outputs
        result = self.text.process(outputs)
        for out in result:
            if out.finished and out.request_id not in self.requests:
                self.text.drop(out.request_id)
        return result

    def sample_now(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Sample rows eagerly (speculative steps): logits [B, V] -> SampleOutput on the device."""
        params = [s.params for s in seqs]
        st = SamplingTensors.build(
            params, [s.seed for s in seqs], [s.n_generated for s in seqs], self.vocab, logits.device
        )
        penalties = None
        if any(p.penalized for p in params):
            rows = [
                SampleRow(s.params, s.seed, s.n_generated, (s.tokens[s.prompt_len :], s.request.prompt)) for s in seqs
            ]
            penalties = (params, *self.runner._penalty_inputs(rows))
        allowed = self.runner.allowed_mask([self.allowed(s) for s in seqs])
        return self.sampler.sample(logits.float(), st, penalties, allowed)

    def _restore_prefix(self, seq: Sequence, cached: int) -> None:
        P = self.layout.page_size
        self.runner.restore_tail(seq.pages.state, int(seq.pages.ctable[cached // P - 1]), cached)

    def warmup(self, progress=None) -> int:
        """Capture every step bucket's CUDA graph (on CUDA; a no-op elsewhere) before the first request, and
        start counting kernel compilations from here (`metrics()["kernel_compiles_after_ready"]`). The
        backends the graphs captured, and those passed over for a refusal, are `graph_backends`.
        Returns the number of graphs."""
        compiles.install()
        with torch.no_grad(), exact_accumulation(self.config.deterministic):
            with ops.which_ran() as ran, ops.which_refused() as refused:
                n = self.runner.capture_graphs(progress)
                if self.spec is not None:  # the fixed-shape speculative steps too
                    n += self.spec.capture(progress)
        self._compiles_at_ready, self.graph_backends = compiles.count(), {"ran": ran, "refused": refused}
        return n

    _compiles_at_ready: int | None = None
    graph_backends: dict = {"ran": {}, "refused": {}}  # (no graphs captured)

    # ------------------------------------------------------------------ introspection
    def metrics(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "cache_usage": self.manager.usage(),
            "prefix_hit_tokens": self.manager.hits,
            "prefix_query_tokens": self.manager.queries,
            "graph_steps": self.runner.graph_steps,
            "eager_steps": self.runner.eager_steps,
            **self.stats,
            "speculative": {**self.spec_stats, "verify_lengths": list(self.spec_stats["verify_lengths"])},
            "step_seconds": dict(self.timing),
            "kernel_compiles_after_ready": None
            if self._compiles_at_ready is None
            else compiles.count() - self._compiles_at_ready,
        }
