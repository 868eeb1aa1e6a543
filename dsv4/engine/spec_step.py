"""The engine's step when speculative decoding is on (`EngineConfig.speculative = k`).

A sequence that carries drafts runs them as a verify row [x_c, d_1, ..., d_k]; acceptance keeps a prefix and
draws one more token (`speculative.accept`); then the MTP block catches up on the positions that are final
and drafts the next k for each sequence (`speculative.Drafter`). Where steps are padded (a GPU's graphs;
`EngineConfig.pad_steps`, several workers on CPUs), a step of decodes with at most k drafts each, greedy or
sampled without top-k / top-p / min-p, runs at a fixed shape (`speculative.spec_step`: a greedy and a
sampled variant per batch bucket, every graph captured at warm-up), and a step with prompt chunks runs
them in the engine's bucketed step, whose graph also runs the MTP block's catch-up (`_split`), as it does
the decodes of a token-healing constraint (their draw masked in the graph); other steps run eagerly.

On several workers (`dsv4.engine.mirror`) rank 0 runs these steps and the others `follow`: each step's
rows (VERIFY), the draft's rows with the tokens rank 0 accepted (DRAFT) and the fixed-shape step's inputs
(FIXED) reach them before the device work, and every value rank 0 decides inside it (a draft that feeds
the next link, accepted lengths and next tokens) is broadcast before anything reads it (`Runner.share`).

The DSpark draft (`dspark_step.DSparkSteps`) is a subclass: the same verify and acceptance, another
forward (`_forward`: the taps and the draft's context instead of the hidden states) and another draft.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import ops
from ..ops.precision import exact_accumulation
from .batch import Row
from .mirror import DRAFT, FIXED, VERIFY, pack_rows, unpack_rows
from .runner import GRAPH_BUCKETS
from .sampling import SamplingTensors
from .scheduler import Scheduled
from .sequence import Sequence, StepOutput, TokenLogprob
from .speculative import (
    FEED_COLS,
    MAX_SPECULATIVE,
    SAMPLING_COLS,
    Drafter,
    DraftRow,
    FixedStepGraph,
    accept,
    feed_columns,
    fixed_inputs,
    pack_draft_rows,
    sampling_args,
    spec_step,
    unpack_draft_rows,
)


def new_stats() -> dict:
    """Counters of speculative decoding: sequence-steps that verified drafts, drafts verified, drafts
    accepted, fixed-shape steps and their rows (`fixed_rows`), those of them launched before the last one
    was read (`fed_steps`), rows that joined such a step with their own integers (`joined`: a prompt that
    had just ended), prompt steps launched beside a fed step in flight (`admitted`) and the rows whose first
    decode joined the next fed step from the carry such a prompt step left (`carried`), and
    `verify_lengths[n]`: decode rows of speculating sequences that verified n drafts."""
    return {
        "verify_steps": 0,
        "drafted": 0,
        "accepted": 0,
        "fixed_steps": 0,
        "fixed_rows": 0,
        "fed_steps": 0,
        "joined": 0,
        "admitted": 0,
        "carried": 0,
        "verify_lengths": [0] * (MAX_SPECULATIVE + 1),
    }


def check_speculative(config, cfg) -> None:
    """Refuse, in one line, an engine config's speculative settings that the model cannot run."""
    if not 0 < config.speculative <= MAX_SPECULATIVE:
        raise ValueError(f"speculative must be in [0, {MAX_SPECULATIVE}] draft tokens, got {config.speculative}")
    if not 0 <= config.speculative_threshold <= 1:
        raise ValueError(f"speculative_threshold must be in [0, 1], got {config.speculative_threshold}")
    if config.speculative_threshold and not cfg.dspark:
        raise ValueError(
            "speculative_threshold applies to a DSpark draft's confidence head; this "
            "model drafts with an MTP block, which has none"
        )


class _Readback:
    """Pinned host buffers that a fixed-shape step's results are copied into (one step's at a time): per row
    its accepted count, next token and k next drafts; with log-probabilities, k + 1 floats."""

    def __init__(self, device: torch.device, rows: int, k: int):
        self.cuda = device.type == "cuda"
        self.ints = torch.zeros(rows * (k + 2), dtype=torch.long, pin_memory=self.cuda)
        self.floats = torch.zeros(rows * (k + 1), dtype=torch.float64, pin_memory=self.cuda)

    def copy(self, ints: torch.Tensor, floats: torch.Tensor | None) -> torch.cuda.Event | None:
        self.ints[: ints.numel()].copy_(ints, non_blocking=self.cuda)
        if floats is not None:
            self.floats[: floats.numel()].copy_(floats, non_blocking=self.cuda)
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev


@dataclass
class FixedInFlight:
    """A launched fixed-shape step: its sequences and where its results arrive on the host."""

    seqs: list[Sequence]
    readback: _Readback
    event: torch.cuda.Event | None
    logprobs: bool


class SpeculativeSteps:
    """The steps of one `Engine` (its scheduler, runner, output processor and counters) with k drafts."""

    OVERLAP = True  # fixed-shape steps may overlap (off on several workers, and where the engine's overlap is)
    FEED = FEED_COLS  # integers per row of a fixed-shape step after `fixed_inputs`' (`ops.read_carry`)

    def __init__(self, engine, k: int):
        self.engine, self.k = engine, k
        r = engine.runner
        # the logits that drafted each table row's drafts (their q, for a sampled fixed-shape step)
        self.draft_store = (
            torch.zeros(r.tables.w.shape[0], k, engine.model.cfg.vocab_size, dtype=torch.float32, device=r.device)
            if True in self.variants()
            else None
        )
        self.drafter = self.new_drafter()
        engine.scheduler.on_preempt = self._keep_draft_logits
        self._kept: list[Sequence] = []  # preempted sequences holding their draft logits (`_keep_draft_logits`)
        self.graphs: dict[tuple[int, int, bool], FixedStepGraph] = {}
        self.stats = new_stats()
        self._aux = None  # a follower: what the last VERIFY left for the DRAFT after it
        self._prompt: set[int] = set()  # the eager step's sequences that `_split` would bucket (no drafts after)
        # overlap: a fixed-shape step of the same sequences is launched before the last one is read, its rows
        # fed from what that step left on the device (`carry`: per table row, the next step's integers)
        self.overlap = self.OVERLAP and engine.overlap and r.mirror is None
        self.carry = torch.zeros(r.tables.w.shape[0], k + 4, dtype=torch.long, device=r.device) if self.FEED else None
        self._inflight: FixedInFlight | None = None
        # a prompt step launched beside the fed step in flight (`_admit`), read at the next step, and the
        # sequences whose first token it leaves in the carry (they join the next fed step from there)
        self._admitted = None
        self._carried: set[int] = set()
        rows = min(engine.config.max_seqs, GRAPH_BUCKETS[-1])  # (a fixed-shape step's most)
        self._readback = [_Readback(r.device, rows, k) for _ in range(2)]  # used in turn
        self._turn = 0

    @property
    def drafter(self) -> Drafter:
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter) -> None:
        """A drafter set from outside (`Engine.drafter`) keeps its drafts' logits where this engine's
        fixed-shape steps read them."""
        if getattr(drafter, "store", False) is None:
            drafter.store = self.draft_store
        self._drafter = drafter

    def new_drafter(self) -> Drafter:
        e = self.engine
        return Drafter(e.model, e.runner, e.sampler, self.draft_store)

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None or self._admitted is not None

    def step(self) -> list[StepOutput]:
        e = self.engine
        done: list[StepOutput] = []
        prev, self._inflight = self._inflight, None
        admitted, self._admitted = self._admitted, None
        if prev is not None:
            t0 = time.perf_counter()
            self._inflight = self._feed(prev)  # the next step of the same sequences, before reading this one
            self._carried.clear()
            e.timing["launch"] += time.perf_counter() - t0
            done = self._fixed_finish(prev)
            if admitted is not None:  # (launched after prev: its prompts' first tokens)
                done += e._process(admitted)
            if self._inflight is not None:
                return done + self._admit()
        elif admitted is not None:
            done = e._process(admitted)
        t0 = time.perf_counter()
        plan = e.scheduler.schedule()
        self._restore_draft_logits()
        t1 = time.perf_counter()
        if not plan:
            return done
        if self._fixed_ok(plan) or self._split_ok(plan):
            inside = e.timing["wait"] + e.timing["post"]  # (the steps time their own read and bookkeeping)
            if any(map(self._bucketed, plan)):
                outputs = self._split(plan)
            elif self.overlap:  # read at the next step, after the one it feeds is launched
                outputs, self._inflight = [], self._fixed_launch([sch.seq for sch in plan])
            else:
                outputs = self._fixed(plan)
            e.timing["schedule"] += t1 - t0
            e.timing["launch"] += time.perf_counter() - t1 - (e.timing["wait"] + e.timing["post"] - inside)
            return done + outputs
        e.timing["schedule"] += t1 - t0
        return done + self._general(plan)

    def _general(self, plan: list[Scheduled]) -> list[StepOutput]:
        """A step of any rows, eagerly: verify (or prompt chunks, plain decodes), acceptance, the draft."""
        e = self.engine
        t1 = time.perf_counter()
        self._prompt = {id(sch.seq) for sch in plan if self._bucketed(sch)}  # (they draft from the next step)
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
            if row.want_logits:  # (drafts verified, or none; a resuming recompute keeps its drafts)
                seq.drafts, seq.draft_q = [], None
            for tok, lp in zip(*emitted.get(id(seq), ((), ()))):
                if seq.finished:
                    break
                e.output.emit(seq, tok, lp, outputs)
        e.stats["steps"] += 1
        with exact_accumulation(e.config.deterministic):
            self._draft(plan, rows, aux)
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
            self._follow_fixed(*values[1:5])
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

    # ------------------------------------------------------------------ the fixed-shape step
    def _fixed_ok(self, plan: list[Scheduled]) -> bool:
        """Only decodes with at most k drafts, greedy or sampled without top-k / top-p / min-p, no penalties,
        at most their own log-probabilities: the common case of speculative decode."""
        e = self.engine
        if not e.runner.pad or len(plan) > min(e.config.max_seqs, GRAPH_BUCKETS[-1]):
            return False
        for sch in plan:
            seq, p = sch.seq, sch.seq.params
            if (
                seq.prefilling
                or len(seq.drafts) > self.k
                or p.logprobs
                or p.penalized
                or seq.heal
                or (not p.greedy and p.filtered)
            ):
                return False
        return all(
            e.manager.allocate(sch.seq.pages, sch.seq.computed, min(sch.seq.computed + 2 * self.k + 1, e.max_model_len))
            for sch in plan
        )  # the next drafts' positions too (their MTP rows are written now)

    @staticmethod
    def _bucketed(sch: Scheduled) -> bool:
        """Whether a row goes through the engine's bucketed step, not the fixed-shape one: prompt chunks, and
        decodes under a token-healing constraint (which draft nothing: `_draft`)."""
        return sch.seq.prefilling or bool(sch.seq.heal)

    def _split_ok(self, plan: list[Scheduled]) -> bool:
        """Prompt chunks and healing decodes that a bucket's graph runs with the MTP catch-up (`Runner(mtp=True)`:
        drawn in the graph, at most `Runner.heal_rows` of them under a constraint) beside decodes that the
        fixed-shape step takes."""
        r = self.engine.runner
        if not (r.mtp and r.pad):
            return False
        bucketed = [sch for sch in plan if self._bucketed(sch)]
        if not bucketed or any(
            (sch.seq.drafts and sch.want_logits) or not SamplingTensors.plain([sch.seq.params]) for sch in bucketed
        ):  # (a resuming recompute's drafts wait for its next step)
            return False
        if sum(bool(sch.seq.heal) for sch in bucketed) > r.heal_rows:
            return False
        slots = sum(-(-sch.n // r.slot_len) for sch in bucketed if sch.n > 1)
        if r.bucket_for(sum(sch.n == 1 for sch in bucketed), slots) is None:
            return False
        decode = [sch for sch in plan if not self._bucketed(sch)]
        return not decode or self._fixed_ok(decode)

    def _split(self, plan: list[Scheduled]) -> list[StepOutput]:
        """The prompt chunks (and healing decodes) through the engine's bucketed step (its graph writes the
        MTP block's rows too: a sequence whose prompt ends here decodes its next token in a fixed-shape step
        with no drafts, and drafts from there), then the decodes in the fixed-shape step."""
        e = self.engine
        decode = [sch for sch in plan if not self._bucketed(sch)]
        prompt = e._launch([sch for sch in plan if self._bucketed(sch)])  # (read after the decodes' step)
        outputs = []
        if decode:
            if self.overlap:  # read at the next step, which a prompt that ends here may join (`_feed`)
                self._inflight = self._fixed_launch([sch.seq for sch in decode])
            else:
                outputs = self._fixed(decode)
            e.stats["steps"] -= 1  # (one step of the engine)
        return e._process(prompt) + outputs

    @staticmethod
    def _sampled(seqs: list[Sequence]) -> bool:
        """Whether a fixed-shape step of these sequences takes the sampled variant of `spec_step`."""
        return any(not s.params.greedy for s in seqs)

    def _keep_draft_logits(self, seq: Sequence) -> None:
        """`Scheduler.on_preempt`: a sampled sequence that resumes keeps the logits that drew its drafts (its
        table row's are another sequence's from now on), which a fixed-shape step reads for their q."""
        if seq.drafts and self.draft_store is not None and not seq.params.greedy:
            seq.draft_logits = self.draft_store[seq.pages.state, : len(seq.drafts)].clone()
            self._kept.append(seq)

    def _restore_draft_logits(self) -> None:
        """Kept draft logits into the table row of each sequence readmitted since (after the schedule that
        readmits it, before any step reads the store); one that ended while waiting drops them. Nothing to
        do in the common step: no preempted sequence keeps any."""
        if not self._kept:
            return
        waiting = []
        for seq in self._kept:
            if seq.running:
                self.draft_store[seq.pages.state, : seq.draft_logits.size(0)] = seq.draft_logits
                seq.draft_logits = None
            elif not seq.finished:
                waiting.append(seq)
            else:
                seq.draft_logits = None
        self._kept = waiting

    def _fixed(self, plan: list[Scheduled]) -> list[StepOutput]:
        return self._fixed_finish(self._fixed_launch([sch.seq for sch in plan]))

    def _feed(self, prev: FixedInFlight) -> FixedInFlight | None:
        """The next fixed-shape step of the sequences of `prev` (not read yet; one that ended since takes no
        row), fed from the carry its rows left on the device, where nothing else could run instead: no
        request waits that could start now other than beside it (`_admit`), the budget holds the verify
        rows, and pages for the furthest positions the step can reach are there. A running sequence that was
        not in it joins: fed from the carry where a prompt step beside the last fed step left its first token
        there (`_carried`), else with its own row where a fixed-shape step can take it and the host knows its
        tokens (a prompt that ended in the step before: its first token read, no drafts yet). A new request
        then costs no wait for the device. -> the step launched, or None."""
        e, k = self.engine, self.k
        sch = e.scheduler
        if sch.waiting and not self._can_admit():
            return None
        seqs = [s for s in prev.seqs if s.running]
        known = {id(s) for s in seqs}
        new = [s for s in sch.running if id(s) not in known]
        carried = [s for s in new if id(s) in self._carried]
        own = [s for s in new if id(s) not in self._carried]
        if not all(map(self._joins, own)) or not (seqs or new):
            return None
        n = len(seqs) + len(new)
        if n * (k + 1) > e.config.max_batch_tokens or n > min(e.config.max_seqs, GRAPH_BUCKETS[-1]):
            return None
        # (the host's position is one step behind: up to k + 1 tokens, then this step's and the drafts' rows)
        if not all(e.manager.allocate(s.pages, s.computed, min(s.computed + 3 * k + 2, e.max_model_len)) for s in seqs):
            return None
        if not all(e.manager.allocate(s.pages, s.computed, min(s.computed + 2 * k + 1, e.max_model_len)) for s in new):
            return None
        self.stats["carried"] += len(carried)
        fed = [True] * (len(seqs) + len(carried)) + [False] * len(own)
        return self._fixed_launch(seqs + carried + own, fed=fed)

    def _can_admit(self) -> bool:
        """Whether the waiting requests that could start next may start in a prompt step beside a fed step in
        flight (`_admit`): overlap with the carry, the engine's buckets with the MTP catch-up, a cache that
        never preempts (the sequences in flight keep their pages), and requests that such a step draws for
        in its graph and whose next decode a fixed-shape step takes (no penalties, no top-k / top-p / min-p,
        no top log-probabilities, no token-healing constraint), none preempted before."""
        e = self.engine
        r, sch = e.runner, e.scheduler
        if not (self.overlap and self.carry is not None and r.mtp and r.pad and sch.roomy):
            return False
        room = max(1, e.config.max_seqs - len(sch.running))
        return all(
            s.params.plain and not (s.heal or s.computed or s.n_pending) for s in itertools.islice(sch.waiting, room)
        )

    def _admit(self) -> list[StepOutput]:
        """Waiting requests started beside the fed step just launched: their prompts in the engine's bucketed
        step (its graph draws each first token and runs the MTP catch-up), queued on the device behind the
        fed step, read at the next step (`_admitted`); each first token is copied into its sequence's carry
        on the device, so its first decode joins the next fed step from there (`_carried`) before the host
        has read it. -> outputs of an eager step, where the plan's rows are not a bucket's."""
        e = self.engine
        if not (e.scheduler.waiting and self._can_admit()):
            return []
        t0 = time.perf_counter()
        plan = e.scheduler.admit()
        self._restore_draft_logits()
        t1 = time.perf_counter()
        e.timing["schedule"] += t1 - t0
        # (a row of one token, a prompt of one token or all but one served by the prefix cache, is a decode's:
        # it joins the next fed step with its own row, `_joins`, as the schedule would have put it in this one)
        plan = [sch for sch in plan if self._bucketed(sch)]
        if not plan:
            return []
        if not self._split_ok(plan):
            return self._general(plan)
        self._admitted = e._launch(plan)
        self.stats["admitted"] += 1
        e.stats["steps"] -= 1  # (one step of the engine)
        ready = [s for s in self._admitted[2] if not s.prefilling]  # (sampled: prompts that ended here)
        if ready:
            self._carry_first_tokens(ready)
            self._carried = {id(s) for s in ready}
        e.timing["launch"] += time.perf_counter() - t1
        return []

    def _carry_first_tokens(self, seqs: list[Sequence]) -> None:
        """carry[table row] of each sequence = the integers of its first decode (`write_carry`'s layout): its
        first token, still on the device in the runner's draws, at position `computed`, no drafts, one token
        generated - copied there on the device, after the prompt step that draws it."""
        r, k = self.engine.runner, self.k
        rows = [[s.pending_index, s.pages.state, s.computed, s.n_generated] for s in seqs]
        host = torch.tensor(rows, dtype=torch.long)
        if r.device.type == "cuda":
            host = host.pin_memory()  # (an asynchronous copy: the host does not wait for the device)
        d = host.to(r.device, non_blocking=True)  # [n, 4]
        zeros = torch.zeros(len(seqs), k + 1, dtype=torch.long, device=r.device)  # the drafts, their count
        self.carry[d[:, 1]] = torch.cat([r.sampled[d[:, 0]].unsqueeze(1), zeros, d[:, 2:]], 1)

    def _joins(self, seq: Sequence) -> bool:
        """Whether a running sequence outside the step in flight can join the next one with its own row: a
        decode that a fixed-shape step takes (`_fixed_ok`'s rules), its tokens all on the host."""
        p = seq.params
        return seq.running and not (
            seq.prefilling
            or seq.n_pending
            or seq.computed >= len(seq.tokens)
            or len(seq.drafts) > self.k
            or p.logprobs
            or p.penalized
            or seq.heal
            or (not p.greedy and p.filtered)
        )

    def _fixed_launch(self, seqs: list[Sequence], fed: bool | list[bool] = False) -> FixedInFlight:
        """Launch a fixed-shape step of these sequences (fed: all their rows, or each row's, from the carry)
        and start copying its results to the host; nothing is waited for."""
        e, k = self.engine, self.k
        feds = fed if isinstance(fed, list) else [fed] * len(seqs)
        sampled = self._sampled(seqs)
        blank = [0] * (k + 1)
        ints = fixed_inputs(
            [
                blank if f else [seq.tokens[seq.computed]] + seq.drafts + blank[: k - len(seq.drafts)]
                for seq, f in zip(seqs, feds)
            ],
            [0 if f else len(seq.drafts) for seq, f in zip(seqs, feds)],
            [0 if f else seq.computed for seq, f in zip(seqs, feds)],
            [seq.pages.state for seq in seqs],
            (
                [s.seed for s in seqs],
                [s.n_generated for s in seqs],
                [s.params.greedy for s in seqs],
                [s.params.temperature for s in seqs],
            )
            if sampled
            else None,
        )
        feed = feed_columns(feds, [s.n_generated for s in seqs], [s.params.max_tokens for s in seqs])
        with exact_accumulation(e.config.deterministic):
            out = self._fixed_run(np.concatenate([ints, feed], 1), k, sampled)
        want = any(s.params.logprobs is not None for s in seqs)
        rb, self._turn = self._readback[self._turn], self._turn ^ 1
        event = rb.copy(torch.cat([out[0], out[1], out[2].flatten()]), out[3].flatten() if want else None)
        e.stats["steps"] += 1
        self.stats["fixed_steps"] += 1
        self.stats["fixed_rows"] += len(seqs)
        self.stats["fed_steps"] += any(feds)
        self.stats["joined"] += any(feds) * feds.count(False)
        return FixedInFlight(seqs, rb, event, want)

    def _fixed_finish(self, step: FixedInFlight) -> list[StepOutput]:
        """Read a fixed-shape step's results (waits for the device) and do the bookkeeping: emit each
        sequence's accepted drafts and next token, keep its next drafts. A sequence that ended since the
        step was launched (a stop found in the step before, an abort) takes nothing from it."""
        e, k, seqs = self.engine, self.k, step.seqs
        n = len(seqs)
        t0 = time.perf_counter()
        if step.event is not None:
            step.event.synchronize()
        host = step.readback.ints[: 2 * n + n * k].tolist()
        # (float64, rounded to float32 as the plain draw's: the same number whichever step computed a token's)
        lps = step.readback.floats[: n * (k + 1)].float().tolist() if step.logprobs else None
        t1 = time.perf_counter()
        outputs: dict[int, StepOutput] = {}
        for b, seq in enumerate(seqs):
            if seq.finished:
                continue
            a = host[b]
            emitted = seq.drafts[:a] + [host[n + b]]
            if seq.drafts:
                self.count_verify(len(seq.drafts), a)
            seq.computed += a + 1
            seq.drafts, seq.draft_q = [], None
            for j, tok in enumerate(emitted):
                if seq.finished:
                    break
                lp = TokenLogprob(tok, lps[b * (k + 1) + j], []) if seq.params.logprobs is not None else None
                e.output.emit(seq, tok, lp, outputs)
            if seq.running:  # (the carry's rule: `ops.write_carry`)
                end = len(seq.tokens) - 1
                keep = min(k, e.max_model_len - 1 - end, seq.params.max_tokens - seq.n_generated - 1)
                seq.drafts = host[2 * n + b * k : 2 * n + b * k + max(keep, 0)]
        result = e.finish_step(seqs, outputs)
        e.timing["wait"] += t1 - t0
        e.timing["post"] += time.perf_counter() - t1
        return result

    def _fixed_run(self, ints: np.ndarray, w: int, sampled: bool = False) -> tuple[torch.Tensor, ...]:
        """The fixed-shape step of n rows of width w (ints [n, `_cols`], `fixed_inputs` then this class's feed
        columns): replayed from the graph of its batch bucket, width and variant (captured at warm-up or on
        first use), or eagerly. -> its outputs, n rows."""
        r = self.engine.runner
        n = ints.shape[0]
        batch = next(b for b in GRAPH_BUCKETS if b >= n) if r.cuda_graphs else n
        r.sync_tables()
        r.announce(FIXED, [], batch, w, n, int(sampled))  # before a capture: every worker captures here
        r.fixed_steps[batch, w + 1] += 1
        r.decode_rows += n
        timed = r.clock is not None and r.device.type == "cuda"  # (`dsv4 bench engine`'s device time per step)
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        if r.cuda_graphs:
            r.graph_steps += 1
            out = self._graph(batch, w, sampled).run(ints)
        else:
            r.eager_steps += 1
            r.padded_steps += 1
            cols = self._cols(w, sampled)
            out = self._step_for(sampled)(r.share(torch.from_numpy(ints).to(r.device).view(n, cols)))
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            r.clock.append((start, end, f"fixed {batch}x{w + 1}"))
        return out

    def _cols(self, w: int, sampled: bool) -> int:
        """Integers per row of a fixed-shape step of width w."""
        return w + 4 + (SAMPLING_COLS if sampled else 0) + self.FEED

    def _follow_fixed(self, batch: int, w: int, n: int, sampled: int = 0) -> None:
        r = self.engine.runner
        if r.cuda_graphs:
            self._graph(batch, w, bool(sampled)).follow()
        else:
            cols = self._cols(w, bool(sampled))
            self._step_for(bool(sampled))(r.share(torch.empty(n, cols, dtype=torch.long, device=r.device)))

    def widths(self) -> list[int]:
        """The widths of this draft's fixed-shape steps (MTP: always k)."""
        return [self.k]

    def variants(self) -> tuple[bool, ...]:
        """Whether each kind of fixed-shape step samples (MTP: a greedy and a sampled variant)."""
        return (False, True)

    def capture(self, progress=None) -> int:
        """Capture the fixed-shape steps' graphs (every batch bucket up to the engine's sequences, width and
        variant) before the first request, as the runner does its buckets. -> the number captured."""
        r = self.engine.runner
        if not r.cuda_graphs:
            return 0
        last = next((b for b in GRAPH_BUCKETS if b >= self.engine.config.max_seqs), GRAPH_BUCKETS[-1])
        keys = [(b, w, v) for b in GRAPH_BUCKETS if b <= last for w in self.widths() for v in self.variants()]
        for i, (b, w, v) in enumerate(sorted(keys, reverse=True)):  # largest first: pool sizes
            self._graph(b, w, v)
            if progress is not None:
                progress(i + 1, len(keys))
        return len(keys)

    def _graph(self, batch: int, w: int, sampled: bool = False) -> FixedStepGraph:
        graph = self.graphs.get((batch, w, sampled))
        if graph is None:
            r = self.engine.runner
            step = self._step_for(sampled)
            graph = FixedStepGraph(r, batch, w, step, pool=r.graph_pool, sampled=sampled, extra=self.FEED)
            self.graphs[(batch, w, sampled)] = graph
        return graph

    def _step_for(self, sampled: bool):
        """The device step of a variant (`_fixed_step`, which DSpark's steps replace; sampled: MTP's only)."""
        return functools.partial(self._fixed_step, sampled=True) if sampled else self._fixed_step

    def _fixed_step(self, ints: torch.Tensor, sampled: bool = False) -> tuple[torch.Tensor, ...]:
        """`spec_step` on a fixed-shape step's integers on the device (capturable): fed rows read the carry
        first, and every row leaves its next step's integers there."""
        e, r, w = self.engine, self.engine.runner, self.k
        ints, generated, cap, wtable, ctable, state = ops.read_carry(
            ints, self.carry, r.tables_w, r.tables_c, r.tables.pad_row
        )
        tokens, n_drafts, start = ints[:, : w + 1], ints[:, w + 1], ints[:, w + 2]
        sampling = sampling_args(ints, self.draft_store) if sampled else None
        out = spec_step(e.model, e.cache, tokens, start, wtable, ctable, state, n_drafts, sampling, self._share())
        ops.write_carry(self.carry, ints, generated, cap, *out[:3], e.max_model_len - 1)  # (one launch on a GPU)
        return out

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
                if seq.draft_q is None:  # drafts of a fixed-shape step: q from the logits that drew them
                    if seq.params.greedy:
                        seq.draft_q = torch.nn.functional.one_hot(torch.tensor(seq.drafts, device=dev), V).double()
                    else:
                        kept = self.draft_store[seq.pages.state, : w - 1]
                        seq.draft_q = e.sampler.probabilities(kept, [seq.params] * (w - 1))
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
                    # (logit - logsumexp in float64, rounded to float32: the plain draw's numbers, so a token's
                    # log-probability does not depend on which step computed it)
                    x = logits[a : a + len(toks)].double()
                    lp = x - torch.logsumexp(x, -1, keepdim=True)  # [n, V]
                    own = lp.gather(1, torch.tensor(toks, device=dev).unsqueeze(1))[:, 0].float().tolist()
                    top = lp.topk(k, -1) if k else None
                    ids = top.indices.tolist() if top is not None else None
                    vals = top.values.float().tolist() if top is not None else None
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
            # no drafts after a prompt chunk or a draw under a healing constraint: such tokens are drawn plainly
            # on every path (`_split`'s bucketed steps draft nothing)
            if end == len(seq.tokens) - 1 and not seq.heal and id(seq) not in self._prompt:
                k = min(self.k, e.max_model_len - 1 - end, seq.params.max_tokens - seq.n_generated - 1)
                # (the scheduler allocated these pages with the row, `SchedulerConfig.draft_lookahead`, so this
                # guard never finds them missing: whether a sequence drafts must not depend on memory)
                if k > 0 and not e.manager.allocate(seq.pages, end, end + k + 1):
                    k = 0
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
