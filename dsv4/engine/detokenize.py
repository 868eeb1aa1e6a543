"""Incremental detokenization and stop strings for streamed output.

Byte-level BPE tokens can end in the middle of a UTF-8 character: a token's text is known only once
the character is complete. Each new token decodes a short window of the tokens before it, and only text
past that window's own decoding is emitted (the technique of vLLM and text-generation-inference), so the
cost per token is constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_REPLACEMENT = "\ufffd"


@dataclass
class Detokenizer:
    tokenizer: object  # has decode(ids, skip_special_tokens=...) -> str
    ids: list[int]
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    skip_special: bool = True

    @classmethod
    def for_prompt(cls, tokenizer, prompt: list[int]) -> Detokenizer:
        n = len(prompt)
        return cls(tokenizer, list(prompt), prefix_offset=max(0, n - 6), read_offset=n)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still pending (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


@dataclass
class StopChecker:
    """Finds the first stop string in generated text; holds back text that may start one."""

    stops: list[str] = field(default_factory=list)
    include: bool = False
    emitted: int = 0

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def check(self, text: str, new: int) -> int | None:
        """The end of the kept text when a stop string occurs in text (searching where the last `new`
        characters could complete one), else None."""
        if not self.stops:
            return None
        lo = max(0, len(text) - new - self.holdback)
        best = None
        for s in self.stops:
            i = text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s))
        if best is None:
            return None
        return best[1] if self.include else best[0]

    def releasable(self, text: str, finished: bool) -> str:
        """The text not yet emitted that can be emitted now."""
        end = len(text) if finished else max(self.emitted, len(text) - self.holdback)
        out = text[self.emitted : end]
        self.emitted = end
        return out
