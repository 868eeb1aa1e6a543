"""How one request samples (`SamplingParams`), without torch: the HTTP processes of a server build and
check these, and import nothing that loads torch (`dsv4.engine.sampling` draws the tokens)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated on construction (ValueError with the field's name), and not changed
    after it (`dataclasses.replace` makes another): the flags the engine reads for every row of every step
    (`greedy`, `filtered`, `penalized`, `plain`) are worked out once.

    temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off. Penalties: repetition (> 0, 1 =
    off; on prompt and output tokens, the convention of vLLM and transformers), frequency and presence
    (OpenAI's, on output tokens, in [-2, 2]). `logprobs`: None, or the number of alternatives (0-20)
    to return with each token's own log-probability (of the model's distribution before sampling
    settings). `seed`: None draws one per request. `heal_text`: token healing (`dsv4.engine.healing`):
    the text of the tokens removed from the prompt's end, which the first generated tokens must spell
    again ("" = none; the engine needs the tokenizer then).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True  # detokenization: drop special tokens from the text
    include_stop_str_in_output: bool = False
    heal_text: str = ""

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {msg}")

        def finite(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        need(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        need(
            finite(self.temperature) and 0 <= self.temperature <= 100,
            "temperature",
            f"must be in [0, 100], got {self.temperature!r}",
        )
        need(finite(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be an integer >= 0, got {self.top_k!r}")
        need(finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        need(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64),
            "seed",
            f"must be an integer, got {self.seed!r}",
        )
        need(
            finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
            "repetition_penalty",
            f"must be in (0, 100], got {self.repetition_penalty!r}",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            need(finite(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        need(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be an integer in [0, 20], got {self.logprobs!r}",
        )
        need(
            all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16,
            "stop",
            "must be at most 16 non-empty strings",
        )
        need(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        need(
            isinstance(self.heal_text, str) and len(self.heal_text) <= 256,
            "heal_text",
            "must be a string of at most 256 characters",
        )

        # greedy; filtered: top-k, top-p or min-p cuts the distribution (the fused plain draw does not);
        # penalized; plain: neither filtered nor penalized, and no alternatives asked for (the draw that a
        # step's CUDA graph holds serves it)
        filtered = bool(self.top_k) or self.top_p < 1 or self.min_p > 0
        penalized = self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
        for name, value in (
            ("greedy", self.temperature == 0),
            ("filtered", filtered),
            ("penalized", penalized),
            ("plain", not (filtered or penalized or self.logprobs)),
        ):
            object.__setattr__(self, name, value)

    greedy: bool = field(init=False, repr=False, compare=False)
    filtered: bool = field(init=False, repr=False, compare=False)
    penalized: bool = field(init=False, repr=False, compare=False)
    plain: bool = field(init=False, repr=False, compare=False)

    def resolved_seed(self) -> int:
        """The seed to use: the request's own, or a fresh random one."""
        return self.seed % 2**63 if self.seed is not None else secrets.randbits(63)
