"""A request's token accounting, one for the streaming and the non-streaming answers of completions and
chat completions alike: the `usage` object (prompt tokens once per prompt whatever n, completion tokens per
choice, prompt tokens served from the prefix cache), the latency metrics (time to first token, the gaps
between tokens, the whole request) and the token counts of the request's log line.

The handlers read the engine's outputs through `Accounting.counted`, which counts each output as it passes
and observes the request's latencies once when the reading ends, however it ends (the last output, an
error, the end of the shutdown grace, a client gone).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from ..engine.sequence import StepOutput
from .metrics import ServerMetrics


class Tracker:
    """Per-request timing for the latency metrics (and the request's log line)."""

    def __init__(self, metrics: ServerMetrics | None, tally: dict | None = None):
        self.metrics, self.t0 = metrics, time.monotonic()
        self.first: float | None = None
        self.first_engine: float | None = None  # the engine's queue + prefill of the first token's sequence
        self.last: float | None = None
        self.gaps: list[float] = []
        self.tally = tally if tally is not None else {}  # {"prompt": n, "completion": n}: the log line
        self.tally.setdefault("completion", 0)

    def tokens(self, n: int, timing: tuple[float, float] | None = None) -> None:
        """n tokens arrived now; `timing`: the engine's (queue, prefill) seconds on a sequence's first output."""
        now = time.monotonic()
        self.tally["completion"] += n
        if timing is not None and self.metrics is not None:
            self.metrics.observe_first(*timing)
        if n:
            if self.first is None:
                self.first = now
                self.first_engine = sum(timing) if timing is not None else None
            elif self.last is not None:
                self.gaps.append((now - self.last) / n)
            self.last = now

    def done(self) -> None:
        if self.metrics is not None:
            ttft = None if self.first is None else self.first - self.t0
            transport = None if ttft is None or self.first_engine is None else max(0.0, ttft - self.first_engine)
            self.metrics.observe_request(ttft, self.gaps, time.monotonic() - self.t0, transport)


class Usage:
    """Token counts of a request as its outputs come (also for choices that never finished)."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, stream: int, choice: int, out: StepOutput) -> None:
        self.prompt[stream] = out.prompt_tokens
        self.cached[stream] = max(self.cached.get(stream, 0), out.cached_tokens)
        self.completion[choice] = out.completion_tokens

    def body(self) -> dict:
        p, c = sum(self.prompt.values()), sum(self.completion.values())
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


class Accounting:
    """The counts of one request of `n` choices per prompt (its clock starts here: create it before the
    request goes to the engine). `tally`: the request's log line counts (`{"prompt": n}`; completion tokens
    are added)."""

    def __init__(self, metrics: ServerMetrics | None, tally: dict, n: int, prompts: int = 1):
        self.n = n
        self.choices = n * prompts
        self.finished: set[int] = set()
        self.usage = Usage()
        self.tracker = Tracker(metrics, tally)

    @contextlib.asynccontextmanager
    async def counted(
        self, outputs: AsyncIterator[tuple[int, StepOutput]]
    ) -> AsyncIterator[AsyncIterator[tuple[int, int, StepOutput]]]:
        """The merged outputs (stream, output) as (stream, choice, output), each counted; leaving the block
        observes the request's latencies (once)."""
        items = self._count(outputs)
        try:
            yield items
        finally:
            await items.aclose()
            self.tracker.done()
            if self.tracker.metrics is not None and len(self.finished) < self.choices:
                # the client left, or the server's shutdown ended them: the engine reports no finish for these
                self.tracker.metrics.observe_aborted(self.choices - len(self.finished))

    async def _count(
        self, outputs: AsyncIterator[tuple[int, StepOutput]]
    ) -> AsyncIterator[tuple[int, int, StepOutput]]:
        async for stream, out in outputs:
            self.tracker.tokens(len(out.new_tokens), out.timing)
            choice = stream * self.n + out.index  # prompt-major: prompt s's choices are s*n ... s*n+n-1
            self.usage.add(stream, choice, out)
            if out.finished:
                self.finished.add(choice)
            yield stream, choice, out

    def body(self) -> dict:
        """The `usage` object of the answer (or of a stream's last chunk)."""
        return self.usage.body()
