"""What the HTTP server sees of the engine: one interface, and the typed messages between the two.

`EngineClient` is the interface (`generate` an async iterator of `StepOutput`, `abort`, `alive`,
`shutdown`); `dsv4.engine.engine_process.EngineProcess` implements it with the engine in a process of its
own. The messages are small dataclasses, one per kind, so that either side reads them by name:

    server -> engine   AddRequest, Abort (a whole request, or one choice), Stop
    engine -> server   Ready, Failed (start-up), Outputs (one step), RequestFailed (one request)

The stream helpers below hand a request's outputs from the thread that receives them to the asyncio loop
that asked for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from .params import SamplingParams
from .sequence import StepOutput


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can be served."""


# ------------------------------------------------------------------------------------------ messages
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    n: int = 1


@dataclass(frozen=True)
class Abort:
    request_id: str
    index: int | None = None  # None: every choice of the request; else that one (a stop string)


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    info: dict


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Outputs:
    outputs: list[StepOutput]
    metrics: dict
    seconds: float


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    message: str
    bad_request: bool  # the request's own fault (a 400), or the server's (a 500)


# ------------------------------------------------------------------------------------------ interface
class EngineClient(Protocol):
    info: dict

    @property
    def alive(self) -> bool: ...

    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, n: int = 1
    ) -> AsyncIterator[StepOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


# ------------------------------------------------------------------------------------------ streams
@dataclass
class Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n_open: int
    arrival: float = field(default_factory=time.monotonic)


async def stream_outputs(
    owner, request_id: str, stream: Stream, abort_on_error: bool = True
) -> AsyncIterator[StepOutput]:
    """Yield a request's outputs from its stream until each of its sequences finished, then forget the
    stream (`owner.forget(request_id)`). A consumer that leaves early (a client that disconnected) calls
    `owner.abort(request_id)`; an error item is raised, after an abort too where abort_on_error.
    Callers iterate it under `contextlib.aclosing`, so that leaving their own iteration closes (and aborts)
    this one at once rather than when it is collected."""
    finished = False
    try:
        while stream.n_open > 0:
            items = [await stream.queue.get()]
            while not isinstance(items[-1], BaseException) and not stream.queue.empty():
                items.append(stream.queue.get_nowait())  # a consumer that fell behind: one chunk
            error = items.pop() if isinstance(items[-1], BaseException) else None
            for item in coalesce(items):
                if item.finished:
                    stream.n_open -= 1
                yield item
            if error is not None:
                finished = not abort_on_error
                raise error
        finished = True
    finally:
        if not finished:
            owner.abort(request_id)
        owner.forget(request_id)


def coalesce(outputs: list[StepOutput]) -> list[StepOutput]:
    """Outputs of the same choice merged, in order of first appearance (a stream whose reader fell behind
    sends fewer, larger chunks instead of falling further behind)."""
    if len(outputs) == 1:
        return outputs
    merged: dict[int, StepOutput] = {}
    for o in outputs:
        m = merged.get(o.index)
        if m is None:
            merged[o.index] = dataclasses.replace(o, new_tokens=list(o.new_tokens), new_logprobs=list(o.new_logprobs))
            continue
        m.new_tokens += o.new_tokens
        m.new_logprobs += o.new_logprobs
        m.text += o.text
        m.finished, m.finish_reason, m.completion_tokens = o.finished, o.finish_reason, o.completion_tokens
    return list(merged.values())


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def deliver(streams: dict[str, Stream], items: list[tuple[str, StepOutput | BaseException]]) -> None:
    """Hand items to their streams: one wake-up per event loop, not one per item. (Call under the lock
    that guards `streams`; the hand-over itself is thread-safe.)"""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for rid, item in items:
        stream = streams.get(rid)
        if stream is not None:
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the client's loop is gone: nothing to tell
            loop.call_soon_threadsafe(_put_all, batch)
