"""What a step's sampled tokens do: appended to their sequences, stop conditions applied, outputs built.

`OutputProcessor` runs in the engine: token-level stops (EOS, stop token ids, max_tokens, the context
limit), finishing sequences, and one `StepOutput` per sequence that gained tokens. Text is not made here:
`TextStreams` turns token outputs into text (incremental detokenization, stop strings), either in the
engine's own process (`Engine(tokenizer=...)`) or, for the server, in the HTTP process, so that decoding
text never delays the engine's next step. A stop string found there finishes the sequence in the engine
through a callback (the engine process: an abort message).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .detokenize import Detokenizer, StopChecker
from .healing import Vocabulary
from .params import SamplingParams
from .sequence import Sequence, StepOutput, TokenLogprob


class OutputProcessor:
    def __init__(
        self,
        finish: Callable[[Sequence, str], None],
        eos: int,
        max_model_len: int,
        stats: dict,
        vocabulary: Callable[[], Vocabulary] | None = None,
    ):
        self.finish = finish  # ends a sequence (the scheduler's finish)
        self.eos, self.max_model_len, self.stats = eos, max_model_len, stats
        self.vocabulary = vocabulary  # the tokenizer's (token healing), built on first use

    def emit(
        self,
        seq: Sequence,
        tok: int,
        lp: TokenLogprob | None,
        outputs: dict[int, StepOutput],
        now: float | None = None,
    ) -> None:
        """One generated token: append it, apply the token-level stops, finish the sequence when it ends.
        now: the time it was read (time.monotonic(); one reading serves a step's tokens)."""
        if now is None:
            now = time.monotonic()
        seq.tokens.append(tok)
        if seq.heal:  # a token-healing constraint: what is left of it
            seq.heal = self.vocabulary().advance(seq.heal, tok)
        if lp is not None:
            seq.logprobs.append(lp)
        self.stats["generated_tokens"] += 1
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = now
        seq.last_token_time = now
        out = outputs.get(id(seq))
        if out is None:
            out = outputs[id(seq)] = StepOutput(
                seq.request.request_id, seq.index, [], [], False, None, seq.request.prompt_len, 0, seq.cached_tokens
            )
        if first and seq.admitted_time is not None:
            out.timing = (seq.admitted_time - seq.request.arrival, now - seq.admitted_time)
        out.new_tokens.append(tok)
        if lp is not None:
            out.new_logprobs.append(lp)
        p = seq.params  # the token-level stops
        if tok in p.stop_token_ids or (tok == self.eos and not p.ignore_eos):
            self.finish(seq, "stop")
        elif len(seq.tokens) - seq.prompt_len >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            self.finish(seq, "length")  # (counts the tokens read, not those still on the device)

    @staticmethod
    def logprob(seq: Sequence, tok: int, lps, top_ids, top_lps, j: int) -> TokenLogprob | None:
        k = seq.params.logprobs
        if k is None:
            return None
        top = list(zip(top_ids[j][:k], top_lps[j][:k])) if k and top_ids is not None else []
        top = [(t, v) for t, v in top if v != float("-inf")]  # (a healing step with fewer allowed tokens)
        return TokenLogprob(tok, lps[j], top)

    @staticmethod
    def finalize(outputs: dict[int, StepOutput], seqs: dict[int, Sequence]) -> list[StepOutput]:
        result = []
        for key, out in outputs.items():
            seq = seqs[key]
            out.finished, out.finish_reason = seq.finished, seq.finish_reason
            out.completion_tokens = len(seq.tokens) - seq.prompt_len
            result.append(out)
        return result


@dataclass
class _Text:
    detok: Detokenizer
    stopper: StopChecker
    completion: int = 0
    done: bool = False
    skip: int = 0  # token healing: characters of the prompt's text still to drop


class TextStreams:
    """Token outputs -> text outputs, per (request, choice): incremental detokenization and stop strings.

    `add` before a request's first output, `drop` when the request is over; `process` returns the outputs
    with `text` set, cut at the first stop string (that output then finishes with reason "stop", later
    tokens dropped) and calls `on_stop(request_id, index)` so that the engine stops computing the sequence.
    A healed request's text starts after the user's prompt: the removed text (`SamplingParams.heal_text`)
    that its first tokens spell again is dropped before stop strings are looked for."""

    def __init__(self, tokenizer, on_stop: Callable[[str, int], None]):
        self.tokenizer, self.on_stop = tokenizer, on_stop
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.streams: dict[tuple[str, int], _Text] = {}

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, n: int = 1) -> None:
        """A request's prompt and settings; each choice's stream starts at its first output."""
        self.requests[request_id] = (prompt, params)

    def drop(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is None:
            return
        for key in [k for k in self.streams if k[0] == request_id]:
            del self.streams[key]

    def _stream(self, key: tuple[str, int]) -> _Text | None:
        st = self.streams.get(key)
        if st is None and key[0] in self.requests:
            prompt, params = self.requests[key[0]]
            detok = Detokenizer.for_prompt(self.tokenizer, prompt)
            detok.skip_special = params.skip_special_tokens
            st = self.streams[key] = _Text(
                detok, StopChecker(list(params.stop), params.include_stop_str_in_output), skip=len(params.heal_text)
            )
        return st

    @staticmethod
    def _skip(st: _Text, delta: str) -> str:
        """Drop what is left of the removed prompt text from the start of the stream's text."""
        if st.skip and delta:
            k = min(st.skip, len(delta))
            st.skip -= k
            st.detok.text = st.detok.text[k:]
            delta = delta[k:]
        return delta

    def process(self, outputs: list[StepOutput]) -> list[StepOutput]:
        result = []
        for out in outputs:
            key = (out.request_id, out.index)
            st = self._stream(key)
            if st is None:  # a request this side does not make text for
                result.append(out)
                continue
            if st.done:
                continue
            kept, text, stopped = 0, "", False
            for i, tok in enumerate(out.new_tokens):
                kept = i + 1
                st.completion += 1
                delta = self._skip(st, st.detok.add(tok))
                end = st.stopper.check(st.detok.text, len(delta)) if delta else None
                last = out.finished and kept == len(out.new_tokens)
                if end is not None:
                    st.detok.text, stopped = st.detok.text[:end], True
                elif last:
                    self._skip(st, st.detok.flush())
                text += st.stopper.releasable(st.detok.text, finished=stopped or last)
                if stopped:
                    break
            out.text = text
            if stopped:
                out.new_tokens, out.new_logprobs = out.new_tokens[:kept], out.new_logprobs[:kept]
                out.completion_tokens = st.completion
                if not out.finished:
                    out.finished = True
                    self.on_stop(out.request_id, out.index)
                out.finish_reason = "stop"
            if out.finished:  # later outputs (tokens in flight) are dropped
                st.done = True
            result.append(out)
        return result
