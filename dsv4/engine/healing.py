"""Token healing: prompts that end at any character.

A byte-level BPE merges characters across the place where a user ends a prompt: `"\\n    return"` is
tokenized `"\\n   "` + `" return"`, so a prompt cut after the newline ends in a lone `"\\n"` token, which
the model rarely saw before an indented line (it takes the function as over); a prompt ending in a space
or in half a word ends in a token the tokenizer would not have chosen had the text gone on. Token healing
(as transformers' `token_healing` and guidance do it) backs up the prompt's last tokens while their text
is a proper prefix of some longer token, and makes the first generated tokens spell the removed text
again: a step may only draw a token whose text starts with what is left of the removed text (which ends
the constraint) or is a proper prefix of it (the next step spells the rest). The model then picks the
token that crosses the boundary itself (`"\\n   "`), and the text is what it would be without healing:
the prompt's text followed by the completion.

Everything works on the tokens' bytes (UTF-8 is cut anywhere by byte-level tokens). A prompt whose last
token is the start of no longer token is left as it is, so its tokens are exactly those without healing;
a tokenizer with no token longer than one byte (`ByteTokenizer`) never heals.

`Vocabulary.of(tokenizer)` is built once per tokenizer (each token's bytes, sorted for prefix look-ups);
`heal(vocab, ids)` -> `Healed` (the prompt to run, the removed text); `Vocabulary.allowed(rest)` the ids a
step may draw while `rest` is left to spell, `advance(rest, token)` what is left after drawing `token`.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass

import numpy as np

MAX_HEALED_TOKENS = 8  # the most prompt tokens one prompt backs up
MAX_HEALED_BYTES = 128  # ... and the most bytes (SamplingParams.heal_text takes 256 characters)
_CACHE_LIMIT = 4096  # allowed sets kept per vocabulary (one per distinct text left)


def _successor(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with prefix (None: no bound)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


def _fallback_pieces(tokenizer, n: int) -> list[bytes]:
    """Token bytes from decoding each id alone (tokenizers that do not say): a token that decodes to an
    incomplete character, or to nothing, gets b"" (never removed from a prompt, never drawn while healing)."""
    out = []
    for i in range(n):
        text = tokenizer.decode([i], skip_special_tokens=True)
        out.append(b"" if "\ufffd" in text else text.encode("utf-8"))
    return out


class Vocabulary:
    """Each token's bytes (b"" for special tokens and ids without text), indexed for prefix look-ups."""

    _by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        order = sorted((p, i) for i, p in enumerate(pieces) if p)
        self._sorted = [p for p, _ in order]
        self._ids = np.array([i for _, i in order], dtype=np.int64)
        self._exact: dict[bytes, list[int]] = {}
        for p, i in order:
            self._exact.setdefault(p, []).append(i)
        self.merges = any(len(p) > 1 for p in pieces)  # False: healing never removes a token
        self._allowed: dict[bytes, np.ndarray] = {}
        self._spellable: dict[bytes, bool] = {}

    @classmethod
    def of(cls, tokenizer) -> Vocabulary:
        """The vocabulary of a tokenizer, built on first use and kept as long as the tokenizer lives.
        Its token bytes come from `tokenizer.token_bytes()` where it has one, else from decoding each id."""
        with cls._lock:
            v = cls._by_tokenizer.get(tokenizer)
            if v is None:
                pieces = (
                    tokenizer.token_bytes()
                    if hasattr(tokenizer, "token_bytes")
                    else _fallback_pieces(tokenizer, tokenizer.vocab_size)
                )
                v = cls._by_tokenizer[tokenizer] = cls(pieces)
            return v

    def __len__(self) -> int:
        return len(self.pieces)

    def piece(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def _range(self, prefix: bytes) -> tuple[int, int]:
        lo = bisect.bisect_left(self._sorted, prefix)
        succ = _successor(prefix)
        hi = len(self._sorted) if succ is None else bisect.bisect_left(self._sorted, succ, lo)
        return lo, hi

    def extensions(self, prefix: bytes) -> np.ndarray:
        """Ids of the tokens whose bytes start with prefix (prefix itself included), int64."""
        lo, hi = self._range(prefix)
        return self._ids[lo:hi]

    def extendable(self, text: bytes) -> bool:
        """Whether some token is longer than text and starts with it (the tokenizer could merge text with
        what follows it)."""
        lo, hi = self._range(text)
        return hi - lo > len(self._exact.get(text, ()))

    def spellable(self, rest: bytes) -> bool:
        """Whether tokens can spell rest and end the constraint (a token starting with it, or a proper
        prefix of it followed by a spelling of the remainder)."""
        got = self._spellable.get(rest)
        if got is None:
            lo, hi = self._range(rest)
            got = hi > lo or any(rest[:k] in self._exact and self.spellable(rest[k:]) for k in range(1, len(rest)))
            self._spellable[rest] = got
        return got

    def allowed(self, rest: bytes) -> np.ndarray:
        """Sorted ids a step may draw while rest is left to spell: tokens starting with rest, and tokens that
        are a proper prefix of rest after which the remainder can still be spelled. int64, never empty for a
        rest that `heal` produced (the removed tokens themselves spell it)."""
        got = self._allowed.get(rest)
        if got is None:
            parts = [self.extensions(rest)]
            parts += [
                np.asarray(self._exact[rest[:k]], np.int64)
                for k in range(1, len(rest))
                if rest[:k] in self._exact and self.spellable(rest[k:])
            ]
            got = np.unique(np.concatenate(parts))
            with self._lock:
                if len(self._allowed) >= _CACHE_LIMIT:
                    self._allowed.clear()
                self._allowed[rest] = got
        return got

    def advance(self, rest: bytes, token: int) -> bytes:
        """What is left to spell after drawing token (b"": the constraint is over)."""
        p = self.piece(token)
        if p and rest.startswith(p) and len(p) < len(rest):
            return rest[len(p) :]
        return b""


@dataclass(frozen=True)
class Healed:
    """A prompt after token healing: the tokens the model reads, and the text of the tokens removed from
    its end, which the first generated tokens spell again ("" when nothing was removed)."""

    prompt: list[int]
    text: str = ""
    removed: int = 0  # prompt tokens removed

    def completion(self, generated_text: str) -> str:
        """The completion after the user's prompt: the generated text without the removed text it starts
        with (all of it when the generation stopped before it was spelled out)."""
        n = len(self.text)
        return generated_text[n:] if len(generated_text) >= n else ""


def _char_start(b: int) -> bool:
    return b & 0xC0 != 0x80  # not a UTF-8 continuation byte


def heal(vocab: Vocabulary, ids: list[int]) -> Healed:
    """Back up the prompt's last tokens while their joined bytes are a proper prefix of some token (at most
    MAX_HEALED_TOKENS and MAX_HEALED_BYTES, never the first token, never a special token), keeping the
    longest cut that starts on a character (so the removed text is whole UTF-8 text). Nothing is removed
    when the last token is not extendable."""
    if not vocab.merges:
        return Healed(list(ids))
    best, removed, k = 0, b"", 0
    while k < min(MAX_HEALED_TOKENS, len(ids) - 1):
        piece = vocab.piece(ids[-1 - k])
        if not piece or len(piece) + len(removed) > MAX_HEALED_BYTES or not vocab.extendable(piece + removed):
            break
        removed, k = piece + removed, k + 1
        if _char_start(removed[0]):
            best = k
    if best == 0:
        return Healed(list(ids))
    text = b"".join(vocab.piece(t) for t in ids[len(ids) - best :]).decode("utf-8")
    return Healed(list(ids[: len(ids) - best]), text, best)
