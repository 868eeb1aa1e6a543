"""What runs in the next step: admission, chunked prefill, preemption and finishing, on the host only.

The scheduler knows sequences and pages (`CacheManager`), not the model, so it can be tested alone. Per step:
1. running sequences first, in arrival order: each decoding sequence gets one row of one token (with its
   speculative drafts: 1 + k tokens); each sequence still computing its prompt gets a chunk of what the
   budget has left, so a long prompt never stalls the streams;
2. waiting sequences are admitted (prefix cache looked up first) while the budget, the running limit and
   the free pages allow;
3. when a running sequence needs a page and none is free, the most recently admitted sequence that is not
   in this step yet is preempted: its pages are released and it is recomputed later from its tokens (in a
   speculative engine, up to its last token, `Sequence.resume`: its next step then verifies the drafts it
   kept, as it would have without the preemption).

Prompt chunks are counted in slots of `chunk_len` tokens (a chunk of n tokens takes ceil(n / chunk_len)
slots of the step's budget): a GPU step lays chunks out in fixed slots so that it can be replayed from a
CUDA graph (`dsv4.engine.batch`), and the plan is the same whether or not the step is padded.

A step that carries no decoding row (a burst of new prompts, as every client of a closed loop sends at
once) delays no stream, so its budget is `max_prefill_tokens`, which may exceed `max_batch_tokens`: the
burst is computed in fewer, larger steps (each sequence's chunk still at most `max_batch_tokens`). Where
a burst finds streams decoding already (its first requests were admitted while the rest were on their
way), a step may leave those streams out for one step when the waiting outnumber them (`_burst`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .cache_manager import CacheManager
from .sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_seqs: int  # sequences running at once
    max_model_len: int  # prompt + output
    max_batch_tokens: int  # tokens per step: decode rows + prompt chunks
    chunk_len: int = 1  # prompt chunks are taken in slots of this many tokens
    prefix_caching: bool = True
    # the step sizes, in chunk slots, that a padded step is laid out in (the runner's buckets); () = any.
    # Where the budget leaves room for a number of slots between two of them, the chunks take the smaller:
    # the bucket above would carry the difference as padding, computed and thrown away
    slot_sizes: tuple[int, ...] = ()
    # a step with no decoding row may take up to this many tokens (0: max_batch_tokens), in slot counts
    # of slot_sizes or prefill_slot_sizes (the runner's buckets without decode rows)
    max_prefill_tokens: int = 0
    prefill_slot_sizes: tuple[int, ...] = ()
    # speculative engines: a sequence preempted after generating keeps its drafts and is recomputed up to its
    # last token only, so that its next step is the one it would have run without the preemption
    resume_decoding: bool = False
    # positions past a decoding row that its step writes after the row (the MTP block's next drafts: k + 1),
    # allocated with the row, so that whether a sequence drafts never depends on the memory left
    draft_lookahead: int = 0


@dataclass(slots=True, eq=False)
class Scheduled:
    """One row of a step: `n` tokens of `seq` from position seq.computed."""

    seq: Sequence
    n: int

    @property
    def verify(self) -> bool:
        return bool(self.seq.drafts) and not self.seq.prefilling

    @property
    def want_logits(self) -> bool:
        """The row ends at the last known token: its next token gets sampled (or its drafts verified)."""
        return self.seq.computed + self.n == self.seq.n_tokens or self.verify


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        manager: CacheManager,
        on_prefix_hit: Callable[[Sequence, int], None] | None = None,
        stats: dict | None = None,
        on_preempt: Callable[[Sequence], None] | None = None,
    ):
        self.config = config
        self.manager = manager
        self.on_prefix_hit = on_prefix_hit  # (seq, positions served): restore its ring from the cache
        self.on_preempt = on_preempt  # (seq): a resuming sequence's pages are about to go back
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()
        self.prompts_alone = False  # the last plan's budget was max_prefill_tokens (no decode row)
        self._after_burst = False  # the last plan was a burst's (`_burst`)
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("preemptions", 0)
        self.stats.setdefault("burst_steps", 0)
        # pools that hold max_seqs sequences at max_model_len (the engine's default sizes) never force a
        # preemption, so admission needs no pages in reserve there: a reserve would keep the last seat
        # empty whenever the others hold their full pages
        w, c = self.window_pages_needed(config.max_model_len)
        self.roomy = manager.wpool.n_pages - 1 >= config.max_seqs * w and (
            manager.cpool is None or manager.cpool.n_pages - 1 >= config.max_seqs * c
        )

    # ------------------------------------------------------------------ membership
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop, length, abort): it leaves the queues and its pages go back."""
        if seq.finished:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if seq.pages is not None:
            self.manager.release(seq.pages)
            seq.pages = None
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def preempt(self, seq: Sequence) -> None:
        """Give a running sequence's pages back; it is recomputed from its tokens when readmitted (resuming:
        up to its last token, its drafts kept; `on_preempt` sees it first)."""
        seq.resume = self.config.resume_decoding and seq.n_generated > 0 and not seq.n_pending
        if seq.resume and self.on_preempt is not None:
            self.on_preempt(seq)
        if not seq.resume:
            seq.drafts, seq.draft_q = [], None
        self.running.remove(seq)
        self.manager.release(seq.pages)
        seq.pages, seq.computed, seq.status = None, 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def after_step(self, stepped: list[Sequence]) -> None:
        """Pages of the sequences a step advanced: offer complete ones to the prefix cache, release the
        window pages that fell out of the window."""
        for seq in stepped:
            if seq.running:
                self.manager.register(seq.pages, seq.tokens, min(seq.computed, len(seq.tokens)))
                self.manager.trim_window(seq.pages, seq.computed)

    # ------------------------------------------------------------------ one step
    def _done(self, seq: Sequence) -> bool:
        """Its token on the device is its last: nothing more to run for it."""
        p = seq.params
        return bool(seq.n_pending) and (seq.n_generated >= p.max_tokens or seq.n_tokens >= self.config.max_model_len)

    def _slots(self, n: int) -> int:
        return -(-n // self.config.chunk_len)

    def _chunk_budget(self, budget: int, sizes: tuple[int, ...]) -> int:
        """The tokens left for prompt chunks, in whole slots of a size that `sizes` has."""
        if not sizes or budget <= 0:
            return budget
        L = self.config.chunk_len
        fit = max((n for n in sizes if n * L <= budget), default=0)
        return fit * L

    def schedule(self) -> list[Scheduled]:
        """The rows of the next step: decoding sequences first, then prompt chunks (running, then new); in
        a burst (`_burst`) the prompts alone."""
        decoding: list[Sequence] = []
        chunked: list[Sequence] = []
        for s in self.running:
            (chunked if s.prefilling else decoding).append(s)
        burst, self._after_burst = self._burst(decoding, chunked), False
        if burst:
            plan = self._plan([], chunked)
            if plan:  # (else nothing could be admitted after all: the streams go on)
                self.stats["burst_steps"] += 1
                self._after_burst = True
                return plan
        return self._plan(decoding, chunked)

    def admit(self) -> list[Scheduled]:
        """The waiting sequences that start now, in a step of their prompts beside a step already launched
        for the running ones, which all decode (none of whose rows this plans): admission as `schedule`
        would admit them beside those decode rows - in the budget the rows leave, or in a burst's step
        (`_burst`) - so each prompt is cut into the same chunks, and computes the same numbers, either way."""
        decoding = [s for s in self.running if not self._done(s)]
        burst, self._after_burst = self._burst(decoding, []), False
        if burst:
            plan = self._plan([], [])
            if plan:
                self.stats["burst_steps"] += 1
                self._after_burst = True
                return plan
        return self._plan([], [], reserve=sum(1 + len(s.drafts) for s in decoding))

    def _burst(self, decoding: list[Sequence], chunked: list[Sequence]) -> bool:
        """Whether the next step is the waiting prompts' alone: where steps of prompts alone may take more
        than a step's budget (`max_prefill_tokens`), more sequences wait for their first token (prefilling,
        or waiting with a seat free) than are decoding, and their prompts (less what the prefix cache
        serves) overflow what a step beside the decoding rows could take. Such a step delays fewer streams,
        by one step each, than it serves, and a burst of requests (every client of a closed loop at its
        start; the clients whose requests ended together) gets its first tokens in fewer, larger steps
        instead of trickling into steps of max_batch_tokens. Never two in a row: a decoding stream waits
        one step at most."""
        c = self.config
        if not decoding or self._after_burst or c.max_prefill_tokens <= c.max_batch_tokens:
            return False
        newcomers = list(itertools.islice(self.waiting, max(0, c.max_seqs - len(self.running))))
        if len(chunked) + len(newcomers) <= len(decoding):
            return False
        tokens = sum(s.known_end - s.computed for s in chunked) + sum(self._uncached(s) for s in newcomers)
        return tokens > c.max_batch_tokens - len(decoding)

    def _uncached(self, seq: Sequence) -> int:
        """The tokens a waiting sequence would compute if admitted now: less what the prefix cache serves."""
        m = self.manager
        end = seq.known_end
        if not (m.prefix_caching and m.cached_w) or seq.computed or seq.n_pending:
            return end - seq.computed
        # (keyed once while it waits; a preempted one's tokens grew)
        if len(seq.page_keys[0]) != (end - 1) // m.P:
            seq.page_keys = m.prompt_keys(seq.tokens[:end])
        return end - m.cached_prefix(seq.page_keys)

    def _plan(self, decoding: list[Sequence], chunked: list[Sequence], reserve: int = 0) -> list[Scheduled]:
        """reserve: tokens of decode rows that run beside this plan in a step of their own (`admit`)."""
        c = self.config
        L = c.chunk_len
        P = self.manager.P
        budget = c.max_batch_tokens - reserve
        plan: list[Scheduled] = []
        planned: set[int] = set()
        look = c.draft_lookahead
        for seq in decoding:
            if budget <= 0:
                break
            # the common row, planned here: one token inside a page it has already started (no allocation;
            # with a draft lookahead, where that too stays inside the page)
            if seq.running and not seq.drafts and seq.computed % P and (seq.computed + look) // P == seq.computed // P:
                if self._done(seq):
                    continue
                plan.append(Scheduled(seq, 1))
                planned.add(id(seq))
                budget -= 1
                continue
            budget -= self._plan_row(seq, budget, plan, planned)
        sizes = c.slot_sizes
        # prompts alone: no stream waits on them (their one-token rows, a one-token prompt's, are chunks too)
        self.prompts_alone = not plan and not reserve and c.max_prefill_tokens > c.max_batch_tokens
        if self.prompts_alone:
            budget = c.max_prefill_tokens
            sizes = sizes + c.prefill_slot_sizes if sizes else ()
        budget = self._chunk_budget(budget, sizes)
        for seq in chunked:
            if budget <= 0:
                break
            budget -= self._plan_row(seq, budget, plan, planned)
        # admission keeps a few pages free (1% of each pool, as vLLM's watermark) and one for each running
        # sequence that starts a new page at its next token, so that admitting does not force a preemption
        # (where preemption can happen at all: not `roomy`)
        m = self.manager
        watermark = (max(1, m.wpool.n_pages // 100), max(1, m.cpool.n_pages // 100) if m.cpool else 0)
        at_edge = sum(1 for s in self.running if (s.computed + 1) % P == 0) if self.waiting else 0
        while self.waiting and budget >= L and len(self.running) < c.max_seqs:
            seq = self.waiting[0]
            if self._sibling_prefilling(seq) or seq.n_pending:  # (a preempted one's token is on its way)
                break
            pages = self.manager.new_sequence()
            if pages is None:
                break
            end = seq.known_end  # (its tokens all on the host: no token on its way)
            cached = self.manager.match(pages, seq.tokens[:end]) if seq.computed == 0 else 0
            n = min((budget // L) * L, end - cached, self._chunk_cap())
            reserve = (watermark[0] + at_edge, watermark[1] + at_edge) if self.running and not self.roomy else (0, 0)
            if not (
                self.manager.can_fit(cached, cached + n, reserve) and self.manager.allocate(pages, cached, cached + n)
            ):
                self.manager.release(pages)
                if not self.running:
                    raise RuntimeError(
                        "the cache cannot hold a single request's next chunk: give the "
                        "engine more cache pages or a smaller max_batch_tokens"
                    )
                break
            if cached and self.on_prefix_hit is not None:
                seq.pages = pages
                self.on_prefix_hit(seq, cached)
            self.waiting.popleft()
            seq.pages, seq.computed, seq.cached_tokens = pages, cached, max(seq.cached_tokens, cached)
            seq.status, seq.admitted_at = Status.RUNNING, next(self._admissions)
            if seq.admitted_time is None:
                seq.admitted_time = time.monotonic()
            self.running.append(seq)
            plan.append(Scheduled(seq, n))
            planned.add(id(seq))
            budget -= self._slots(n) * L
        return plan

    def _plan_row(self, seq: Sequence, budget: int, plan: list[Scheduled], planned: set[int]) -> int:
        """Plan a running sequence's row (preempting the latest admitted where it needs pages). -> the
        budget it takes: its tokens, a prompt chunk's in whole slots."""
        L, P = self.config.chunk_len, self.manager.P
        if not seq.running or self._done(seq):  # (preempted by an earlier one in this step)
            return 0
        if seq.prefilling:
            n = min(seq.known_end - seq.computed, (budget // L) * L, self._chunk_cap())
            if n <= 0:
                return 0
        else:
            n = 1 + len(seq.drafts)
        end = self._row_end(seq, n)
        # (a one-token row inside a page it has already started needs no new page)
        while (n > 1 or seq.computed % P == 0 or (end - 1) // P != seq.computed // P) and not self.manager.allocate(
            seq.pages, seq.computed, end
        ):
            victim = max((s for s in self.running if id(s) not in planned), key=lambda s: s.admitted_at)
            if victim is seq and len(self.running) == 1:  # alone, and still short: it never could go on
                raise RuntimeError(
                    f"the cache cannot hold a sequence of {end} positions even alone: give the "
                    "engine more cache pages or a smaller max_model_len"
                )
            self.preempt(victim)
            if victim is seq:
                break
        if not seq.running:
            return 0
        plan.append(Scheduled(seq, n))
        planned.add(id(seq))
        return self._slots(n) * L if seq.prefilling else n

    def _row_end(self, seq: Sequence, n: int) -> int:
        """The end of the positions a row of n tokens needs pages for: a decoding row's step writes
        `draft_lookahead` more, within max_model_len and the sequence's own last position (no drafts are
        made past its max_tokens)."""
        if seq.prefilling:
            return seq.computed + n
        last = min(self.config.max_model_len, seq.prompt_len + seq.params.max_tokens)
        return max(seq.computed + n, min(seq.computed + n + self.config.draft_lookahead, last))

    def _chunk_cap(self) -> int:
        """The most tokens of one sequence's prompt in a step: max_batch_tokens in whole slots (a larger
        prefill budget admits more sequences, not longer chunks: a sequence's window pages stay bounded)."""
        L = self.config.chunk_len
        return max(L, (self.config.max_batch_tokens // L) * L)

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """With prefix caching, choices 1..n-1 wait until choice 0 has computed the shared prompt."""
        if not self.config.prefix_caching or seq.index == 0:
            return False
        first = seq.request.sequences[0]
        return not first.finished and first.computed < first.request.prompt_len

    # ------------------------------------------------------------------ limits
    def window_pages_needed(self, prompt_len: int) -> tuple[int, int]:
        """(window, compressed) pages a prompt needs at most at once: prompts are computed in chunks of at
        most max_batch_tokens and window pages behind the window are released after each."""
        lay = self.manager.layout
        w, comp = self.manager.pages_for(0, min(self.config.max_model_len, prompt_len + 1))
        w = min(w, math.ceil((lay.window + self.config.max_batch_tokens) / lay.page_size) + 1)
        return w, comp
