"""Per-request sampling, batched with static shapes (no boolean-mask indexing, no host reads: docs/bugzoo.md Z23).

Every row of a batch carries its own settings (temperature, top-k, top-p, min-p, penalties, seed). A row's
random numbers come from a counter-based hash of (seed, token index, vocabulary id), not from a shared
generator, so a seeded request draws the same numbers whatever else is in the batch and whichever step
it is in: same seed + same request = same text. Sampling is Gumbel-max (argmax of logits / T + Gumbel
noise over the allowed tokens), an exact draw from the filtered softmax, computed in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import ops
from ..ops.reference import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, gumbel_noise, uniform
from ..ops.reference import temperature_distribution as distribution  # (`Sampler.probabilities`' rows)
from .params import SamplingParams

__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_SAMPLE",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "SamplingTensors",
    "distribution",
    "draw",
    "sample",
    "uniform",
]


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None = None  # [B] float: log p(token) under the model
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


@dataclass
class SamplingTensors:
    """Every row's settings as device tensors ([B, 1] columns, [B] seeds and counters) plus what the host
    knows about the batch as a whole, which decides the kernels that run (so a step's sampling never reads
    the device)."""

    temperature: torch.Tensor  # [B, 1] float64 (1 for greedy rows)
    greedy: torch.Tensor  # [B, 1] bool
    top_p: torch.Tensor  # [B, 1] float64
    min_p: torch.Tensor  # [B, 1] float64
    top_k: torch.Tensor  # [B, 1] int64 (V: off)
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64: tokens the row's sequence generated so far
    filtered: bool  # some row uses top-k, top-p or min-p
    logprobs: int | None  # None: no row wants log-probabilities; else the most alternatives

    N_FLOAT, N_INT = 4, 4  # per-row columns of `pack`

    @staticmethod
    def pack(
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int],
        vocab: int,
        floats: np.ndarray,
        ints: np.ndarray,
    ) -> None:
        """Write rows' settings into host arrays floats [B, 4] float64 and ints [B, 4] int64 (any memory:
        the runner packs them into the one buffer it copies to the device)."""
        floats[:, 0] = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        floats[:, 1] = [p.top_p for p in params]
        floats[:, 2] = [p.min_p for p in params]
        floats[:, 3] = 0.0
        ints[:, 0] = [p.top_k or vocab for p in params]
        ints[:, 1] = [p.greedy for p in params]
        ints[:, 2] = seeds
        ints[:, 3] = counters

    @classmethod
    def unpack(
        cls, floats: torch.Tensor, ints: torch.Tensor, params: Sequence[SamplingParams] | None
    ) -> SamplingTensors:
        """From device views of `pack`'s arrays; params decide the host-side flags (None: the plain draw
        that a CUDA graph holds - no filtering, each row's own log-probability)."""
        plain = params is None
        return cls(
            temperature=floats[:, 0:1],
            greedy=ints[:, 1:2] > 0,
            top_p=floats[:, 1:2],
            min_p=floats[:, 2:3],
            top_k=ints[:, 0:1],
            seeds=ints[:, 2],
            counters=ints[:, 3],
            filtered=not plain and any(p.filtered for p in params),
            logprobs=0 if plain else max((p.logprobs for p in params if p.logprobs is not None), default=None),
        )

    @staticmethod
    def plain(params: Sequence[SamplingParams]) -> bool:
        """Whether the plain draw serves these rows: no filtering, no penalties, no alternatives (a row
        with a token-healing constraint is not plain either: the runner checks its `SampleRow.allowed`)."""
        return all(p.plain for p in params)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int],
        vocab: int,
        device: torch.device,
    ) -> SamplingTensors:
        B = len(params)
        floats, ints = np.zeros((B, cls.N_FLOAT)), np.zeros((B, cls.N_INT), np.int64)
        cls.pack(params, seeds, counters, vocab, floats, ints)
        return cls.unpack(torch.from_numpy(floats).to(device), torch.from_numpy(ints).to(device), params)


class Sampler:
    """Samples a batch of rows, each with its own SamplingParams, in one fixed sequence of kernels."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int],
        output_counts: torch.Tensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> SampleOutput:
        """logits [B, V]; seeds / counters (tokens generated so far) per row; output_counts [B, V] and
        prompt_mask [B, V] (bool) when some row is penalized; allowed [B, V] (bool) as in `sample`."""
        st = SamplingTensors.build(params, seeds, counters, logits.size(-1), logits.device)
        penalties = None
        if any(p.penalized for p in params):
            if output_counts is None or prompt_mask is None:
                raise ValueError("penalized sampling needs output_counts and prompt_mask")
            penalties = (params, output_counts, prompt_mask)
        return self.sample(logits, st, penalties, allowed)

    def sample(
        self, logits: torch.Tensor, st: SamplingTensors, penalties=None, allowed: torch.Tensor | None = None
    ) -> SampleOutput:
        """logits [B, V] -> one token per row with the settings of `st` (no host synchronization).
        penalties: None, or (params, output_counts [B, V], prompt_mask [B, V]). allowed: None, or [B, V]
        bool, the tokens each row may draw (a token-healing constraint; a row of all True is free): the
        others get logit -inf before anything else, so a constrained row's draw, greedy or sampled, and
        its log-probabilities are those of the model's distribution renormalized over its allowed tokens
        (its top alternatives are allowed tokens, -inf where it has fewer than asked)."""
        V = logits.size(-1)
        if not st.filtered and penalties is None and allowed is None and not st.logprobs:
            # the plain draw (every step a CUDA graph holds): one fused op
            tokens, lp = ops.gumbel_argmax(logits, st.temperature[:, 0], st.greedy[:, 0], st.seeds, st.counters)
            return SampleOutput(tokens=tokens, logprobs=lp if st.logprobs is not None else None)
        x = logits.double()
        if allowed is not None:
            x = x.masked_fill(~allowed, float("-inf"))
        raw = x
        if penalties is not None:
            x = self._penalize(x, *penalties)
        scaled = x / st.temperature
        if st.filtered:
            scaled = self._filter(scaled, st.top_k, st.top_p, st.min_p)
        noise = gumbel_noise(st.seeds, st.counters, V)
        choice = torch.where(st.greedy, x, scaled + noise).argmax(-1)  # [B]
        out = SampleOutput(tokens=choice)
        if st.logprobs is not None:  # log p = logit - logsumexp(logits), float64
            lse = torch.logsumexp(raw, -1, keepdim=True)  # [B, 1]
            out.logprobs = (raw.gather(1, choice.unsqueeze(1)) - lse).squeeze(1).float()
            if st.logprobs:
                top = raw.topk(min(st.logprobs, V), dim=-1)
                out.top_ids, out.top_logprobs = top.indices, (top.values - lse).float()
        return out

    def probabilities(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from, float64 [B, V]: softmax(logits / T) after top-k,
        top-p and min-p (penalties are not applied here: penalized requests do not speculate). A greedy
        row gets the one-hot of its argmax."""
        B, V = logits.shape
        dev = logits.device
        x = logits.double()
        floats = torch.tensor(
            [[p.temperature if p.temperature > 0 else 1.0, float(p.greedy), p.top_p, p.min_p] for p in params],
            dtype=torch.float64,
        ).to(dev)
        top_k = torch.tensor([[p.top_k or V] for p in params], dtype=torch.int64).to(dev)
        filtered = None
        if any(p.filtered for p in params):

            def filtered(scaled: torch.Tensor) -> torch.Tensor:
                return self._filter(scaled, top_k, floats[:, 2:3], floats[:, 3:4])

        return distribution(x, floats[:, 0:1], floats[:, 1:2] > 0, filtered)

    @staticmethod
    def _penalize(
        x: torch.Tensor, params: Sequence[SamplingParams], counts: torch.Tensor, prompt_mask: torch.Tensor
    ) -> torch.Tensor:
        dev = x.device
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float64, device=dev).unsqueeze(1)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float64, device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float64, device=dev).unsqueeze(1)
        c = counts.double()
        seen = prompt_mask | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        return x - freq * c - pres * (counts > 0).double()

    @staticmethod
    def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Keep the top_k tokens, the smallest prefix of mass >= top_p, and tokens with p >= min_p * p_max
        (each off at its neutral value; per row: [B, 1] columns); the most likely token always stays."""
        V = scaled.size(-1)
        values, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
        probs = values.softmax(-1)
        rank = torch.arange(V, device=scaled.device).unsqueeze(0)
        drop = (rank >= top_k) | ((probs.cumsum(-1) - probs) >= top_p) | (probs < min_p * probs[:, :1])
        drop[:, 0] = False
        values = values.masked_fill(drop, float("-inf"))
        return torch.full_like(scaled, float("-inf")).scatter(-1, order, values)


def draw(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """One exact draw per row from probs [B, V] (float64, rows summing to 1; zeros never drawn), with the
    counter-hash uniforms of (seed [B], counter [B], stream): Gumbel-max over log-probabilities,
    argmax(log(probs) + noise). That is `ops.gumbel_argmax` of the log-probabilities at temperature 1
    (x / 1 is x), the same numbers; its fused backend replaces the hash's some forty elementwise launches."""
    B = probs.size(0)
    one = torch.ones(B, dtype=torch.float64, device=probs.device)
    greedy = torch.zeros(B, dtype=torch.bool, device=probs.device)  # every row draws
    return ops.gumbel_argmax(torch.log(probs), one, greedy, seeds, counters, stream)[0]


def sample(
    logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, counter: int = 0
) -> torch.Tensor:
    """One setting for every row: logits [B, V] -> token ids [B] (row i draws with seed + i)."""
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    B = logits.size(0)
    return Sampler()(logits, [params] * B, [seed + i for i in range(B)], [counter] * B).tokens
