"""The engine's speculative steps with a DSpark draft (Flash-0731's; `dsv4.model.dspark`).

Per step, as with the MTP draft (`spec_step.SpeculativeSteps`, whose verify and acceptance this reuses):
a sequence at position c (its last token x_c not yet in the cache) carrying n drafts runs [x_c, d_1 ... d_n]
through the main model in one `append`, and rejection sampling (`speculative.accept`) keeps a prefix of
the drafts and draws one more token. What differs is what feeds the draft and how it drafts:

- every step's forward returns the main model's *taps* as well, and `write_context` turns them into
  each stage's window rows at the step's positions (prompt chunks, decodes and verifies alike; the
  positions of rejected drafts are written again by the next verify before a block reads them);
- after the step, each running sequence that decodes proposes a whole block from its newest token (the
  *anchor*, at position c' = its new length - 1): `propose` reads the context of positions c' - window
  ... c' - 1 and writes nothing. Draft i is drawn from the engine sampler's distribution q_i of the
  draft's logits with the request's settings (greedy: their argmax), from its own counter-hashed stream
  (`STREAM_DRAFT`, keyed on the drafted token's index in the sequence), so q_i is exactly what
  acceptance needs and a draft does not depend on the rest of the batch;
- the confidence head picks how many drafts the next verify checks: `verify_length` with
  `EngineConfig.speculative_threshold` (the survival probability a draft prefix must reach; 0 = always
  K), at most K and at most what the request's length limits leave. Sequences verify different numbers
  of drafts within a step; a sequence whose block verifies nothing decodes plainly for a step.

A step whose rows are all greedy decodes runs at a fixed shape (`dspark_greedy_step`: verify, argmax
acceptance, the context, the next block and its verify length, on the device with one read), replayed from
a CUDA graph on a GPU per (batch bucket, width): the width is the largest verify length of the step, and
a row with fewer drafts is padded with token 0 whose acceptance is masked (padding positions are past the
row's new length: written again before they are read, as a rejected draft's).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..model import DeepSeekV4
from ..model.dspark import Proposal, verify_length
from ..model.paged import PagedKVCache, uniform_inputs
from ..ops.precision import exact_accumulation
from .batch import Row
from .mirror import DRAFT
from .runner import Runner
from .sampling import STREAM_DRAFT, Sampler, SamplingParams, draw
from .scheduler import Scheduled
from .sequence import Sequence, StepOutput
from .spec_step import SpeculativeSteps
from .speculative import fixed_args, fixed_inputs


@dataclass
class AnchorRow:
    """One sequence's block: drafted after `token` (the anchor, at `position`, not yet in the cache)."""

    token: int
    position: int
    state: int  # ring slot (and page-table row)
    k: int  # drafts the sequence may verify at most (K, or what its limits leave)
    params: SamplingParams
    seed: int
    counter: int  # sequence index of the first drafted token


class DSparkDrafter:
    """Proposes the blocks of a step's anchors and picks each one's verify length."""

    def __init__(self, model: DeepSeekV4, runner: Runner, sampler: Sampler, k: int, threshold: float):
        self.draft = model.dspark
        if self.draft is None:
            raise ValueError("this model's draft is not DSpark")
        self.runner, self.sampler, self.cache = runner, sampler, runner.cache
        self.k, self.threshold = k, threshold

    def propose(self, rows: list[AnchorRow]) -> tuple[Proposal, list[torch.Tensor]]:
        """The blocks of rows, and q [N, V] of each of the first k slots (empty when every row is greedy:
        their q is the one-hot of the draft)."""
        r, dev = self.runner, self.runner.device
        r.sync_tables()

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        anchors, positions = ints([a.token for a in rows]), ints([a.position for a in rows])
        state, seeds, counters = (
            ints([a.state for a in rows]),
            ints([a.seed for a in rows]),
            ints([a.counter for a in rows]),
        )
        params = [a.params for a in rows]
        sampled = not all(p.greedy for p in params)
        qs: list[torch.Tensor] = []

        def choose(i: int, logits: torch.Tensor) -> torch.Tensor:
            if i >= self.k or not sampled:  # (slots past k are never verified)
                return logits.argmax(-1)
            q = self.sampler.probabilities(logits, params)  # [N, V] float64
            qs.append(q)
            return draw(q, seeds, counters + i, STREAM_DRAFT)

        return self.draft.propose(anchors, positions, r.tables_w[state], self.cache, choose), qs

    def follow(self, rows: list[AnchorRow]) -> None:
        """A follower of several workers: the blocks' device work (the stages' MoE are collectives) on rank
        0's anchors; what it drafts is rank 0's to read, so it draws nothing."""
        r = self.runner
        n = len(rows)
        ints = torch.tensor([[a.token, a.position, a.state] for a in rows], dtype=torch.long, device=r.device)
        self.draft.propose(
            ints[:, 0],
            ints[:, 1],
            r.tables_w[ints[:, 2]],
            self.cache,
            lambda i, logits: torch.zeros(n, dtype=torch.long, device=logits.device),
        )

    def __call__(self, rows: list[AnchorRow]) -> list[tuple[list[int], torch.Tensor | None]]:
        """-> per row: (the drafts to verify, their q [n, V] float64; None for a greedy row)."""
        prop, qs = self.propose(rows)
        N, k = len(rows), self.k
        n = verify_length(prop.confidence, self.threshold, k)  # [N]
        host = torch.cat([n, prop.tokens[:, :k].flatten()]).tolist()  # one device read
        q = torch.stack(qs, 1) if qs else None  # [N, k, V]
        out = []
        for b, a in enumerate(rows):
            m = max(0, min(host[b], a.k))
            toks = host[N + b * k : N + b * k + m]
            out.append((toks, q[b, :m] if q is not None and not a.params.greedy else None))
        return out


def dspark_greedy_step(
    model: DeepSeekV4,
    cache: PagedKVCache,
    tokens: torch.Tensor,
    n_drafts: torch.Tensor,
    start: torch.Tensor,
    wtable: torch.Tensor,
    ctable: torch.Tensor,
    state: torch.Tensor,
    k: int,
    threshold: float,
    share=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole greedy DSpark step for B sequences, on the device with no host synchronization (so it can be
    captured in one CUDA graph).

    tokens [B, w + 1]: each row's last token x_c and its drafts, padded; n_drafts [B]: the row's own drafts
    (acceptance stops there); start [B]: c. Verify, accept the longest prefix of drafts equal to the
    target's argmax, take the argmax after it, write the draft's context, and propose the next block from
    that token with its verify length. share (several workers, `Runner.share`): rank 0's accepted lengths
    and next tokens replace a follower's before the draft reads them. -> (accepted [B], next token [B], next
    drafts [B, k], their verify length [B]).
    """
    B, w1 = tokens.shape
    w = w1 - 1
    dev = tokens.device
    draft = model.dspark
    inputs = uniform_inputs(tokens, start, wtable, ctable, state, cache.layout)
    logits, taps = model.append(tokens, inputs, cache, return_taps=True)  # [B(w+1), V]
    target = logits.view(B, w1, -1).argmax(-1)  # [B, w+1]
    own = torch.arange(w, device=dev).unsqueeze(0) < n_drafts.unsqueeze(1)  # [B, w]
    accepted = ((tokens[:, 1:] == target[:, :w]) & own).long().cumprod(1).sum(1)  # [B]
    bonus = target.gather(1, accepted.unsqueeze(1)).squeeze(1)  # [B]
    if share is not None:
        accepted, bonus = share(torch.stack([accepted, bonus])).unbind(0)
    draft.write_context(taps, inputs, cache)
    prop = draft.propose(bonus, start + accepted + 1, wtable, cache)  # greedy
    return accepted, bonus, prop.tokens[:, :k], verify_length(prop.confidence, threshold, k)


class DSparkSteps(SpeculativeSteps):
    """`SpeculativeSteps` with the DSpark draft: up to k drafts per verify, k at most the block size."""

    OVERLAP = False  # (its steps' widths follow the drafts the host read: each is read before the next)
    FEED = 0

    def __init__(self, engine, k: int):
        cfg = engine.model.cfg
        if not 0 < k <= cfg.dspark_block_size:
            raise ValueError(
                f"speculative must be in [1, {cfg.dspark_block_size}] with this model's DSpark "
                f"draft (its block size), got {k}"
            )
        self.threshold = engine.config.speculative_threshold
        super().__init__(engine, k)
        # sequences whose last block verifies no draft (they decode plainly for a step): verify_lengths[0]
        self._unverified: weakref.WeakSet[Sequence] = weakref.WeakSet()

    def new_drafter(self) -> DSparkDrafter:
        e = self.engine
        return DSparkDrafter(e.model, e.runner, e.sampler, self.k, self.threshold)

    def _count_unverified(self, plan: list[Scheduled]) -> None:
        for sch in plan:
            if sch.seq in self._unverified and not sch.verify:
                self.stats["verify_lengths"][0] += 1
            self._unverified.discard(sch.seq)

    # ------------------------------------------------------------------ the general step
    def _forward(self, plan: list[Scheduled], rows: list[Row]) -> tuple[torch.Tensor, None]:
        """The rows through the main model with its taps, which become the draft's context here."""
        self._count_unverified(plan)
        return self._verify(rows)

    def _verify(self, rows: list[Row]) -> tuple[torch.Tensor, None]:
        e = self.engine
        tokens, inputs, _ = e.runner.inputs(rows)
        e.runner.eager_steps += 1
        logits, taps = e.model.append(tokens, inputs, e.cache, return_taps=True)
        self.drafter.draft.write_context(taps, inputs, e.cache)
        return logits, None

    def _limit(self, seq: Sequence) -> int:
        """Drafts the sequence may verify next: K, or fewer near its length limits."""
        e = self.engine
        return min(self.k, e.max_model_len - 1 - seq.computed, seq.params.max_tokens - seq.n_generated - 1)

    def _draft(self, plan: list[Scheduled], rows: list[Row], aux: None) -> None:
        """A block for every running sequence of the step that now decodes (its prompt done)."""
        anchors, owners = [], []
        for sch in plan:
            seq = sch.seq
            if not seq.running or seq.params.penalized or seq.prefilling or seq.heal:
                continue  # (a healing constraint: decodes plainly until it is spelled)
            k = self._limit(seq)
            if k > 0:
                anchors.append(
                    AnchorRow(seq.tokens[-1], seq.computed, seq.pages.state, k, seq.params, seq.seed, seq.n_generated)
                )
                owners.append(seq)
        if not anchors:
            return
        self.engine.runner.announce(DRAFT, [x for a in anchors for x in (a.token, a.position, a.state)])
        for seq, (toks, q) in zip(owners, self.drafter(anchors)):
            seq.drafts, seq.draft_q = toks, q
            if not toks:
                self._unverified.add(seq)

    def _follow_draft(self, ints: list[int]) -> None:
        arr = np.asarray(ints, np.int64).reshape(-1, 3)
        self.drafter.follow([AnchorRow(int(t), int(p), int(s), 0, SamplingParams(), 0, 0) for t, p, s in arr])

    # ------------------------------------------------------------------ the fixed-shape greedy step
    def _fixed_ok(self, plan: list[Scheduled]) -> bool:
        """Only greedy decodes (any verify lengths, the width is the largest)."""
        e = self.engine
        if not e.runner.pad or len(plan) > e.config.max_seqs:
            return False
        for sch in plan:
            seq, p = sch.seq, sch.seq.params
            if seq.prefilling or not p.greedy or p.logprobs is not None or p.penalized or seq.heal:
                return False
        w = max(len(sch.seq.drafts) for sch in plan)
        return all(
            e.manager.allocate(sch.seq.pages, sch.seq.computed, min(sch.seq.computed + w + 1, e.max_model_len))
            for sch in plan
        )  # a row's padding positions too

    def _fixed(self, plan: list[Scheduled]) -> list[StepOutput]:
        e, k = self.engine, self.k
        self._count_unverified(plan)
        seqs = [sch.seq for sch in plan]
        w = max(len(seq.drafts) for seq in seqs)
        ints = fixed_inputs(
            [[seq.tokens[seq.computed]] + seq.drafts + [0] * (w - len(seq.drafts)) for seq in seqs],
            [len(seq.drafts) for seq in seqs],
            [seq.computed for seq in seqs],
            [seq.pages.state for seq in seqs],
        )
        with exact_accumulation(e.config.deterministic):
            out = self._fixed_run(ints, w)
        accepted, bonus, drafts, lengths = out
        host = torch.cat([accepted, bonus, lengths, drafts.flatten()]).tolist()  # one device read
        n = len(seqs)
        outputs: dict[int, StepOutput] = {}
        for b, seq in enumerate(seqs):
            a = host[b]
            emitted = seq.drafts[:a] + [host[n + b]]
            if seq.drafts:
                self.count_verify(len(seq.drafts), a)
            seq.computed += a + 1
            seq.drafts, seq.draft_q = [], None
            for tok in emitted:
                if seq.finished:
                    break
                e.output.emit(seq, tok, None, outputs)
            if seq.running:
                m = max(0, min(host[2 * n + b], self._limit(seq)))
                seq.drafts = host[3 * n + b * k : 3 * n + b * k + m]
                if not seq.drafts and self._limit(seq) > 0:
                    self._unverified.add(seq)
        e.stats["steps"] += 1
        self.stats["fixed_steps"] += 1
        return e.finish_step(seqs, outputs)

    def widths(self) -> list[int]:
        """A step's width is its largest verify length: 0 ... k."""
        return list(range(self.k + 1))

    def variants(self) -> tuple[bool, ...]:
        """Greedy steps only (a sampled row verifies eagerly)."""
        return (False,)

    def _fixed_step(self, ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`dspark_greedy_step` on a fixed-shape step's integers on the device (capturable)."""
        e = self.engine
        return dspark_greedy_step(e.model, e.cache, *fixed_args(e.runner, ints), self.k, self.threshold, self._share())


def steps_for(engine, k: int) -> SpeculativeSteps:
    """The speculative steps of an engine whose config asks for k drafts: the model's own draft decides
    which (DSpark, or the first release's MTP block)."""
    return DSparkSteps(engine, k) if engine.model.cfg.dspark else SpeculativeSteps(engine, k)


__all__ = ["AnchorRow", "DSparkDrafter", "DSparkSteps", "dspark_greedy_step", "steps_for"]
