"""Speculative decoding with the model's MTP block as the draft.

Per step, a speculating sequence at position c (its last token x_c not yet in the cache) carrying drafts
d_1 ... d_k runs the k + 1 tokens [x_c, d_1, ..., d_k] through the main model in one `append` (a verify).
`accept` keeps the longest prefix of drafts the target accepts and draws one more token, so a step yields
1 ... k + 1 tokens. Acceptance is rejection sampling (draft i is kept with probability
min(1, p_i(d_i) / q_i(d_i)); on a rejection the token is drawn from normalize(max(p_i - q_i, 0)); after k
acceptances a bonus token is drawn from p_k): the emitted tokens follow the target distribution exactly,
whatever the draft proposes. A greedy request is the same rule on one-hot distributions: drafts equal to
the target's argmax are kept, the first mismatch is replaced by the argmax, so its tokens are exactly
those of plain greedy decoding.

Rejected positions need no undo: every cache the verify wrote (window rows, compressed entries,
compressor rows, indexer keys, the MTP window) is addressed by position, and positions at or past a
sequence's length are written again before anything reads them (`dsv4.model.paged`).

The draft (`Drafter`): after the verify, the MTP block catches up on the positions that are now final -
position t combines the main model's hidden state at t with the embedding of x_{t+1} - and its output at
the last one proposes d'_1; each further draft feeds the block its own output hidden and the draft just
made (the chained application of the one MTP block). Random numbers are counter-hashed per sequence
(`sampling.uniform`): a draft's draw, an acceptance test and a token's draw use separate streams keyed on
the index of the token in the sequence, so results do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import DeepSeekV4
from ..model.paged import SPEC_ROWS, PagedKVCache
from .batch import Row
from .runner import Runner
from .sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, Sampler, SamplingParams, draw, uniform

MAX_SPECULATIVE = SPEC_ROWS - 1       # a verify of k + 1 tokens must fit the rows a sequence can roll back


def accept(target: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor, n_drafts: torch.Tensor,
           seeds: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for B rows of up to K drafts.

    target [B, K + 1, V]: p at each verified position (float64, rows summing to 1); draft_probs [B, K, V]:
    q of each draft; drafts [B, K]; n_drafts [B] (row b's drafts are the first n_drafts[b]); counters [B]:
    the sequence index of the token each row's first draft proposes. -> (accepted [B]: drafts kept, the
    next token [B] drawn at position `accepted`).
    """
    B, K1, V = target.shape
    K = K1 - 1
    dev = target.device
    if K:
        i = torch.arange(K, device=dev)
        p_d = target[:, :K].gather(2, drafts.unsqueeze(2)).squeeze(2)                         # [B, K]
        q_d = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)                           # [B, K]
        u = torch.stack([uniform(seeds, counters + j, 1, STREAM_ACCEPT)[:, 0] for j in range(K)], 1)  # [B, K]
        ok = (u * q_d <= p_d) & (i.unsqueeze(0) < n_drafts.unsqueeze(1))
        accepted = ok.long().cumprod(1).sum(1)                                                # [B]
    else:
        accepted = torch.zeros(B, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    p = target[rows, accepted]                                                                # [B, V]
    q = torch.cat([draft_probs, torch.zeros(B, 1, V, dtype=draft_probs.dtype, device=dev)], 1)[rows, accepted]
    q = torch.where((accepted < n_drafts).unsqueeze(1), q, 0)           # after the last draft: the bonus, from p
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-300), p)
    return accepted, draw(residual, seeds, counters + accepted, STREAM_SAMPLE)


@dataclass
class DraftRow:
    """One sequence's part of the draft: the MTP block catches up on positions start ... start + len(next)
    - 1 (hidden[i] is the main model's hidden state at start + i, next[i] the token after it), then, when
    `k` > 0, proposes k tokens."""
    hidden: torch.Tensor          # [m] flat indices into the verify step's hidden states
    next: list[int]
    start: int
    state: int                    # ring slot (and page-table row)
    k: int
    params: SamplingParams
    seed: int
    counter: int                  # sequence index of the first proposed token


class Drafter:
    """Runs the MTP block over a step's rows: catch-up, then chained drafts."""

    def __init__(self, model: DeepSeekV4, runner: Runner, sampler: Sampler):
        if model.cfg.n_mtp_layers < 1:
            raise ValueError("speculative decoding drafts with the model's MTP block, and this model has none "
                             "(n_mtp_layers = 0)")
        self.model, self.runner, self.sampler = model, runner, sampler
        self.cache = runner.cache

    def __call__(self, hidden: torch.Tensor, rows: list[DraftRow]) -> list[tuple[list[int], torch.Tensor]]:
        """hidden [T, hc, dim] (the verify step's). -> per row: (drafts, their q [k, V] float64)."""
        dev = hidden.device
        mtp_rows = [Row(r.next, r.start, r.state, want_logits=r.k > 0) for r in rows]
        tokens, inputs, _ = self.runner.inputs(mtp_rows)
        logits, h = self.model.draft(hidden[torch.cat([r.hidden for r in rows])], tokens, inputs, self.cache)
        live = [r for r in rows if r.k > 0]
        out: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {id(r): ([], []) for r in live}
        if not live:
            return [([], torch.zeros(0)) for _ in rows]
        seeds = torch.tensor([r.seed for r in live], dtype=torch.long, device=dev)
        params = [r.params for r in live]
        last = inputs.out                                                   # [n] flat index of each live row's end
        pos = [r.start + len(r.next) for r in live]                         # position of the next link
        k_max = max(r.k for r in live)
        for j in range(k_max):
            counters = torch.tensor([r.counter + j for r in live], dtype=torch.long, device=dev)
            q = self.sampler.probabilities(logits, params)                                  # [n, V]
            d = draw(q, seeds, counters, STREAM_DRAFT)                                       # [n]
            for i, r in enumerate(live):
                if j < r.k:
                    out[id(r)][0].append(d[i])
                    out[id(r)][1].append(q[i])
            if j + 1 == k_max:
                break
            links = [Row([0], pos[i] + j, r.state, want_logits=True) for i, r in enumerate(live)]
            _, inputs, _ = self.runner.inputs(links)
            logits, h = self.model.draft(h[last], d.view(1, -1), inputs, self.cache)
            last = inputs.out
        result = []
        for r in rows:
            if r.k == 0:
                result.append(([], torch.zeros(0)))
                continue
            toks, qs = out[id(r)]
            result.append((torch.stack(toks).tolist(), torch.stack(qs)))
        return result


def greedy_spec_step(model: DeepSeekV4, cache: PagedKVCache, tokens: torch.Tensor, start: torch.Tensor,
                     wtable: torch.Tensor, ctable: torch.Tensor, state: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole greedy speculative step for B sequences with k drafts each, on the device with no host
    synchronization (so it can be captured in one CUDA graph).

    tokens [B, k + 1]: each row's last token x_c and its drafts; start [B]: c. Verify, accept the longest
    prefix of drafts equal to the target's argmax, take the argmax after it, let the MTP block catch up on
    the positions now final and draft k tokens for the next step by its own argmax.
    -> (accepted [B], next token [B], next drafts [B, k]).
    """
    from ..model.paged import uniform_inputs

    B, k1 = tokens.shape
    k = k1 - 1
    dev = tokens.device
    layout = cache.layout
    inputs = uniform_inputs(tokens, start, wtable, ctable, state, layout)
    logits, hidden = model.append(tokens, inputs, cache, return_hidden=True)            # [B(k+1), V]
    target = logits.view(B, k1, -1).argmax(-1)                                           # [B, k+1]
    i = torch.arange(k1, device=dev)
    accepted = (tokens[:, 1:] == target[:, :k]).long().cumprod(1).sum(1)                 # [B]
    bonus = target.gather(1, accepted.unsqueeze(1)).squeeze(1)                           # [B]
    # MTP catch-up at positions c .. c + k: the token after position c + i is draft i + 1 while accepted,
    # then the bonus (positions past c + accepted are rewritten before anything reads them)
    shifted = torch.cat([tokens[:, 1:], bonus.unsqueeze(1)], 1)                          # [B, k+1]
    nxt = torch.where(i.unsqueeze(0) < accepted.unsqueeze(1), shifted, bonus.unsqueeze(1))
    inputs.out = inputs.seg_start + accepted                                             # [B]
    d_logits, h = model.draft(hidden, nxt.reshape(1, -1), inputs, cache)
    drafts = [d_logits.argmax(-1)]
    last = inputs.out
    for j in range(1, k):
        link = uniform_inputs(drafts[-1].view(B, 1), start + accepted + j, wtable, ctable, state, layout)
        d_logits, h = model.draft(h[last], drafts[-1].view(1, B), link, cache)
        drafts.append(d_logits.argmax(-1))
        last = torch.arange(B, device=dev)
    return accepted, bonus, torch.stack(drafts, 1)


class GreedySpecGraph:
    """`greedy_spec_step` for B rows of k drafts, captured in a CUDA graph with the page-table gather;
    `run` copies the inputs in, replays, and returns (accepted, next token, next drafts) on the device."""

    def __init__(self, model: DeepSeekV4, runner: Runner, batch: int, k: int, pool=None):
        cache, dev = runner.cache, runner.device
        self.runner, self.shape = runner, (batch, k)
        self.host = torch.zeros(batch, k + 3, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.dev = torch.zeros(batch, k + 3, dtype=torch.long, device=dev)
        self.dev[:, k + 2] = runner.tables.pad_row                         # padding rows: no pages

        def step():
            tokens, start, trow = self.dev[:, :k + 1], self.dev[:, k + 1], self.dev[:, k + 2]
            state = torch.where(trow == runner.tables.pad_row, 0, trow)
            return greedy_spec_step(model, cache, tokens, start, runner.tables_w[trow], runner.tables_c[trow], state)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):                     # compile / autotune outside the graph
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step()
        self.graph.replay()                                # uploads it (padding rows write only to trash)

    def run(self, tokens: list[list[int]], start: list[int], state: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = len(tokens)
        B, k = self.shape
        h = self.host.numpy()
        h[:] = 0
        h[:, k + 2] = self.runner.tables.pad_row
        h[:n, :k + 1] = tokens
        h[:n, k + 1] = start
        h[:n, k + 2] = state
        self.runner.sync_tables()
        self.dev.copy_(self.host, non_blocking=True)
        self.graph.replay()
        accepted, bonus, drafts = self.out
        return accepted[:n], bonus[:n], drafts[:n]
