"""The ranges of the sampling settings, in one place: the command line (`dsv4.argtypes`) and the HTTP API
(`dsv4.serve.validate`) both check against this table, so `--temperature 3` and `"temperature": 3` are
refused by the same rule with the same words.

The ranges are OpenAI's where OpenAI defines the field (temperature [0, 2], top_p (0, 1], presence and
frequency penalties [-2, 2], top_logprobs [0, 20]) and vLLM's for its extensions (top_k: 0 or -1 = off,
else at most the vocabulary; min_p [0, 1]; repetition_penalty > 0). Pure Python: importing this module
loads no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of a number; `integer` ones refuse floats and booleans."""

    lo: float | None
    hi: float | None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def text(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else repr(x)

        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {num(self.hi)}"
        return "finite"

    def contains(self, v: float) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.integer and not isinstance(v, int):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))


MAX_LOGPROBS = 20  # alternatives per token (`logprobs` of completions, `top_logprobs` of chat)
MAX_STOP = 16  # stop strings per request

# name -> range. `top_k`'s upper bound is the model's vocabulary (see `top_k_range`).
RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(-1, None, integer=True),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 100.0, lo_open=True),
    "max_tokens": Range(1, None, integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "top_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "seed": Range(-(2**63), 2**64 - 1, integer=True),
    "n": Range(1, None, integer=True),
}


def top_k_range(vocab_size: int) -> Range:
    """top_k: -1 or 0 = off, else at most the vocabulary (a larger value would keep every token anyway, and
    one past 2^63 does not fit the sampler's int64 tensors)."""
    return Range(-1, vocab_size, integer=True)


def refusal(name: str, value: object, rng: Range | None = None) -> str | None:
    """None when `value` is allowed for setting `name`, else the reason in words (no field name)."""
    rng = rng or RANGES[name]
    if rng.contains(value):  # type: ignore[arg-type]
        return None
    kind = "an integer" if rng.integer else "a number"
    kind += " in" if rng.lo is not None and rng.hi is not None else ""
    shown = repr(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else _short(value)
    return f"must be {kind} {rng.text()}, got {shown}"


def _short(v: float) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


__all__ = ["MAX_LOGPROBS", "MAX_STOP", "RANGES", "Range", "refusal", "top_k_range"]
