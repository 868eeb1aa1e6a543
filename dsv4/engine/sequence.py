"""The state of a request while the engine serves it: its sequences (one per choice), their tokens, where
their cache entries stand, and what they emitted. No model, no device: the scheduler and the output
processor read and write these; the runner only reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from .detokenize import Detokenizer, StopChecker
from .params import SamplingParams

if TYPE_CHECKING:  # (annotations only: the HTTP processes import this module without torch)
    import torch

    from .cache_manager import SeqPages


class RequestError(ValueError):
    """A request the engine refuses (too long, bad parameters); the message says why."""


def token_ids_ok(ids: list[int], vocab: int) -> bool:
    """Whether every id is an integer in [0, vocab). A list of plain ints (the common case) is checked at C
    speed: the engine's loop checks every prompt it admits."""
    if set(map(type, ids)) == {int}:
        return 0 <= min(ids) and max(ids) < vocab
    return all(isinstance(t, int) and 0 <= t < vocab for t in ids)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # choice index within the request
    tokens: list[int]  # prompt + generated (read back from the device)
    seed: int
    prompt_len: int = 0
    pages: SeqPages | None = None
    computed: int = 0  # positions whose cache entries are written (or launched)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    admitted_at: int = 0  # admission order (preemption picks the latest)
    admitted_time: float | None = None  # time.monotonic() of its first admission (a preemption keeps it)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    detok: Detokenizer | None = None
    stopper: StopChecker = field(default_factory=StopChecker)
    n_pending: int = 0  # tokens sampled on the device, not read yet (overlap)
    pending_index: int = -1  # the latest one's row in its step's sampled tokens
    drafts: list[int] = field(default_factory=list)  # speculative: tokens the MTP block proposes next
    draft_q: torch.Tensor | None = None  # their draft distributions [len(drafts), vocab] float64
    heal: bytes = b""  # token healing: what the next tokens must still spell (UTF-8)
    # speculative engines: preempted after generating, it is recomputed up to its last token only (which its
    # next step verifies with the drafts it kept, as it would have without the preemption)
    resume: bool = False
    draft_logits: torch.Tensor | None = None  # kept through a preemption: the logits that drew its drafts
    # while waiting: its prompt's `CacheManager.prompt_keys` (the scheduler's burst rule)
    page_keys: tuple[list[bytes], list[bytes]] = field(default_factory=lambda: ([], []))

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def n_tokens(self) -> int:
        """Tokens known so far, those still on the device included."""
        return len(self.tokens) + self.n_pending

    @property
    def n_generated(self) -> int:
        return self.n_tokens - self.prompt_len

    @property
    def prefilling(self) -> bool:
        """Still computing known tokens (its prompt, or its tokens again after a preemption)."""
        return self.computed < self.n_tokens - 1

    @property
    def known_end(self) -> int:
        """Where its computing of known tokens stops: its length (the last chunk draws the next token), or,
        resuming after a preemption, its last position (which its next decode row computes)."""
        return self.n_tokens - 1 if self.resume else self.n_tokens

    @property
    def running(self) -> bool:
        return self.status is Status.RUNNING

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
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
        return all(s.finished for s in self.sequences)


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
    text: str = ""  # new text (with a tokenizer; stop strings applied)
    # on a sequence's first output: (seconds from the engine's receipt of its request to its admission,
    # seconds from its admission to this first token), the engine's own clock; else None
    timing: tuple[float, float] | None = None
