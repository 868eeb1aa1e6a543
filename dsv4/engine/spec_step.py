"""The engine's step when speculative decoding is on (`EngineConfig.speculative = k`).

A sequence that carries drafts runs them as a verify row [x_c, d_1, ..., d_k]; acceptance keeps a prefix and
draws one more token (`speculative.accept`); then the MTP block catches up on the positions that are final
and drafts the next k for each sequence (`speculative.Drafter`). A step that is only greedy verifies of
exactly k drafts runs at a fixed shape (`greedy_spec_step`), replayed from a CUDA graph on a GPU (eagerly
where steps are padded without graphs: `EngineConfig.pad_steps`, several workers on CPUs).

On several workers (`dsv4.engine.mirror`) rank 0 runs these steps and the others `follow`: each step's
rows (VERIFY), the draft's rows with the tokens rank 0 accepted (DRAFT) and the fixed-shape step's inputs
(FIXED) reach them before the device work, and every value rank 0 decides inside it (a draft that feeds
the next link, accepted lengths and next tokens) is broadcast before anything reads it (`Runner.share`).

The DSpark draft (`dspark_step.DSparkSteps`) is a subclass: the same verify and acceptance, another
forward (`_forward`: the taps and the draft's context instead of the hidden states) and another draft.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..ops.precision import exact_accumulation
from .batch import Row
from .mirror import DRAFT, FIXED, VERIFY, pack_rows, unpack_rows
from .runner import GRAPH_BUCKETS
from .scheduler import Scheduled
from .sequence import Sequence, StepOutput, TokenLogprob
from .speculative import (
    MAX_SPECULATIVE,
    Drafter,
    DraftRow,
    FixedStepGraph,
    accept,
    fixed_args,
    fixed_inputs,
    greedy_spec_step,
    pack_draft_rows,
    unpack_draft_rows,
)


def new_stats() -> dict:
    """Counters of speculative decoding: sequence-steps that verified drafts, drafts verified, drafts
    accepted, fixed-shape steps, and `verify_lengths[n]`: decode rows of speculating sequences that
    verified n drafts."""
    return {
        "verify_steps": 0,
        "drafted": 0,
        "accepted": 0,
        "fixed_steps": 0,
        "verify_lengths": [0] * (MAX_SPECULATIVE + 1),
    }


class SpeculativeSteps:
    """The steps of one `Engine` (its scheduler, runner, output processor and counters) with k drafts."""

    def __init__(self, engine, k: int):
        self.engine, self.k = engine, k
        self.drafter = self.new_drafter()
        self.graphs: dict[tuple[int, int], FixedStepGraph] = {}
        self.stats = new_stats()
        self._aux = None  # a follower: what the last VERIFY left for the DRAFT after it

    def new_drafter(self) -> Drafter:
        e = self.engine
        return Drafter(e.model, e.runner, e.sampler)

    def step(self) -> list[StepOutput]:
        e = self.engine
        t0 = time.perf_counter()
        plan = e.scheduler.schedule()
        t1 = time.perf_counter()
        if not plan:
            return []
        if self._fixed_ok(plan):
            outputs = self._greedy_fixed(plan)
            e.timing["schedule"] += t1 - t0
            e.timing["launch"] += time.perf_counter() - t1
            return outputs
        rows: list[Row] = []
        for sch in plan:
            seq, n, s = sch.seq, sch.n, sch.seq.computed
            verify = sch.verify
            toks = [seq.tokens[s]] + seq.drafts if verify else seq.tokens[s : s + n]
            rows.append(Row(toks, s, seq.pages.state, want_logits=verify or s + n == seq.n_tokens, all_logits=verify))
        e.runner.announce(VERIFY, pack_rows(rows))
        with exact_accumulation(e.config.deterministic):
            logits, aux = self._forward(plan, rows)
            emitted = self._accept(plan, rows, logits)
        t2 = time.perf_counter()
        outputs: dict[int, StepOutput] = {}
        for sch, row in zip(plan, rows):
            seq, n = sch.seq, sch.n
            if seq.computed + n <= seq.prompt_len:
                e.stats["prompt_tokens"] += n
            seq.computed += len(row.tokens) if not row.all_logits else len(emitted[id(seq)][0])
            seq.drafts, seq.draft_q = [], None
            for tok, lp in zip(*emitted.get(id(seq), ((), ()))):
                if seq.finished:
                    break
                e.output.emit(seq, tok, lp, outputs)
        e.stats["steps"] += 1
        with exact_accumulation(e.config.deterministic):
            self._draft(plan, rows, aux)
        e.timing["schedule"] += t1 - t0
        e.timing["launch"] += t2 - t1
        e.timing["post"] += time.perf_counter() - t2
        return e.finish_step([sch.seq for sch in plan], outputs)

    def _forward(self, plan: list[Scheduled], rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows through the main model, eagerly: (logits [n, V], what `_draft` reads)."""
        return self._verify(rows)

    def _verify(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """The device work of `_forward` (a follower's VERIFY): (logits, the hidden states [T, hc, dim])."""
        logits, hidden, _ = self.engine.runner.run_hidden(rows)
        return logits, hidden

    # ------------------------------------------------------------------ a follower of several workers
    def follow(self, kind: int, values: list[int]) -> None:
        """Rank 0's message `kind` (header values after the kind: the payload's length first): the same
        device work on rank 0's values (`dsv4.engine.mirror`)."""
        ints = self.engine.runner.mirror.recv_ints(values[0])
        if kind == VERIFY:
            self._aux = self._verify(unpack_rows(ints))[1]
        elif kind == DRAFT:
            self._follow_draft(ints)
            self._aux = None
        elif kind == FIXED:
            self._follow_fixed(*values[1:4])
        else:
            raise RuntimeError(f"unknown message {kind} from rank 0")

    def _follow_draft(self, ints: list[int]) -> None:
        self.drafter.follow(self._aux, unpack_draft_rows(ints))

    def count_verify(self, drafted: int, accepted: int) -> None:
        """One sequence-step that verified `drafted` drafts and kept `accepted`."""
        st = self.stats
        st["verify_steps"] += 1
        st["drafted"] += drafted
        st["accepted"] += accepted
        st["verify_lengths"][drafted] += 1

    # ------------------------------------------------------------------ the fixed-shape greedy step
    def _fixed_ok(self, plan: list[Scheduled]) -> bool:
        """Only greedy verifies of exactly k drafts: the common case of speculative decode."""
        e = self.engine
        if not e.runner.pad or len(plan) > e.config.max_seqs:
            return False
        for sch in plan:
            seq, p = sch.seq, sch.seq.params
            if (
                seq.prefilling
                or len(seq.drafts) != self.k
                or not p.greedy
                or p.logprobs is not None
                or p.penalized
                or seq.heal
            ):
                return False
        return all(
            e.manager.allocate(sch.seq.pages, sch.seq.computed, min(sch.seq.computed + 2 * self.k + 1, e.max_model_len))
            for sch in plan
        )  # the next drafts' positions too (their MTP rows are written now)

    def _greedy_fixed(self, plan: list[Scheduled]) -> list[StepOutput]:
        e, k = self.engine, self.k
        seqs = [sch.seq for sch in plan]
        ints = fixed_inputs(
            [[seq.tokens[seq.computed]] + seq.drafts for seq in seqs],
            [k] * len(seqs),
            [seq.computed for seq in seqs],
            [seq.pages.state for seq in seqs],
        )
        with exact_accumulation(e.config.deterministic):
            accepted, bonus, drafts = self._fixed_run(ints)
        host = torch.cat([accepted, bonus, drafts.flatten()]).tolist()  # one device read
        n = len(seqs)
        outputs: dict[int, StepOutput] = {}
        for b, seq in enumerate(seqs):
            a = host[b]
            emitted = seq.drafts[:a] + [host[n + b]]
            self.count_verify(k, a)
            seq.computed += a + 1
            seq.drafts, seq.draft_q = [], None
            for tok in emitted:
                if seq.finished:
                    break
                e.output.emit(seq, tok, None, outputs)
            if seq.running:
                end = len(seq.tokens) - 1
                keep = min(k, e.max_model_len - 1 - end, seq.params.max_tokens - seq.n_generated - 1)
                seq.drafts = host[2 * n + b * k : 2 * n + b * k + max(keep, 0)]
        e.stats["steps"] += 1
        self.stats["fixed_steps"] += 1
        return e.finish_step(seqs, outputs)

    def _fixed_run(self, ints: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The fixed-shape step of n rows of width w (ints [n, w + 4], `fixed_inputs`): replayed from the
        graph of its batch bucket and width (captured on first use), or eagerly. -> its outputs, n rows."""
        r = self.engine.runner
        n, w = ints.shape[0], ints.shape[1] - 4
        batch = next(b for b in GRAPH_BUCKETS if b >= n) if r.cuda_graphs else n
        r.sync_tables()
        r.announce(FIXED, [], batch, w, n)  # before a capture: every worker captures here
        if r.cuda_graphs:
            return self._graph(batch, w).run(ints)
        return self._fixed_step(r.share(torch.from_numpy(ints).to(r.device)))

    def _follow_fixed(self, batch: int, w: int, n: int) -> None:
        r = self.engine.runner
        if r.cuda_graphs:
            self._graph(batch, w).follow()
        else:
            self._fixed_step(r.share(torch.empty(n, w + 4, dtype=torch.long, device=r.device)))

    def _graph(self, batch: int, w: int) -> FixedStepGraph:
        graph = self.graphs.get((batch, w))
        if graph is None:
            graph = self.graphs[(batch, w)] = FixedStepGraph(self.engine.runner, batch, w, self._fixed_step)
        return graph

    def _fixed_step(self, ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`greedy_spec_step` on a fixed-shape step's integers on the device (capturable)."""
        e = self.engine
        tokens, _, start, wtable, ctable, state = fixed_args(e.runner, ints)
        return greedy_spec_step(e.model, e.cache, tokens, start, wtable, ctable, state, self._share())

    def _share(self):
        """`Runner.share` on several workers, else nothing to share."""
        r = self.engine.runner
        return r.share if r.mirror is not None else None

    # ------------------------------------------------------------------ the general step
    def _accept(
        self, plan: list[Scheduled], rows: list[Row], logits: torch.Tensor
    ) -> dict[int, tuple[list[int], list[TokenLogprob | None]]]:
        """Sample the rows that want logits: plain rows with the sampler, verify rows by acceptance.
        -> per sequence id: (tokens to emit, their logprobs)."""
        e = self.engine
        at, plain, spec = 0, [], []
        for sch, row in zip(plan, rows):
            if not row.want_logits:
                continue
            width = len(row.tokens) if row.all_logits else 1
            (spec if row.all_logits else plain).append((sch.seq, at, width))
            at += width
        result: dict[int, tuple[list[int], list[TokenLogprob | None]]] = {}
        if plain:
            seqs = [seq for seq, _, _ in plain]
            out = e.sample_now(logits[[a for _, a, _ in plain]], seqs)
            toks = out.tokens.tolist()
            lps = out.logprobs.tolist() if out.logprobs is not None else None
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_ids is not None else None
            for j, seq in enumerate(seqs):
                result[id(seq)] = ([toks[j]], [e.output.logprob(seq, toks[j], lps, top_ids, top_lps, j)])
        if spec:
            dev, V = logits.device, logits.size(-1)
            K = max(w for _, _, w in spec) - 1
            B = len(spec)
            target = torch.zeros(B, K + 1, V, dtype=torch.float64, device=dev)
            q = torch.zeros(B, K, V, dtype=torch.float64, device=dev)
            drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
            for b, (seq, a, w) in enumerate(spec):
                target[b, :w] = e.sampler.probabilities(logits[a : a + w], [seq.params] * w)
                if seq.draft_q is None:  # drafts of a fixed-shape greedy step: one-hot
                    seq.draft_q = torch.nn.functional.one_hot(torch.tensor(seq.drafts, device=dev), V).double()
                q[b, : w - 1] = seq.draft_q
                drafts[b, : w - 1] = torch.tensor(seq.drafts, device=dev)
            n_drafts = torch.tensor([w - 1 for _, _, w in spec], device=dev)
            seeds = torch.tensor([seq.seed for seq, _, _ in spec], device=dev)
            counters = torch.tensor([seq.n_generated for seq, _, _ in spec], device=dev)
            kept, nxt = accept(target, q, drafts, n_drafts, seeds, counters)
            kept, nxt = kept.tolist(), nxt.tolist()
            for b, (seq, a, w) in enumerate(spec):
                toks = seq.drafts[: kept[b]] + [nxt[b]]
                self.count_verify(w - 1, kept[b])
                lps: list[TokenLogprob | None] = [None] * len(toks)
                k = seq.params.logprobs
                if k is not None:
                    lp = torch.log_softmax(logits[a : a + len(toks)].double(), -1)  # [n, V]
                    own = lp.gather(1, torch.tensor(toks, device=dev).unsqueeze(1))[:, 0].tolist()
                    top = lp.topk(k, -1) if k else None
                    ids = top.indices.tolist() if top is not None else None
                    vals = top.values.tolist() if top is not None else None
                    lps = [
                        TokenLogprob(t, own[i], list(zip(ids[i], vals[i])) if ids else []) for i, t in enumerate(toks)
                    ]
                result[id(seq)] = (toks, lps)
        return result

    def _draft(self, plan: list[Scheduled], rows: list[Row], hidden: torch.Tensor) -> None:
        """The MTP block catches up on every row's positions whose next token is now known, and proposes
        the next drafts of each running sequence that speculates."""
        e = self.engine
        draft_rows, owners = [], []
        at = 0
        for sch, row in zip(plan, rows):
            seq: Sequence = sch.seq
            seg, at = at, at + len(row.tokens)
            if not seq.running or seq.params.penalized:
                continue
            s = row.start
            m = min(len(row.tokens), len(seq.tokens) - 1 - s)
            if m <= 0:
                continue
            end = s + m  # the next main input's position, when caught up
            k = 0
            if end == len(seq.tokens) - 1 and not seq.heal:  # (a healing constraint: no drafts yet)
                k = min(self.k, e.max_model_len - 1 - end, seq.params.max_tokens - seq.n_generated - 1)
                if k > 0 and not e.manager.allocate(seq.pages, end, end + k + 1):
                    k = 0  # no pages for the drafts: decode plainly
            draft_rows.append(
                DraftRow(
                    seg,
                    seq.tokens[s + 1 : end + 1],
                    s,
                    seq.pages.state,
                    max(k, 0),
                    seq.params,
                    seq.seed,
                    seq.n_generated,
                )
            )
            owners.append(seq)
        if not draft_rows:
            return
        e.runner.announce(DRAFT, pack_draft_rows(draft_rows))
        for seq, (toks, q) in zip(owners, self.drafter(hidden, draft_rows)):
            if toks:
                seq.drafts, seq.draft_q = toks, q
